"""The engine: validate and admit requests, then step: schedule -> run -> sample -> update.

Single-threaded by design; `async_engine.py` puts it on a background thread.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.adapters.registry import AdapterRegistry
from loraplex.grammar.manager import GrammarManager
from loraplex.platform.config import EngineConfig, ModelConfig
from loraplex.platform.detokenizer import Detokenizer
from loraplex.platform.kv_cache_manager import KVCacheManager, cdiv
from loraplex.platform.model_runner import ModelRunner, kv_bytes_per_block
from loraplex.platform.models.llama import load_model
from loraplex.platform.request import (CompletionOutput, Logprob, Request, RequestOutput,
                                       RequestStatus, SamplingParams)
from loraplex.platform.sampler import Sampler
from loraplex.platform.scheduler import Scheduler


@dataclass
class EngineStats:
    """A snapshot for metrics; taken on the engine thread, read by any."""

    num_running: int = 0  # sequences
    num_waiting: int = 0
    kv_usage: float = 0.0  # blocks held by requests / all blocks (cached-free count as free)
    prefix_cache_queries: int = 0  # tokens looked up / found in the prefix cache
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    max_loras: int = 0


@dataclass
class _Group:
    """The n sequences of one request and their detokenizers."""

    seqs: list[Request]
    detokenizers: list[Detokenizer] = field(default_factory=list)

    @property
    def parent(self) -> Request:
        return self.seqs[0]

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.parent.params.n and all(s.status.finished for s in self.seqs)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.model_config = ModelConfig.from_folder(config.model)
        self.max_model_len = config.resolve_max_model_len(self.model_config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        dtype = config.torch_dtype
        self.model = load_model(config.model, self.model_config, dtype, self.max_model_len, config.pack_weights)
        num_blocks = config.num_kv_blocks or max(
            1, config.kv_cache_memory // kv_bytes_per_block(self.model_config, config.block_size, config.torch_kv_dtype))
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.max_loras, why = config.resolve_max_loras(self.model_config)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   self.max_loras, config.lora_cycle_steps)
        self.adapters = AdapterRegistry(self.model_config, self.max_loras, config.max_lora_rank,
                                        config.max_cpu_loras, dtype, config.lora_memory)
        self.model.attach_lora(self.adapters.slots)
        print(f"[loraplex] adapters: max_loras={self.max_loras} per batch ({why}); CPU cache bounded by "
              f"lora_memory={config.lora_memory / 2**20:.0f} MiB", file=sys.stderr)
        self.runner = ModelRunner(self.model, self.model_config, self.kv, config.torch_kv_dtype)
        self.eos_token_ids = self._eos_token_ids()
        self.grammars = GrammarManager(self.tokenizer, self.model_config.vocab_size, list(self.eos_token_ids),
                                       config.grammar_backend, config.grammar_compile_timeout_s)
        self.sampler = Sampler(self.model_config.vocab_size, self.eos_token_ids, config.seed, self.grammars)
        self.groups: dict[str, _Group] = {}
        self.num_jump_forward_tokens = 0
        self._log_kv_size(num_blocks, config.torch_kv_dtype)

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen = Path(self.config.model) / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return tuple(sorted(ids))

    def _log_kv_size(self, num_blocks: int, dtype) -> None:
        tokens = num_blocks * self.config.block_size
        mib = num_blocks * kv_bytes_per_block(self.model_config, self.config.block_size, dtype) / 2**20
        print(f"[loraplex] KV cache: {num_blocks} blocks x {self.config.block_size} tokens = {tokens} tokens "
              f"({mib:.0f} MiB); max concurrency at max_model_len={self.max_model_len}: "
              f"{tokens / self.max_model_len:.2f}x", file=sys.stderr)

    # ---- admission -------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt: str | dict | list[int], params: SamplingParams,
                     adapter: str | None = None) -> Request:
        """Tokenize and validate; raises ValueError naming the field and the limit (an unknown
        adapter too). Touches no engine state, so any thread may call it."""
        weights = self.adapters.prefetch(adapter) if adapter is not None else None  # disk reads: here, never
        text = None
        if isinstance(prompt, str):
            text = prompt
            ids = self.tokenizer(prompt).input_ids
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
        elif isinstance(prompt, list):
            ids = prompt
        else:
            raise ValueError("prompt must be a string or {'prompt_token_ids': [...]}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        vocab = self.model_config.vocab_size
        if len(ids) == 0:
            raise ValueError("prompt must not be empty (0 tokens)")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}); got {bad[:3]}")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, longer than max_model_len={self.max_model_len}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} plus the prompt's {len(ids)} tokens exceeds "
                             f"max_model_len={self.max_model_len}")
        need = cdiv(len(ids) + params.max_tokens, self.config.block_size)
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"prompt + max_tokens needs {need} KV blocks, the cache has "
                             f"{self.kv.pool.num_blocks} (num_kv_blocks)")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}); got {bad_stop[:3]}")
        request = Request(request_id, ids, params, prompt=text, adapter=adapter)
        request.adapter_weights = weights
        if params.structured is not None:  # compiled here, never on the engine thread
            request.compiled_grammar = self.grammars.compile(params.structured)
        return request

    def add(self, request: Request) -> None:
        if request.request_id in self.groups:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.adapter is not None:
            # pinned until the group ends; the content hash keys its prefix cache, so a reloaded
            # adapter under the same name never sees the old one's KV
            info = self.adapters.pin(request.adapter, request.adapter_weights)
            request.extra_keys, request.adapter_weights = ("lora", info.content_hash), None
        if request.compiled_grammar is not None:
            request.grammar = self.grammars.new_grammar(request.compiled_grammar)
        self.groups[request.request_id] = _Group([request], [self._detokenizer(request)])
        self.scheduler.add(request)

    def add_request(self, request_id: str, prompt, params: SamplingParams, adapter: str | None = None) -> None:
        self.add(self.make_request(request_id, prompt, params, adapter))

    def _detokenizer(self, req: Request) -> Detokenizer:
        return Detokenizer(self.tokenizer, req.prompt_token_ids, req.params.stop, req.params.skip_special_tokens)

    def abort(self, request_id: str) -> RequestOutput | None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        for seq in group.seqs:
            if not seq.status.finished:
                self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
        group.parent.pending_forks = 0
        self._release(group)
        return self._output(group, finished=True)

    def abort_running(self) -> list[str]:
        """After a step that raised: abort every request in the running batch (their state may be
        half-updated); waiting requests are untouched. Returns the aborted request ids."""
        ids = list(dict.fromkeys(r.request_id for r in self.scheduler.running))
        for request_id in ids:
            self.abort(request_id)
        return ids

    def _release(self, group: _Group) -> None:
        if group.parent.adapter is not None:
            self.adapters.unpin(group.parent.adapter)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            len(s.running), len(s.waiting), self.kv.pool.usage, self.kv.num_queries, self.kv.num_hits,
            s.num_preemptions, tuple(sorted(s.running_adapters())),
            tuple(sorted({r.adapter for r in s.waiting if r.adapter is not None})), self.max_loras)

    # ---- one step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                # admission guarantees any one request fits an empty pool: this is a bug, and
                # failing loudly beats spinning forever
                raise RuntimeError(f"scheduler made no progress with {len(self.scheduler.waiting)} waiting")
            return []
        slots = self._assign_adapter_slots()
        logits, completed = self.runner.execute(sched, slots)
        for req, num_new in sched.scheduled:
            req.num_computed_tokens += num_new
        rows, batch = [], []
        for row, req in enumerate(completed):
            for seq in [req, *self._fork(req)]:
                rows.append(row)
                batch.append(seq)
        touched: dict[str, None] = {}
        if batch:
            # forks repeat their parent's row; without them the logits are already one row each
            sampled = self.sampler(logits if len(rows) == len(completed) else logits[rows], batch)
            for seq, token, logprobs in zip(batch, sampled.token_ids, sampled.logprobs):
                self._append(seq, token, logprobs)
                self._jump_forward(seq)
                touched[seq.request_id] = None
        outputs = []
        for request_id in touched:
            group = self.groups[request_id]
            outputs.append(self._output(group, group.finished))
            if group.finished:
                del self.groups[request_id]
                self._release(group)
        return outputs

    def _assign_adapter_slots(self) -> dict[str, int]:
        names = self.scheduler.running_adapters()
        return self.adapters.assign_slots(names) if names else {}

    def _fork(self, parent: Request) -> list[Request]:
        if not parent.pending_forks:
            return []
        group = self.groups[parent.request_id]
        children = []
        for index in range(1, parent.params.n):
            child = Request(parent.request_id, parent.prompt_token_ids, parent.params, parent.prompt,
                            index=index, extra_keys=parent.extra_keys, adapter=parent.adapter)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            if parent.compiled_grammar is not None:  # forks happen before any token: a fresh matcher
                child.compiled_grammar = parent.compiled_grammar
                child.grammar = self.grammars.new_grammar(parent.compiled_grammar)
            self.kv.fork(parent, child)
            self.scheduler.add_running(child)
            group.seqs.append(child)
            group.detokenizers.append(self._detokenizer(child))
            children.append(child)
        parent.pending_forks = 0
        return children

    def _jump_forward(self, req: Request) -> None:
        """Append the tokens a grammar forces next (keys, punctuation, closing brackets). They
        are computed next step in one chunk with the request's other new token, instead of one
        forward pass each. Only a canonical tokenization is taken: the forced text must encode
        the same alone and after the last token, and its last token, which could merge with
        what follows, is left for the model."""
        if not self.config.jump_forward or req.grammar is None or req.status.finished:
            return
        forced = req.grammar.jump_forward_string()
        if not forced:
            return
        tokens = self.tokenizer.encode(forced, add_special_tokens=False)
        last = req.output_token_ids[-1]
        joined = self.tokenizer.encode(self.tokenizer.decode([last]) + forced, add_special_tokens=False)
        if self.tokenizer.decode(tokens) != forced or joined != [last, *tokens]:
            return
        tokens = tokens[:-1][:req.params.max_tokens - len(req.output_token_ids)]
        accepted = 0
        for token in tokens:  # dry run: append only what the matcher takes
            if not req.grammar.accept_token(token):
                break
            accepted += 1
        req.grammar.rollback(accepted)
        for token in tokens[:accepted]:
            self._append(req, token, {token: Logprob(0.0, 1)} if req.logprobs is not None else None)
            self.num_jump_forward_tokens += 1
            if req.status.finished:
                break

    def _append(self, req: Request, token: int, logprobs: dict[int, Logprob] | None) -> None:
        req.output_token_ids.append(token)
        if logprobs is not None:
            for tid, lp in logprobs.items():
                lp.decoded_token = self.tokenizer.decode([tid])
            req.logprobs.append(logprobs)
        p = req.params
        detok = self.groups[req.request_id].detokenizers[req.index]
        stop_string = detok.append(token, check_stop=len(req.output_token_ids) >= p.min_tokens)
        grammar_done = False
        if req.grammar is not None:
            if not req.grammar.accept_token(token):  # cannot happen with a sane mask: end this one only
                req.stop_reason = f"grammar rejected token {token}"
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                return
            grammar_done = req.grammar.is_terminated()
        status = None
        if grammar_done or (token in self.eos_token_ids and not p.ignore_eos):
            status = RequestStatus.FINISHED_STOPPED
        elif token in p.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif stop_string is not None:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_string
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish(req, status)

    def _output(self, group: _Group, finished: bool) -> RequestOutput:
        parent = group.parent
        outputs = []
        for seq, detok in zip(group.seqs, group.detokenizers):
            text = detok.stream_text(seq.status.finished)
            detok.num_emitted = len(text)
            outputs.append(CompletionOutput(seq.index, text, list(seq.output_token_ids),
                                            list(seq.logprobs) if seq.logprobs is not None else None,
                                            seq.finish_reason, seq.stop_reason))
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs,
                             finished, parent.num_cached_tokens)
