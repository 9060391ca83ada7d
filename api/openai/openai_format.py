"""Engine outputs -> OpenAI JSON: completion and chat responses (from accumulated outputs), their
stream chunks (one per delta output), logprobs, the model list and error bodies. Pure
functions of the outputs; no engine access."""

from __future__ import annotations

import json
import time
import uuid
from typing import Protocol

from loraplex.grammar.tooling.tools import ToolCallParser, parse_tool_calls
from loraplex.platform.request import CompletionOutput, Logprob, RequestOutput

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 408: "RequestTimeoutError", 409: "ConflictError", 413: "RequestTooLargeError",
               422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError",
               503: "ServiceUnavailableError", 504: "TimeoutError"}


UNENFORCED_HEADER = "x-loraplex-unenforced-keywords"


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"), "param": param,
                      "code": status}}


def _field(loc) -> str:
    return ".".join(str(p) for p in loc if p != "body")


def validation_message(errors: list[dict]) -> str:
    if errors and errors[0].get("type") == "json_invalid":
        return f"the body is not valid JSON: {errors[0].get('ctx', {}).get('error', 'parse error')}"
    parts = []
    for e in errors[:3]:
        where = _field(e.get("loc", ()))
        message = str(e.get("msg")).removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            message = "unknown field (refused rather than silently ignored)"
        parts.append(f"{where}: {message}" if where else message)
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "invalid request: " + "; ".join(parts) + more


def validation_param(errors: list[dict]) -> str | None:
    if errors and errors[0].get("type") == "json_invalid":
        return None
    if errors and errors[0].get("type") == "refused_field":
        return errors[0]["ctx"]["field"]
    return _field(errors[0].get("loc", ())) or None if errors else None


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def model_list(base: str, base_path: str, max_model_len: int, created: int, adapters, paths: bool = False) -> dict:
    """`paths`: each card's `root` is its folder (vLLM's), for the admin; else its id."""
    def card(model_id: str, root: str, parent: str | None) -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "loraplex",
                "root": root if paths and root else model_id, "parent": parent, "max_model_len": max_model_len}

    return {"object": "list", "data": [card(base, base_path, None), *(card(a.name, a.path, base) for a in adapters)]}


def adapter_list(adapters, status: dict | None, served: dict[str, dict[str, int]], paths: bool = False,
                 origin=None) -> dict:
    """The console's adapter table: shape, residency and traffic of each adapter, and the base
    model's traffic. `paths`: each adapter's folder and where it came from (`origin(info)`: an object-storage
    URL, else "folder"), for the admin; else null. `status` None: no residency (a tenant's table: where an
    adapter is moves with every tenant's traffic), and `served` is the caller's own traffic."""
    rows = []
    for a in adapters:
        source = ((origin(a) if origin else None) or "folder") if paths else None
        row = {"id": a.name, "path": a.path if paths else None, "source": source, "rank": a.rank,
               "target_modules": list(a.target_modules), "kind": list(a.kinds)}
        if status is not None:
            where = status.get(a.name)
            row.update(resident=bool(where and where.resident), in_memory=bool(where and where.in_memory),
                       pinned=where.pins if where else 0, tier=where.tier if where else "disk",
                       hits=where.hits if where else 0, misses=where.misses if where else 0,
                       bytes_read=where.bytes_read if where else 0)
        rows.append({**row, **adapter_traffic(served.get(a.name, {}))})
    return {"object": "list", "data": rows, "base": adapter_traffic(served.get("", {}))}


def adapter_page(adapters: list, search: str, offset: int, limit: int | None) -> tuple[list, dict]:
    """One page of adapters in the order they were loaded: those whose name holds `search` (any case), from
    `offset`, at most `limit` (None: all); with the list's `total`, `offset`, `limit` and `has_more` (the console
    pages a thousand)."""
    needle = search.casefold()
    matching = [a for a in adapters if needle in a.name.casefold()]
    page = matching[offset:] if limit is None else matching[offset:offset + limit]
    return page, {"total": len(matching), "offset": offset, "limit": limit,
                  "has_more": offset + len(page) < len(matching)}


def adapter_traffic(counts: dict[str, int]) -> dict[str, int]:
    """An adapter row's traffic fields from its counts."""
    return {"requests": counts.get("requests", 0), "generation_tokens": counts.get("generation_tokens", 0)}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _top(entries: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    return sorted(((t, lp) for t, lp in entries.items() if lp.rank <= num), key=lambda x: x[1].rank)[:num]


def completion_logprobs(out: CompletionOutput, text_offset: int) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for tid, entries in zip(out.token_ids, out.logprobs):
        chosen = entries[tid]
        tokens.append(chosen.decoded_token)
        token_logprobs.append(chosen.logprob)
        top.append({lp.decoded_token: lp.logprob for lp in entries.values()})
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, token id -> logprob, rank, decoded token."""
    return [None if position is None else
            {str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in position.items()} for position in entries]


def echo_logprobs(prompt: str, prompt_ids: list[int], entries: list[dict[int, Logprob] | None], num: int) -> dict:
    """OpenAI's `echo` with `logprobs`: the prompt's tokens come first, the first without a
    logprob (nothing predicts it)."""
    texts = [position[tid].decoded_token or "" if position else "" for tid, position in zip(prompt_ids, entries)]
    rest = "".join(texts[1:])
    texts[0] = prompt[:len(prompt) - len(rest)] if prompt.endswith(rest) else ""
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for tid, text, position in zip(prompt_ids, texts, entries):
        tokens.append(text)
        token_logprobs.append(position[tid].logprob if position else None)
        top.append({lp.decoded_token: lp.logprob for lp in position.values() if lp.rank <= num or lp is position[tid]}
                   if position else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _joined(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(out: CompletionOutput, num: int) -> dict:
    def entry(lp: Logprob) -> dict:
        token = lp.decoded_token or ""
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

    content = [{**entry(entries[tid]), "top_logprobs": [entry(lp) for _, lp in _top(entries, num)]}
               for tid, entries in zip(out.token_ids, out.logprobs)]
    return {"content": content}


class View(Protocol):
    id_prefix: str

    def response(self, outputs: list[RequestOutput]) -> dict: ...
    def stream(self, include_usage: bool) -> "_Stream": ...
    def top_level(self, prompt_index: int) -> dict: ...


def split_reasoning(held: int, o: CompletionOutput) -> tuple[int, int]:
    """Tokens are reasoning until the content starts: `held` tokens whose text was held back before this
    delta (a partial character, a marker), plus its own, are (reasoning, still undecided): a delta with
    reasoning text takes them, one with content text drops them, one with neither holds them on."""
    held += len(o.token_ids)
    if o.text:
        return 0, 0
    return (held, 0) if o.reasoning_text else (0, held)


def unenforced_header(keywords) -> dict[str, str]:
    """strict: false: the schema keywords its grammar dropped (also in the body's `unenforced_keywords`)."""
    return {UNENFORCED_HEADER: "; ".join(keywords)} if keywords else {}


def unenforced(outputs: list[RequestOutput]) -> list[str]:
    """What a non-strict schema's grammar did not enforce (the same for every prompt of a call)."""
    return list(dict.fromkeys(k for out in outputs for k in out.unenforced))


class _Stream:
    """Per-choice progress of one streamed response. The engine's outputs are deltas, so each
    becomes a chunk as it is; this only tracks which choices started and finished, and counts."""

    def __init__(self, view: "CompletionView | ChatView", include_usage: bool) -> None:
        self.view = view
        self.include_usage = include_usage
        self.started: set[int] = set()
        self.finished: set[int] = set()
        self.prompt_tokens: dict[int, int] = {}
        self.completion_tokens: dict[int, int] = {}

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        self.view.saw(prompt_index, out)
        self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        if out.prompt_logprobs is not None:
            self.view.prompts[prompt_index] = out
        chunks = []
        for o in out.outputs:
            choice = prompt_index * self.view.n + o.index
            if choice in self.finished:
                continue
            self.completion_tokens[choice] = self.completion_tokens.get(choice, 0) + len(o.token_ids)
            first = choice not in self.started
            if o.text or o.reasoning_text or first or o.finish_reason or o.token_ids:
                chunk = self.view.chunk(choice, prompt_index, o, o.text, first, self.include_usage)
                if first and out.unenforced:
                    chunk["unenforced_keywords"] = list(out.unenforced)
                if first:
                    chunk.update(self.view.top_level(prompt_index))
                chunks.append(chunk)
            self.started.add(choice)
            if o.finish_reason is not None:
                self.finished.add(choice)
        return chunks

    def usage_chunk(self) -> dict:
        return {**self.view.envelope(chunk=True), "choices": [],
                "usage": _usage(sum(self.prompt_tokens.values()), sum(self.completion_tokens.values()))}


class _Base:
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, model: str, n: int) -> None:
        self.model, self.n = model, n
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompts: dict[int, RequestOutput] = {}  # by prompt: outputs that carry prompt logprobs

    def envelope(self, chunk: bool = False) -> dict:
        return {"id": self.id, "object": self.chunk_object if chunk else self.object_name, "created": self.created,
                "model": self.model}

    def response(self, outputs: list[RequestOutput]) -> dict:
        for i, out in enumerate(outputs):
            self.saw(i, out)
        self.prompts = {i: out for i, out in enumerate(outputs) if out.prompt_logprobs is not None}
        choices = [self.choice(i * self.n + o.index, i, o) for i, out in enumerate(outputs) for o in out.outputs]
        usage = _usage(sum(len(out.prompt_token_ids) for out in outputs),
                       sum(len(o.token_ids) for out in outputs for o in out.outputs))
        dropped = unenforced(outputs)
        return {**self.envelope(), "choices": choices, "usage": usage,
                **({"unenforced_keywords": dropped} if dropped else {}), **self.top_level(0)}

    def top_level(self, prompt_index: int) -> dict:
        """Fields beside the choices (in a stream: in the prompt's first chunk)."""
        return {}

    def saw(self, prompt_index: int, out: RequestOutput) -> None:
        """A streamed output of prompt `prompt_index` arrived (before its chunks are made)."""

    def stream(self, include_usage: bool) -> _Stream:
        return _Stream(self, include_usage)


class CompletionView(_Base):
    def __init__(self, model: str, n: int, echo_prompts: list[str] | None, logprobs: int | None,
                 prompt_logprobs: bool = False) -> None:
        super().__init__(model, n)
        self.echo_prompts, self.logprobs = echo_prompts, logprobs
        self.prompt_logprobs = prompt_logprobs  # vLLM's field asked for: each choice carries them

    def _echo(self, prompt_index: int) -> str:
        return self.echo_prompts[prompt_index] if self.echo_prompts else ""

    def _logprobs(self, prompt_index: int, o: CompletionOutput, offset: int, with_prompt: bool) -> dict | None:
        if self.logprobs is None:
            return None
        lps = completion_logprobs(o, offset)
        prompt = self.prompts.get(prompt_index)
        if with_prompt and self.echo_prompts and prompt is not None:
            lps = _joined(echo_logprobs(self._echo(prompt_index), prompt.prompt_token_ids, prompt.prompt_logprobs,
                                        self.logprobs), lps)
        return lps

    def _prompt_field(self, prompt_index: int, first: bool) -> dict:
        prompt = self.prompts.get(prompt_index)
        if not (self.prompt_logprobs and first and prompt is not None):
            return {}
        return {"prompt_logprobs": prompt_logprobs_json(prompt.prompt_logprobs)}

    def choice(self, index: int, prompt_index: int, o: CompletionOutput) -> dict:
        echo = self._echo(prompt_index)
        lps = self._logprobs(prompt_index, o, len(echo), True)
        return {"index": index, "text": echo + o.text, "logprobs": lps, "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason, **self._prompt_field(prompt_index, True)}

    def chunk(self, index: int, prompt_index: int, o: CompletionOutput, delta: str, first: bool,
              include_usage: bool) -> dict:
        text = (self._echo(prompt_index) if first else "") + delta
        lps = self._logprobs(prompt_index, o, 0, first)
        choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": o.finish_reason,
                  "stop_reason": o.stop_reason, **self._prompt_field(prompt_index, first)}
        return {**self.envelope(chunk=True), "choices": [choice], **({"usage": None} if include_usage else {})}


class ChatView(_Base):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, n: int, top_logprobs: int | None, tools: bool = False,
                 reasoning: bool = False) -> None:
        super().__init__(model, n)
        self.top_logprobs = top_logprobs  # None: no logprobs
        self.tools = tools  # the output is read for tool calls (grammar/tooling/tools.py)
        self.reasoning = reasoning  # the output's reasoning is its own field (--reasoning-parser)
        self._formats: dict[int, str] = {}  # per prompt: the tool-call format its calls are read in
        self._parsers: dict[int, ToolCallParser] = {}  # per streamed choice

    def saw(self, prompt_index: int, out: RequestOutput) -> None:
        if out.tool_call_format is not None:
            self._formats[prompt_index] = out.tool_call_format

    def top_level(self, prompt_index: int) -> dict:
        """vLLM's chat response carries the (one) prompt's logprobs beside the choices."""
        prompt = self.prompts.get(prompt_index)
        return {"prompt_logprobs": prompt_logprobs_json(prompt.prompt_logprobs)} if prompt is not None else {}

    def choice(self, index: int, prompt_index: int, o: CompletionOutput) -> dict:
        lps = chat_logprobs(o, self.top_logprobs) if o.logprobs is not None else None
        message: dict = {"role": "assistant", "content": o.text}
        if self.reasoning:  # as vLLM: a part the output does not have is null
            message["reasoning_content"], message["content"] = o.reasoning_text or None, o.text or None
        finish = o.finish_reason
        if self.tools:
            content, calls = parse_tool_calls(o.text, self._formats.get(prompt_index, "hermes"))
            message["content"] = content
            if calls:
                message["tool_calls"] = [_tool_call(c.id, c.name, c.arguments) for c in calls]
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": index, "message": message, "logprobs": lps, "finish_reason": finish,
                "stop_reason": o.stop_reason}

    def chunk(self, index: int, prompt_index: int, o: CompletionOutput, delta: str, first: bool,
              include_usage: bool) -> dict:
        message: dict = {"role": "assistant"} if first else {}
        if o.reasoning_text:
            message["reasoning_content"] = o.reasoning_text
        finish = o.finish_reason
        if self.tools:
            finish = self._tool_deltas(message, index, prompt_index, delta, first, finish)
        elif delta or first or not o.reasoning_text:  # a reasoning-only delta carries no content
            message["content"] = delta
        lps = chat_logprobs(o, self.top_logprobs) if o.logprobs is not None else None
        choice = {"index": index, "delta": message, "logprobs": lps, "finish_reason": finish,
                  "stop_reason": o.stop_reason}
        return {**self.envelope(chunk=True), "choices": [choice], **({"usage": None} if include_usage else {})}

    def _tool_deltas(self, message: dict, index: int, prompt_index: int, delta: str, first: bool,
                     finish: str | None) -> str | None:
        """The content and `tool_calls` deltas the parser is sure of; the finish reason."""
        parser = self._parsers.setdefault(index, ToolCallParser(self._formats.get(prompt_index, "hermes")))
        content, calls = parser.feed(delta, final=finish is not None)
        if content or first:
            message["content"] = content
        if calls:
            message["tool_calls"] = calls
        if finish is not None:
            finish = "tool_calls" if finish == "stop" and any(c.complete for c in parser.calls) else finish
            del self._parsers[index]
        return finish


def _tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
