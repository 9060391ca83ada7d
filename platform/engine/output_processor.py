"""Core deltas -> caller outputs (vLLM V1's output processor): request groups, incremental
detokenizing, stop strings with hold-back, logprob decoding.

With a reasoning parser (`SamplingParams.reasoning`) each text delta is split into reasoning
and content (grammar/tooling/reasoning.py), and the marker tokens the split and the tool-call reader
need stay in the text even where special tokens are skipped.

Every output is a delta: the text, token ids and logprobs a sequence gained since its last
output, so a step costs O(new tokens) however long the generation (the offline `LLM` and
non-streaming callers add the deltas up with `accumulate`). A stop string found in the text
is reported back, so the core can end that sequence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from loraplex.grammar.tooling.reasoning import CLOSE, OPEN, ReasoningSplitter
from loraplex.grammar.tooling.tool_formats import tool_format
from loraplex.platform.engine.detokenizer import Detokenizer, special_ids
from loraplex.platform.request import CompletionOutput, Logprob, Request, RequestOutput
from loraplex.platform.core.scheduler import SeqDelta

log = logging.getLogger("loraplex.outputs")


@dataclass
class _Seq:
    detokenizer: Detokenizer
    splitter: ReasoningSplitter | None = None  # with a reasoning parser
    num_tokens: int = 0
    num_sent_chars: int = 0
    finished: bool = False
    content: str = ""  # with a splitter: the content so far (what the schema check reads)

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a text delta."""
        if self.splitter is None:
            return "", text
        reasoning, content = self.splitter.feed(text, final=self.finished)
        self.content += content
        return reasoning, content


@dataclass
class _Group:
    request: Request  # the first sequence: prompt, params, n
    seqs: dict[int, _Seq] = field(default_factory=dict)
    num_cached_tokens: int = 0
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.request.params.n and all(s.finished for s in self.seqs.values())


@dataclass
class StopHit:
    request_id: str
    index: int
    stop: str


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}
        self.num_structured_checked = 0
        self.num_schema_violations = {True: 0, False: 0}  # by strict

    def add(self, request: Request) -> None:
        self.groups[request.request_id] = _Group(request)

    def process(self, deltas: list[SeqDelta]) -> tuple[list[RequestOutput], list[StopHit]]:
        """One RequestOutput per request touched (holding the touched sequences), and the stop
        strings found, for the core to end those sequences."""
        touched: dict[str, list[CompletionOutput]] = {}
        hits = []
        for delta in deltas:
            group = self.groups.get(delta.request_id)
            if group is None:  # aborted meanwhile
                continue
            group.num_cached_tokens = max(group.num_cached_tokens, delta.num_cached_tokens)
            out, hit = self._advance(group, delta)
            touched.setdefault(delta.request_id, []).append(out)
            if hit is not None:
                hits.append(hit)
        return [self._output(request_id, outs) for request_id, outs in touched.items()], hits

    def abort(self, request_id: str) -> RequestOutput | None:
        """The last output of an aborted request: each unfinished sequence ends with "abort",
        with whatever text it still held back."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        outs = []
        for index in range(group.request.params.n):
            seq = group.seqs.get(index)
            if seq is not None and seq.finished:
                continue
            reasoning, text = "", ""
            if seq is not None:
                seq.finished = True
                reasoning, text = seq.split(seq.detokenizer.text[seq.num_sent_chars:])
            outs.append(CompletionOutput(index, text, [], [] if group.request.logprobs is not None else None, "abort",
                                         reasoning_text=reasoning))
        req = group.request
        return RequestOutput(request_id, req.prompt, req.prompt_token_ids, outs, True, group.num_cached_tokens,
                             tool_call_format=_tool_call_format(req))

    def _seq(self, request: Request) -> _Seq:
        p, calls = request.params, _tool_call_format(request)
        markers = [*(tool_format(calls).markers if calls else ()), *((OPEN, CLOSE) if p.reasoning is not None else ())]
        tokenizer = request.tokenizer or self.tokenizer  # an adapter's own where it brings one
        keep = special_ids(tokenizer, markers) if markers and p.skip_special_tokens else frozenset()
        detokenizer = Detokenizer(tokenizer, request.prompt_token_ids, p.stop, p.skip_special_tokens,
                                  p.include_stop_str_in_output, keep)
        return _Seq(detokenizer, ReasoningSplitter(p.reasoning) if p.reasoning is not None else None)

    def _advance(self, group: _Group, delta: SeqDelta) -> tuple[CompletionOutput, StopHit | None]:
        seq = group.seqs.get(delta.index)
        if seq is None:
            seq = group.seqs[delta.index] = self._seq(group.request)
        params = group.request.params
        hit = None
        for taken, token in enumerate(delta.new_token_ids, start=1):
            seq.num_tokens += 1
            stop = seq.detokenizer.append(token, check_stop=seq.num_tokens >= params.min_tokens)
            # a token that ended the sequence in the core (EOS, max_tokens) ends it there, whatever its text; a stop
            # string completed before it (verified drafts, forced tokens) ends it first
            if stop is not None and (delta.finish_reason is None or taken < len(delta.new_token_ids)):
                hit = StopHit(delta.request_id, delta.index, stop)
                _cut(delta, taken)  # tokens after the one completing the stop (drafts, forced) were never output
                break
        finish, stop_reason = delta.finish_reason, delta.stop_reason
        if hit is not None:
            finish, stop_reason = "stop", hit.stop
        seq.finished = finish is not None
        logprobs = self._decoded(delta.new_logprobs, group.request.tokenizer) if delta.new_logprobs is not None \
            else None
        detok = seq.detokenizer
        end = detok.stream_end(seq.finished)
        reasoning, text = seq.split(detok.text[seq.num_sent_chars:end])
        seq.num_sent_chars = max(seq.num_sent_chars, end)
        checked = seq.content if seq.splitter is not None else detok.text
        violation = self._check(group.request, delta.index, checked) if finish == "stop" and stop_reason is None \
            else None
        return CompletionOutput(delta.index, text, list(delta.new_token_ids), logprobs, finish, stop_reason,
                                violation, reasoning), hit

    def _check(self, request: Request, index: int, text: str) -> str | None:
        """The backstop: a structured output that its grammar ended is checked against its
        schema before it is returned; a violation is counted and logged (with strict, a bug)."""
        compiled = request.compiled_grammar
        if compiled is None:
            return None
        violation = compiled.violation(text)
        self.num_structured_checked += compiled.spec.kind in ("json", "json_object", "tools")
        if violation is not None:
            strict = compiled.strict_about(violation)
            self.num_schema_violations[strict] += 1
            log.log(logging.ERROR if strict else logging.INFO, "request %s/%d: structured output breaks its schema "
                    "(%s): %s", request.request_id, index, "strict" if strict else "not strict", violation)
        return violation

    def _output(self, request_id: str, outs: list[CompletionOutput]) -> RequestOutput:
        group = self.groups[request_id]
        finished = group.finished
        if finished:
            del self.groups[request_id]
        req = group.request
        unenforced = req.compiled_grammar.unenforced if req.compiled_grammar is not None else ()
        prompt_logprobs = None
        if req.prompt_logprobs is not None and not group.sent_prompt_logprobs:  # complete by the first output
            prompt_logprobs, group.sent_prompt_logprobs = self._decoded(req.prompt_logprobs, req.tokenizer), True
        return RequestOutput(request_id, req.prompt, req.prompt_token_ids, sorted(outs, key=lambda o: o.index),
                             finished, group.num_cached_tokens, unenforced, prompt_logprobs, _tool_call_format(req),
                             req.queue_time_s, req.grammar_wait_s)

    def _decoded(self, entries: list[dict[int, Logprob] | None], tokenizer=None) -> list[dict[int, Logprob] | None]:
        """Each entry's tokens decoded (prompt entries may be None: the first prompt token)."""
        tokenizer = tokenizer or self.tokenizer
        for position in entries:
            for tid, lp in (position or {}).items():
                lp.decoded_token = tokenizer.decode([tid])
        return entries


def _tool_call_format(request: Request) -> str | None:
    spec = request.params.structured
    return spec.tools.format if spec is not None and spec.kind == "tools" else None


def accumulate(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Add a delta to what came before (for callers that want whole outputs)."""
    if total is None:
        total = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, [], False,
                              unenforced=delta.unenforced, tool_call_format=delta.tool_call_format)
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
    by_index = {o.index: o for o in total.outputs}
    for o in delta.outputs:
        have = by_index.get(o.index)
        if have is None:
            by_index[o.index] = CompletionOutput(o.index, o.text, list(o.token_ids),
                                                 list(o.logprobs) if o.logprobs is not None else None,
                                                 o.finish_reason, o.stop_reason, o.schema_violation, o.reasoning_text)
            continue
        have.text += o.text
        have.reasoning_text += o.reasoning_text
        have.token_ids.extend(o.token_ids)
        if o.logprobs is not None and have.logprobs is not None:
            have.logprobs.extend(o.logprobs)
        if o.finish_reason is not None:
            have.finish_reason, have.stop_reason = o.finish_reason, o.stop_reason
            have.schema_violation = o.schema_violation
    total.outputs = [by_index[i] for i in sorted(by_index)]
    total.finished = delta.finished
    total.num_cached_tokens = max(total.num_cached_tokens, delta.num_cached_tokens)
    total.queue_time_s = total.queue_time_s if total.queue_time_s is not None else delta.queue_time_s
    total.grammar_wait_s = total.grammar_wait_s or delta.grammar_wait_s
    return total


def _cut(delta: SeqDelta, num_tokens: int) -> None:
    """Keep a delta's first `num_tokens` tokens (and their logprobs)."""
    del delta.new_token_ids[num_tokens:]
    if delta.new_logprobs is not None:
        del delta.new_logprobs[num_tokens:]
