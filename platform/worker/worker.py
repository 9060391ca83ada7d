"""A tensor-parallel worker process: one rank's shard of the model, its KV heads' cache and its shards of the
adapters in the engine's slots. It runs what the engine sends (`tp_executor.py`), one message at a time: a step
(`StepMessage`), or the logits of given hidden rows. Every rank runs every call; rank 0's answer is the call's
(the hidden states and logits are the same on every rank after the collectives), the others answer None.

Nothing here schedules, samples, reads a grammar or opens an adapter folder: those stay in the engine's process
(vLLM's worker split). An adapter reaches a rank as the engine read and checked it, with the step whose slot
change puts it in a slot, and the rank keeps its shards of it.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import signal
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from loraplex.adapters.lora_layers import attach_lora
from loraplex.adapters.peft_format import LoRAWeights
from loraplex.adapters.slots import LoRASlots
from loraplex.kernels import cpu_kernels
from loraplex.platform.config import EngineConfig
from loraplex.platform.device import MemorySnapshot, select_device
from loraplex.platform.executor.distributed import use_shared_memory
from loraplex.platform.worker.model_runner import copy_blocks, forward_batch, kv_cache_for
from loraplex.platform.models.llama import load_model
from loraplex.platform.models.sharding import ShardPlan, gate_up_rows, local_config, o_cols, plan_for, qkv_rows, span
from loraplex.platform.resolve import resolve

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a rank stuck past this in a gloo / NCCL collective fails


@dataclass
class StepMessage:
    """One step's flat batch, as the engine's runner built it (`model_runner.StepInputs`), for every rank."""

    slot_changes: list[tuple[int, bytes | None]]  # since the last step, in order: `pack_adapter`'s (None: emptied)
    block_copies: list[tuple[int, int]]
    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: torch.Tensor  # the step's rows [R, width], int32
    seq_lens: list[int]
    starts: list[int]
    max_query_len: int
    lora_slots: list[int] | None
    mix_passes: list[tuple[list[int], list[float]]] | None
    last_rows: list[int]  # the rows whose logits the engine samples
    row_slots: list[int] | None
    prompt_rows: list[tuple[int, int]]  # [start, end) of hidden rows the engine keeps for prompt logprobs


class Worker:
    def __init__(self, config: EngineConfig, rank: int, size: int, num_blocks: int | None,
                 segment: str | None) -> None:
        resolved = resolve(config)
        self.rank, self.device = rank, torch.device("cuda", rank) if resolved.device.type == "cuda" else \
            torch.device("cpu")
        select_device(self.device)
        if segment is not None:  # the engine decided (the same for every rank): float32 on the CPU, C kernels built
            use_shared_memory(segment, rank, size)
        self.memory_start = MemorySnapshot.measure(self.device) if self.device.type == "cuda" else None
        self.plan = plan_for(resolved.model, size, rank)
        self.config = local_config(resolved.model, self.plan)
        self.kernels, self.block_size = resolved.kernels, config.block_size
        self.engine_config, self.max_model_len = config, resolved.max_model_len
        self.model = load_model(config.model, self.config, resolved.kernels, resolved.max_model_len, None,
                                self.device)
        stacked = resolved.kernels.stacked_lora
        self.slots = LoRASlots(self.config, resolved.max_loras, resolved.kernels.lora_dtype, self.device,
                               config.max_lora_rank if stacked else None)
        self.lora = attach_lora(self.model, self.slots, resolved.kernels)
        if num_blocks is not None:
            self.allocate_kv(num_blocks)

    def allocate_kv(self, num_blocks: int) -> None:
        self.kv_tensor, self.kv_cache = kv_cache_for(self.config, num_blocks, self.block_size, self.kernels.kv_dtype,
                                                     self.device)

    # ---- what the engine calls --------------------------------------------------------------

    @torch.inference_mode()
    def step(self, msg: StepMessage):
        """-> rank 0: (logits of `last_rows` [R, vocab] on the CPU or None, hidden rows of each `prompt_rows` run);
        the other ranks: None."""
        for slot, weights in msg.slot_changes:
            if weights is None:
                self.slots.clear(slot)
            else:
                self.slots.load(slot, shard_adapter(unpack_adapter(weights), self.plan))
        copy_blocks(self.kv_tensor, msg.block_copies)
        hidden = forward_batch(self.model, self.lora, self.kv_cache, msg, msg.block_tables.to(self.device),
                               self.block_size, msg.lora_slots, msg.mix_passes, self.device)
        rows = torch.tensor(msg.last_rows, dtype=torch.long, device="cpu").to(self.device)
        logits = self.logits(hidden[rows], msg.row_slots) if msg.last_rows else None
        if self.rank:
            return None
        return logits, [hidden[start:end].cpu() for start, end in msg.prompt_rows]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, slots: list[int] | None) -> torch.Tensor | None:
        """The whole logits of these rows (the head's all-gather), in the model's dtype; on the CPU at rank 0."""
        with self.lora.mapping(rows=slots):
            logits = self.model.logits(hidden.to(self.device))
        return logits.cpu() if self.rank == 0 else None

    def kv_blocks(self) -> int:
        """CUDA: how many KV blocks this rank's device holds after its shard and a profiling pass."""
        from loraplex.platform.engine.llm_engine import device_kv_blocks  # the engine's sizing, on this rank's device

        return device_kv_blocks(self.model, self.config, self.engine_config, self.max_model_len, self.device,
                                self.memory_start)


def pack_adapter(weights: LoRAWeights) -> bytes:
    """An adapter for the pipe. Its tensors are views into one buffer, and pickle would copy the whole buffer for
    each of them: torch.save writes each storage once."""
    buffer = io.BytesIO()
    torch.save(weights, buffer)
    return buffer.getvalue()


def unpack_adapter(data: bytes) -> LoRAWeights:
    return torch.load(io.BytesIO(data), weights_only=False)  # from the engine's own pipe, never a client's bytes


def shard_adapter(weights: LoRAWeights, plan: ShardPlan) -> LoRAWeights:
    """An adapter's projections as this rank's layers hold them: for a column-parallel projection (q/k/v,
    gate/up) the rank's output columns of B^T, A whole (the shrink reads the whole input); for a row-parallel one
    (o, down) the rank's input columns of A, B^T whole (each rank's expand of its partial shrink is a partial sum
    the layer's all-reduce adds up)."""
    columns = {"qkv_proj": qkv_rows(plan), "gate_up_proj": gate_up_rows(plan.intermediate, plan.intermediate_size)}
    rows = {"o_proj": o_cols(plan), "down_proj": span(*plan.intermediate)}
    projections = {}
    for (layer, fused), (a, b_t) in weights.projections.items():
        if fused in columns:
            b_t = b_t.index_select(1, columns[fused]).contiguous()
        else:
            a = a.index_select(1, rows[fused]).contiguous()
        projections[(layer, fused)] = (a, b_t)
    return dataclasses.replace(weights, projections=projections)


def worker_main(config: EngineConfig, rank: int, size: int, init_method: str, num_blocks: int | None,
                conn, threads: int, segment: str | None) -> None:
    """A worker process: join the group, build the shard, then answer the engine until it closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the engine stops the workers
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{rank} %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(threads)
    backend = "nccl" if config.torch_device.type == "cuda" else "gloo"
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # before the group: NCCL binds each rank to its current device
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)
        worker = Worker(config, rank, size, num_blocks, segment)
    except Exception as exc:  # the engine reports it and stops the others
        log.exception("tensor-parallel rank %d failed to start", rank)
        conn.send_bytes(pickle.dumps(("error", f"rank {rank}: {type(exc).__name__}: {exc}")))
        return
    conn.send_bytes(pickle.dumps(("ok", None)))
    serve(worker, conn, rank)
    dist.destroy_process_group()


def serve(worker: Worker, conn, rank: int) -> None:
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the engine closed the pipe or died: nothing more to do
            return
        try:
            reply = ("ok", getattr(worker, method)(*args))
        except Exception as exc:
            log.exception("tensor-parallel rank %d: %s failed", rank, method)
            reply = ("error", f"rank {rank}: {type(exc).__name__}: {exc}")
        conn.send_bytes(pickle.dumps(reply))


def uses_shared_memory(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the ranks all-reduce through shared memory: float32 on the CPU, with the C kernels built (decided once,
    by the engine, for every rank)."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_kernels.library() is not None
