"""The engine: one step is schedule -> run -> sample -> update (the core, O(new tokens)), then
the output processor turns the core's per-sequence deltas into delta `RequestOutput`s.

Requests arrive already validated (`input_processor.py`, in the caller's thread). Single-threaded
by design; `async_engine.py` puts it on a background thread.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.adapters.lora_layers import attach_lora
from loraplex.adapters.peft_format import AdapterError
from loraplex.adapters.registry import AdapterRegistry
from loraplex.grammar.manager import GrammarManager
from loraplex.kernels.dispatch import to_device
from loraplex.platform.config import EngineConfig
from loraplex.platform.worker.cuda_graphs import MIX_GRAPH_PASSES, CudaCapture, capture_sizes
from loraplex.platform.spec_decode.drafter import Drafter, grammar_prefix
from loraplex.platform.device import (MemorySnapshot, kv_blocks_for, profile_kv_blocks, profiled_memory,
                                      select_device)
from loraplex.platform.engine.input_processor import InputProcessor, Limits
from loraplex.platform.core.kv_cache_manager import KVCacheManager, reclaim_window
from loraplex.platform.worker.model_runner import ModelRunner, kv_bytes_per_block, profile_step
from loraplex.platform.model_store import gguf_source
from loraplex.platform.models.llama import load_model
from loraplex.platform.engine.output_processor import OutputProcessor
from loraplex.platform.resolve import resolve
from loraplex.platform.request import Request, RequestOutput, SamplingParams
from loraplex.platform.sample.sampler import Sampler, prompt_logprobs
from loraplex.platform.core.scheduler import Scheduler
from loraplex.platform.spec_decode.speculative import SpecCounters
from loraplex.platform.executor.multiproc import TPExecutor, TPRunner
from loraplex.platform.sample.verify import verify

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """A snapshot for metrics; taken on the engine thread, read by any."""

    num_running: int = 0  # sequences
    num_waiting: int = 0
    num_waiting_seqs: int = 0  # what the waiting requests will run (n each): the queue bound counts these
    kv_usage: float = 0.0  # blocks held by requests / all blocks (cached-free count as free)
    prefix_cache_queries: int = 0  # tokens looked up / found in the prefix cache
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    max_loras: int = 0
    structured_checked: int = 0  # finished JSON outputs checked against their schema
    schema_violations_strict: int = 0  # ... and found breaking it (strict: a bug; not strict: dropped keywords)
    schema_violations_lenient: int = 0
    spec_decode: SpecCounters | None = None  # with --speculative-config: drafts, draft tokens, accepted tokens
    spec_decode_by_adapter: dict[str, SpecCounters] = field(default_factory=dict)  # the same per adapter


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        resolved = resolve(config)
        for note in resolved.notes:
            log.info("%s", note)
        self.resolved = resolved
        self.config, self.model_config, self.device = config, model, device = \
            resolved.engine, resolved.model, resolved.device
        self.max_model_len, self.max_loras = resolved.max_model_len, resolved.max_loras
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        select_device(device)  # before anything touches it: loading, the profiling pass, graph capture
        memory_start = MemorySnapshot.measure(device) if device.type == "cuda" else None
        tp = config.tensor_parallel_size > 1  # the model lives in worker processes, sharded; their slots are theirs
        self.adapters = AdapterRegistry(model, self.max_loras, config.max_lora_rank, config.max_cpu_loras,
                                        resolved.kernels.lora_dtype, config.lora_memory,
                                        torch.device("cpu") if tp else device, resolved.kernels.stacked_lora and not tp)
        self.executor: TPExecutor | None = None
        if tp:
            self.model, num_blocks = None, self._start_workers(resolved)
        else:
            self.model = load_model(config.model, model, resolved.kernels, self.max_model_len,
                                    gguf_source(config.model), device)
            lora = attach_lora(self.model, self.adapters.slots, resolved.kernels)  # LoRA layers wrap the model's
            num_blocks = resolved.num_kv_blocks or self._kv_blocks_from_device(memory_start)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 reclaim_window(model.layer_windows))  # all layers sliding: old blocks freed
        self.eos_token_ids = self._eos_token_ids()
        self.grammars = GrammarManager(self.tokenizer, model.vocab_size, list(self.eos_token_ids),
                                       config.grammar_backend, config.grammar_compile_timeout_s,
                                       workers=config.grammar_compile_workers)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   self.max_loras, config.lora_cycle_steps, self.eos_token_ids,
                                   self.grammars.new_grammar)
        if self.executor is not None:
            self.runner = TPRunner(self.executor, self.kv, self.adapters, device)
        else:
            self.runner = ModelRunner(self.model, model, self.kv, config.torch_kv_dtype, lora, device)
        if device.type == "cuda" and not config.enforce_eager and self.executor is None:
            self.runner.enable_graphs(CudaCapture(), config.max_num_seqs, self.max_model_len,
                                      self.adapters.slots.null_slot,
                                      min(MIX_GRAPH_PASSES, config.max_adapters_per_request))
        self.sampler = Sampler(model.vocab_size, self.eos_token_ids, config.seed, self.grammars,
                               config.json_close_window, device)
        self.inputs = InputProcessor(self.tokenizer, Limits(model.vocab_size, self.max_model_len,
                                                            config.max_num_seqs, config.block_size, num_blocks,
                                                            config.max_adapters_per_request, self.max_loras),
                                     self.adapters, self.grammars)
        self.outputs = OutputProcessor(self.tokenizer)
        spec = config.speculative
        self.drafter = Drafter(spec, self.tokenizer, self.max_model_len) if spec is not None else None
        self.num_jump_forward_tokens = 0
        self._log_kv_size(num_blocks, config.torch_kv_dtype)

    def _start_workers(self, resolved) -> int:
        """Tensor parallelism: the workers started, each with its shard; the KV blocks every rank can hold."""
        self.executor = executor = TPExecutor(resolved)
        self.adapters.verify = _refuse_vocabulary_adapters
        try:
            if resolved.num_kv_blocks is not None:
                return resolved.num_kv_blocks
            num_blocks = min(executor.call("kv_blocks", every=True))  # CUDA: what the fullest device leaves
            executor.call("allocate_kv", num_blocks)
            return num_blocks
        except BaseException:
            executor.close()
            raise

    def close(self) -> None:
        """Stop what the engine started outside its process (tensor parallelism's workers)."""
        if self.executor is not None:
            self.executor.close()

    def _kv_blocks_from_device(self, start: MemorySnapshot) -> int:
        return device_kv_blocks(self.model, self.model_config, self.config, self.max_model_len, self.device, start)

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
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB); max concurrency at max_model_len=%d: "
                 "%.2fx", num_blocks, self.config.block_size, tokens, mib, self.max_model_len,
                 tokens / self.max_model_len)

    # ---- admission -------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.request_id in self.scheduler.groups:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        grammar = self.grammars.new_grammar(request.compiled_grammar) if request.compiled_grammar is not None else None
        extra_keys = request.extra_keys
        if request.mix is not None:  # last, as below; each adapter of the mix pinned, all or none
            infos = self.adapters.pin_all(request.mix.names, request.adapter_weights)
            # every adapter's content hash and its weight: another mix (or weight) never shares this KV
            extra_keys = ("lora-mix", *((info.content_hash, weight)
                                        for info, (_, weight) in zip(infos, request.mix.entries)))
        elif request.adapter is not None:  # last: nothing after it may fail and leak the pin
            # pinned until the group ends; the content hash keys its prefix cache, so a reloaded
            # adapter under the same name never sees the old one's KV
            extra_keys = ("lora", self.adapters.pin(request.adapter, request.adapter_weights).content_hash)
        # the tenant's namespace and the request's salt first: equal prompts of two tenants never share
        # KV blocks, so one cannot time another's cached prompts
        request.admit(request.cache_salt + extra_keys, grammar)
        self.scheduler.add(request)
        self.outputs.add(request)

    def add_request(self, request_id: str, prompt, params: SamplingParams, adapter: str | None = None) -> None:
        self.add(self.inputs.process(request_id, prompt, params, adapter))

    def abort(self, request_id: str) -> RequestOutput | None:
        if self.scheduler.abort(request_id):
            self._release_finished()
        return self.outputs.abort(request_id)

    def abort_running(self) -> list[str]:
        """After a step that raised: abort every request in the running batch (their state may be
        half-updated); waiting requests are untouched. Returns the aborted request ids."""
        ids = list(dict.fromkeys(r.request_id for r in self.scheduler.running))
        for request_id in ids:
            self.abort(request_id)
        return ids

    def _release_finished(self) -> None:
        for seqs in self.scheduler.pop_finished_groups():
            for name in seqs[0].adapter_names:  # a mix pinned each of its adapters
                self.adapters.unpin(name)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.groups)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting),
            num_waiting_seqs=sum(r.pending_forks + 1 for r in s.waiting), kv_usage=self.kv.pool.usage,
            prefix_cache_queries=self.kv.num_queries, prefix_cache_hits=self.kv.num_hits,
            num_preemptions=s.num_preemptions, running_adapters=tuple(sorted(s.running_adapters())),
            waiting_adapters=tuple(sorted({name for r in s.waiting for name in r.adapter_names})),
            max_loras=self.max_loras, structured_checked=self.outputs.num_structured_checked,
            schema_violations_strict=self.outputs.num_schema_violations[True],
            schema_violations_lenient=self.outputs.num_schema_violations[False],
            spec_decode=self.drafter.counters.copy() if self.drafter is not None else None,
            spec_decode_by_adapter={name: c.copy() for name, c in self.drafter.by_adapter.items()}
            if self.drafter is not None else {})

    # ---- one step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step; the outputs are deltas (what each touched request gained)."""
        outputs, stops = self.outputs.process(self._core_step())
        for hit in stops:  # a stop string ends its sequence in the core too
            self.scheduler.stop(hit.request_id, hit.index, hit.stop)
        self._release_finished()
        return outputs

    def _core_step(self):
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                # admission guarantees any one request fits an empty pool: this is a bug, and
                # failing loudly beats spinning forever
                raise RuntimeError(f"scheduler made no progress with {len(self.scheduler.waiting)} waiting")
            return []
        logits, completed, prompt_rows = self.runner.execute(sched, self._assign_adapter_slots())
        for rows in prompt_rows:
            self._add_prompt_logprobs(rows)
        rows, batch = self.scheduler.sampling_batch(sched)
        if not batch:
            return []
        if any(seq.spec_token_ids for seq in batch):
            deltas = self._verify(logits, rows, batch)
        else:
            # forks repeat their parent's row; without them the logits are already one row each
            if len(rows) != len(completed):
                logits = logits[to_device(torch.tensor(rows, dtype=torch.long, device="cpu"), logits.device)]
            sampled = self.sampler(logits, batch)
            deltas = self.scheduler.update(batch, sampled.token_ids, sampled.logprobs, self._forced_tokens)
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running)
        return deltas

    def _verify(self, logits: torch.Tensor, rows: list[int], batch: list[Request]):
        """Sample with drafts (`verify.py`): each sequence's accepted drafts and next token appended, the KV of
        its rejected drafts given back."""
        deltas = [self.scheduler.new_delta(seq) for seq in batch]
        accepted = verify(self.sampler, logits, rows, batch,
                          lambda i, token, lp: self.scheduler.append(batch[i], token, lp, deltas[i]))
        for seq, delta, num_accepted in zip(batch, deltas, accepted):
            self.drafter.record(seq, len(seq.spec_token_ids), num_accepted)
            self.scheduler.reject_drafts(seq, num_accepted)
            self.scheduler.close_delta(seq, delta, self._forced_tokens)
        return deltas

    def _add_prompt_logprobs(self, rows) -> None:
        """The logprobs of the prompt tokens these rows predict; after a preemption the prompt
        is computed again, and what is known already is skipped."""
        req = rows.request
        skip = len(req.prompt_logprobs) - rows.first
        targets = req.prompt_token_ids[rows.first + max(skip, 0):rows.first + len(rows.hidden)]
        if targets and skip >= 0:
            req.prompt_logprobs += prompt_logprobs(rows.compute_logits, rows.hidden[skip:], targets,
                                                   req.params.prompt_logprobs)

    def _assign_adapter_slots(self) -> dict[str, int]:
        names = self.scheduler.running_adapters()
        return self.adapters.assign_slots(names) if names else {}

    def _forced_tokens(self, req: Request) -> list[int]:
        """The tokens a grammar forces next (keys, punctuation, closing brackets), for the
        scheduler to append: they are computed next step in one chunk with the request's other
        new token, instead of one forward pass each. Only a canonical tokenization is taken: the
        forced text must encode the same alone and after the last token, and its last token,
        which could merge with what follows, is left for the model."""
        if not self.config.jump_forward or req.grammar is None or \
                self.drafter is not None and self.drafter.takes_forced(req, len(self.scheduler.running)):  # drafted
            return []
        forced = req.grammar.jump_forward_string()
        if not forced:
            return []
        tokens = self.tokenizer.encode(forced, add_special_tokens=False)
        last = req.output_token_ids[-1]
        joined = self.tokenizer.encode(self.tokenizer.decode([last]) + forced, add_special_tokens=False)
        if self.tokenizer.decode(tokens) != forced or joined != [last, *tokens]:
            return []
        tokens = tokens[:-1][:req.params.max_tokens - len(req.output_token_ids)]
        tokens = grammar_prefix(req.grammar, tokens)  # dry run: only what the matcher takes
        self.num_jump_forward_tokens += len(tokens)
        return tokens


def _refuse_vocabulary_adapters(info, weights) -> None:
    """Tensor parallelism splits the vocabulary over the ranks; an adapter's embedding or head weights are whole."""
    if weights.embedding or weights.head or weights.replacements:
        raise AdapterError(f"adapter {info.name!r} changes the embedding or the LM head (LoRA on them, or "
                           "modules_to_save): not served under tensor parallelism, whose vocabulary is split over "
                           "the ranks")


def device_kv_blocks(model, model_config, config: EngineConfig, max_model_len: int, device: torch.device,
                     start: MemorySnapshot) -> int:
    """CUDA: what `gpu_memory_utilization` leaves after a profiling pass at max_num_batched_tokens (a
    tensor-parallel rank: its shard, with its KV heads)."""
    block_bytes = kv_bytes_per_block(model_config, config.block_size, config.torch_kv_dtype)
    profile_kv = profile_kv_blocks(config.max_num_batched_tokens, max_model_len, config.block_size)
    graph_share = 0.0 if config.enforce_eager or config.tensor_parallel_size > 1 else \
        capture_sizes(config.max_num_seqs)[-1] / config.max_num_batched_tokens  # a decode graph: a token a row

    def profile() -> None:
        profile_step(model, model_config, config.torch_kv_dtype, config.block_size, config.max_num_batched_tokens,
                     max_model_len, config.max_num_seqs, device)

    memory = profiled_memory(device, start, profile, profile_kv * block_bytes, graph_share)
    num_blocks = kv_blocks_for(memory, config.gpu_memory_utilization, block_bytes)
    log.info("KV sized from the device: %s", memory.describe(config.gpu_memory_utilization))
    return num_blocks
