"""`Engine`: the synchronous front end around the engine core (vLLM's `LLMEngine`). It owns the tokenizer, the
input processor (prompt -> validated `Request`, in the caller's thread) and the output processor (the core's
per-sequence deltas -> delta `RequestOutput`s: detokenizing, stop strings, reasoning); the adapter registry and
the grammar manager are shared with the core, which pins slots and fills masks. `LLM` steps it in the caller's
thread, `AsyncEngine` on a thread of its own.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from loraplex.adapters.registry import AdapterRegistry
from loraplex.adapters.heap import return_large_frees
from loraplex.adapters.spill import SpillStore
from loraplex.adapters.saved_norms import norm_dims
from loraplex.grammar.compile_cache import resolve_dir
from loraplex.grammar.manager import GrammarManager
from loraplex.platform.config import EngineConfig
from loraplex.platform.core.engine_core import EngineCore, EngineStats
from loraplex.platform.device import MemorySnapshot, select_device
from loraplex.platform.engine.input_processor import InputProcessor, Limits
from loraplex.platform.engine.output_processor import OutputProcessor
from loraplex.platform.executor.factory import executor_class
from loraplex.platform.models.llama import DecoderModel, checkpoint_weights
from loraplex.platform.request import Request, RequestOutput, SamplingParams
from loraplex.platform.resolve import ResolvedConfig, resolve

log = logging.getLogger(__name__)


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
        select_device(device)  # this thread's; each rank selects its own before loading
        # before the adapter slots (on the device with one rank): the KV budget is what weights and slots leave
        memory_start = MemorySnapshot.measure(device) if device.type == "cuda" else None
        executor = executor_class(resolved)
        self.adapters = _registry(resolved, executor.uses_engine_slots)
        self.adapters.base_tokenizer = self.tokenizer
        self.eos_token_ids = _eos_token_ids(self.tokenizer, model.eos_token_ids, config.model)
        self.grammars = GrammarManager(self.tokenizer, model.vocab_size, list(self.eos_token_ids),
                                       config.grammar_backend, config.grammar_compile_timeout_s,
                                       workers=config.grammar_compile_workers,
                                       cache_dir=resolve_dir(config.grammar_cache_dir),
                                       cache_size=config.grammar_cache_size,
                                       within_budget=config.finish_within_budget)
        self.core = EngineCore(resolved, executor(resolved, self.adapters, memory_start), self.adapters,
                               self.grammars, self.tokenizer, self.eos_token_ids)
        try:
            self._front_end(resolved)
        except BaseException:
            self.core.close()
            raise

    def _front_end(self, resolved: ResolvedConfig) -> None:
        config, model = resolved.engine, resolved.model
        self.inputs = InputProcessor(self.tokenizer, Limits(model.vocab_size, self.max_model_len,
                                                            config.max_num_seqs, config.block_size,
                                                            self.core.num_blocks, config.max_adapters_per_request,
                                                            self.max_loras, config.scheduling_policy),
                                     self.adapters, self.grammars)
        self.outputs = OutputProcessor(self.tokenizer)

    def close(self) -> None:
        """Stop what the engine started outside its process (tensor parallelism's workers) and its threads (the
        prefetcher, the disk tier's writer, with its files)."""
        self.core.close()
        self.adapters.close()

    # ---- requests ----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.core.add(request)
        self.outputs.add(request)

    def add_request(self, request_id: str, prompt, params: SamplingParams, adapter: str | None = None) -> None:
        self.add(self.inputs.process(request_id, prompt, params, adapter))

    def abort(self, request_id: str) -> RequestOutput | None:
        self.core.abort(request_id)
        return self.outputs.abort(request_id)

    def abort_running(self) -> list[str]:
        """After a step that raised: abort every request in the running batch; back: their ids."""
        ids = self.core.abort_running()
        for request_id in ids:
            self.outputs.abort(request_id)
        return ids

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def unfinished_request_ids(self) -> list[str]:
        return self.core.unfinished_request_ids()

    def stats(self) -> EngineStats:
        return self.core.stats(structured_checked=self.outputs.num_structured_checked,
                               schema_violations_strict=self.outputs.num_schema_violations[True],
                               schema_violations_lenient=self.outputs.num_schema_violations[False])

    def step(self) -> list[RequestOutput]:
        """One core step; the outputs are deltas (what each touched request gained)."""
        outputs, stops = self.outputs.process(self.core.step())
        self.core.stop(stops)  # a stop string ends its sequence in the core too
        return outputs


def _registry(resolved: ResolvedConfig, on_device: bool) -> AdapterRegistry:
    """The adapter registry: its slots on the engine's device where the executor's rank serves from them, else
    on the host (the ranks keep their own shards)."""
    config, kernels = resolved.engine, resolved.kernels
    return_large_frees()  # adapters read and dropped by the thousand: their memory goes back, not to the heap
    registry = AdapterRegistry(resolved.model, resolved.max_loras, config.max_lora_rank, config.max_cpu_loras,
                               kernels.lora_dtype, config.lora_memory,
                               resolved.device if on_device else torch.device("cpu"), kernels.stacked_lora and on_device,
                               SpillStore(config.lora_spill_size) if config.lora_spill_size else None)
    if not on_device:
        _base_from_checkpoint(registry, resolved)
    return registry


def _base_from_checkpoint(registry: AdapterRegistry, resolved: ResolvedConfig) -> None:
    """Under tensor parallelism the ranks hold the model and the engine none: what an adapter read here is checked
    against (its norms, its copies of the table and head, DoRA's norms of whole rows) comes from a model built on
    the meta device and from the checkpoint (served as it is: the ranks take float weights only)."""
    with torch.device("meta"):
        registry.slots.norm_dims = norm_dims(DecoderModel(resolved.model, 1, resolved.kernels))
    dense, projection = checkpoint_weights(resolved.engine.model, resolved.model, resolved.kernels.dtype)
    registry.slots.set_base(resolved.kernels.dtype, dense, None, projection)


def _eos_token_ids(tokenizer, model_eos: tuple[int, ...], folder: str) -> tuple[int, ...]:
    ids = set(model_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen = Path(folder) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(sorted(ids))
