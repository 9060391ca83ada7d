"""A rank: its device, its shard of the model (the whole model with one rank), the LoRA layers around it, its KV
heads' cache, its decode graphs, and the one `ModelRunner` that runs each step. The executor (`executor/`) holds
one in its own process (one rank) or one per worker process (`worker_main`, tensor parallelism); either way the
engine sends the same `ModelInput` and reads rank 0's answer.

Nothing here schedules, samples, reads a grammar or opens an adapter folder: those stay in the engine's process
(vLLM's worker split). A rank in the engine's process serves from the engine's own adapter slots; a rank in a
worker process keeps slots of its own, following the engine's by the slot changes each step carries (each new
adapter as the engine read and checked it, `pack_adapter`), and holds its shards of each adapter.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

from loraplex.adapters.lora_layers import attach_lora
from loraplex.adapters.moe_weights import MoELoRA
from loraplex.adapters.peft_format import LoRAWeights
from loraplex.adapters.saved_projections import shard_replacement
from loraplex.adapters.variants import ProjectionTerms
from loraplex.adapters.slots import LoRASlots
from loraplex.kernels import cpu_kernels
from loraplex.platform.config import EngineConfig
from loraplex.platform.device import (MemorySnapshot, kv_blocks_for, profile_kv_blocks, profiled_memory,
                                      select_device)
from loraplex.platform.distributed import use_shared_memory
from loraplex.platform.model_store import gguf_source
from loraplex.platform.models.llama import load_model
from loraplex.platform.models.sharding import ShardPlan, gate_up_rows, local_config, o_cols, plan_for, qkv_rows, span
from loraplex.platform.resolve import ResolvedConfig, resolve
from loraplex.platform.worker.cuda_graphs import MIX_GRAPH_PASSES, Capture, CudaCapture, capture_sizes
from loraplex.platform.worker.model_runner import ModelInput, ModelRunner, kv_bytes_per_block, profile_step

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a rank stuck past this in a gloo / NCCL collective fails


class Worker:
    def __init__(self, resolved: ResolvedConfig, rank: int = 0, size: int = 1, slots: LoRASlots | None = None,
                 segment: str | None = None, device: torch.device | None = None,
                 memory_start: MemorySnapshot | None = None) -> None:
        """`slots`: the engine's adapter slots, for a rank in the engine's process (else the rank makes its own);
        `segment`: the shared-memory all-reduce's, where the executor made one; `device`: the rank's (`rank_device`;
        default the engine's); `memory_start`: CUDA's memory before anything of the engine was allocated (measured
        here when not given), from which `kv_blocks` sizes the cache."""
        config = self.engine_config = resolved.engine
        self.rank, self.resolved = rank, resolved
        self.device = device or resolved.device
        select_device(self.device)  # before anything touches it: loading, the profiling pass, graph capture
        if segment is not None:  # the executor decided (the same for every rank): float32 on the CPU, C kernels built
            use_shared_memory(segment, rank, size)
        if memory_start is None and self.device.type == "cuda":
            memory_start = MemorySnapshot.measure(self.device)
        self.memory_start = memory_start
        self.plan = plan_for(resolved.model, size, rank) if size > 1 else None  # one rank: the whole model
        self.config = local_config(resolved.model, self.plan) if self.plan else resolved.model
        self.model = load_model(config.model, self.config, resolved.kernels, resolved.max_model_len,
                                None if self.plan else gguf_source(config.model), self.device)
        stacked = resolved.kernels.stacked_lora
        self.slots = slots if slots is not None else \
            LoRASlots(self.config, resolved.max_loras, resolved.kernels.lora_dtype, self.device,
                      config.max_lora_rank if stacked else None)
        lora = attach_lora(self.model, self.slots, resolved.kernels)  # LoRA layers wrap the model's
        self.runner = ModelRunner(self.model, self.config, lora, config.torch_kv_dtype, config.block_size,
                                  self.device)

    def kv_blocks(self) -> int:
        """CUDA: what `gpu_memory_utilization` leaves on this rank's device after its shard and a profiling pass at
        max_num_batched_tokens (with its KV heads), less the decode graphs' share unless eager."""
        config, model_config = self.engine_config, self.config
        max_model_len = self.resolved.max_model_len
        block_bytes = kv_bytes_per_block(model_config, config.block_size, config.torch_kv_dtype)
        profile_kv = profile_kv_blocks(config.max_num_batched_tokens, max_model_len, config.block_size)
        graph_share = 0.0 if config.enforce_eager else \
            capture_sizes(config.max_num_seqs)[-1] / config.max_num_batched_tokens  # a decode graph: a token a row

        def profile() -> None:
            profile_step(self.model, model_config, config.torch_kv_dtype, config.block_size,
                         config.max_num_batched_tokens, max_model_len, config.max_num_seqs, self.device)

        memory = profiled_memory(self.device, self.memory_start, profile, profile_kv * block_bytes, graph_share)
        log.info("KV sized from the device: %s", memory.describe(config.gpu_memory_utilization))
        return kv_blocks_for(memory, config.gpu_memory_utilization, block_bytes)

    def allocate_kv(self, num_blocks: int) -> None:
        self.runner.allocate_kv(num_blocks)

    def capture_graphs(self, capture: Capture | None = None) -> None:
        """The decode graphs (`capture`: CUDA's unless given, as tests give the CPU stand-in), with LoRA where slots
        are stacked."""
        config = self.engine_config
        self.runner.enable_graphs(capture or CudaCapture(), config.max_num_seqs,
                                  self.resolved.max_model_len, self.slots.null_slot,
                                  min(MIX_GRAPH_PASSES, config.max_adapters_per_request))

    def graph_replays(self) -> int:
        """How many decode steps replayed a graph on this rank (0 without graphs)."""
        graphs = self.runner.graphs
        return sum(graphs.num_replays.values()) if graphs is not None else 0

    @torch.inference_mode()
    def execute(self, step: ModelInput) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The logits of `step.last_rows` (None: none sampled) and the hidden rows of its prompt runs."""
        for slot, weights in step.slot_changes:
            if weights is None:
                self.slots.clear(slot)
            else:
                self.slots.load(slot, shard_adapter(unpack_adapter(weights), self.plan))
        return self.runner.execute(step)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, slots: list[int] | None) -> torch.Tensor:
        """The whole logits of these rows (a shard's head all-gathers them), in the model's dtype."""
        return self.runner.logits(hidden.to(self.device), slots)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th CUDA device from the engine's; the CPU is every rank's."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def pack_adapter(weights: LoRAWeights) -> bytes:
    """An adapter for the pipe. Its tensors are views into one buffer, and pickle would copy the whole buffer for
    each of them: torch.save writes each storage once."""
    buffer = io.BytesIO()
    torch.save(dataclasses.replace(weights, tokenizer=None), buffer)  # the ranks never tokenize
    return buffer.getvalue()


def unpack_adapter(data: bytes) -> LoRAWeights:
    return torch.load(io.BytesIO(data), weights_only=False)  # from the engine's own pipe, never a client's bytes


def shard_adapter(weights: LoRAWeights, plan: ShardPlan | None) -> LoRAWeights:
    """An adapter's projections as this rank's layers hold them: for a column-parallel projection (q/k/v,
    gate/up) the rank's output columns of B^T, A whole (the shrink reads the whole input); for a row-parallel one
    (o, down) the rank's input columns of A, B^T whole (each rank's expand of its partial shrink is a partial sum
    the layer's all-reduce adds up; B's bias there is added by rank 0 alone). Without a plan, the whole adapter."""
    if plan is None:
        return weights
    columns = {"qkv_proj": qkv_rows(plan), "gate_up_proj": gate_up_rows(plan.intermediate, plan.intermediate_size)}
    rows = {"o_proj": o_cols(plan), "down_proj": span(*plan.intermediate)}
    projections, terms = {}, {}
    for (layer, fused), (a, b_t) in weights.projections.items():
        if fused in columns:
            b_t = b_t.index_select(1, columns[fused]).contiguous()
        else:
            a = a.index_select(1, rows[fused]).contiguous()
        projections[(layer, fused)] = (a, b_t)
    for key, term in weights.terms.items():
        terms[key] = shard_terms(term, columns.get(key[1]), rows.get(key[1]), plan.rank)
    moe = {layer: shard_moe(lora, plan) for layer, lora in weights.moe.items()}
    return dataclasses.replace(weights, projections=projections, terms=terms, moe=moe)


def shard_terms(term: ProjectionTerms, columns: torch.Tensor | None, inputs: torch.Tensor | None, rank: int
                ) -> ProjectionTerms:
    """B's bias, DoRA's factor and the adapter's own rows of a projection as a rank applies them: a
    column-parallel rank's rows of each (`columns`); a row-parallel rank's output is a partial sum, so the factor
    (linear in it) whole on every rank, the bias on rank 0 alone, own weights by the rank's input columns
    (`inputs`)."""
    replacement = term.replacement and shard_replacement(term.replacement, columns, inputs, rank)
    if columns is not None:
        pick = lambda t: None if t is None else t.index_select(0, columns)  # noqa: E731
        return dataclasses.replace(term, bias=pick(term.bias), factor=pick(term.factor), replacement=replacement)
    return dataclasses.replace(term, bias=term.bias if rank == 0 else None, replacement=replacement)


def shard_moe(lora: MoELoRA, plan: ShardPlan) -> MoELoRA:
    """A sparse layer's LoRA as this rank holds the layer: its experts' LoRAs (the router's whole, as the router
    is), and its columns of the shared expert (gate and up: their output rows of B; down: its input columns of A)."""
    first, end = plan.experts
    cols = span(*plan.shared_expert)
    experts = lambda part: part and dataclasses.replace(part, a=part.a[first:end], b=part.b[first:end])  # noqa: E731
    shared = {name: dataclasses.replace(part, b=part.b.index_select(0, cols).contiguous()) if name in
              ("gate_proj", "up_proj") else dataclasses.replace(part, a=part.a.index_select(1, cols).contiguous())
              if name == "down_proj" else part for name, part in lora.shared.items()}
    return MoELoRA(lora.router, experts(lora.gate_up), experts(lora.down), shared)


def worker_main(config: EngineConfig, rank: int, size: int, device: torch.device, init_method: str, conn,
                threads: int, segment: str | None) -> None:
    """A worker process on `device` (`rank_device`): join the group, build the rank, then answer the engine until it
    closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the engine stops the workers
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{rank} %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(threads)
    backend = "nccl" if config.torch_device.type == "cuda" else "gloo"
    try:
        if backend == "nccl":
            torch.cuda.set_device(device)  # before the group: NCCL binds each rank to its current device
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)
        worker = Worker(resolve(config), rank, size, None, segment, device)
    except Exception as exc:  # the engine reports it and stops the others
        log.exception("tensor-parallel rank %d failed to start", rank)
        conn.send_bytes(pickle.dumps(("error", f"rank {rank}: {type(exc).__name__}: {exc}")))
        return
    conn.send_bytes(pickle.dumps(("ok", None)))
    serve(worker, conn, rank)
    dist.destroy_process_group()


def serve(worker: Worker, conn, rank: int) -> None:
    """Run each call the engine sends; rank 0 answers with the result on the host, the others with None (every
    rank's result is the same after the collectives) unless the call asks for every rank's (`every`)."""
    while True:
        try:
            method, args, every = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the engine closed the pipe or died: nothing more to do
            return
        try:
            result = getattr(worker, method)(*args)
            reply = ("ok", _to_host(result) if rank == 0 or every else None)
        except Exception as exc:
            log.exception("tensor-parallel rank %d: %s failed", rank, method)
            reply = ("error", f"rank {rank}: {type(exc).__name__}: {exc}")
        conn.send_bytes(pickle.dumps(reply))


def _to_host(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


def uses_shared_memory(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the ranks all-reduce through shared memory: float32 on the CPU, with the C kernels built (decided once,
    by the executor, for every rank)."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_kernels.library() is not None
