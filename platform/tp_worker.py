"""A tensor-parallel worker process: one rank's shard of the model, its KV heads' cache and its shards of the
adapters in the engine's slots. It runs what the engine sends (`tp_executor.py`), one message at a time: a step
(`StepMessage`), the logits of given hidden rows, an adapter to read ahead of a load. Every rank runs every
step; rank 0's answer is the step's (the hidden states and logits are the same on every rank after the
collectives), the others answer that they are done.

Nothing here schedules, samples or reads a grammar: those stay in the engine's process (vLLM's worker split).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from loraplex.adapters.lora_layers import attach_lora
from loraplex.adapters.peft_format import LoRAWeights, read_peft_adapter
from loraplex.adapters.slots import LoRASlots
from loraplex.kernels import cpu_kernels
from loraplex.kernels.paged_attention import PagedAttentionMetadata
from loraplex.kernels.sgmv import LoRABatch
from loraplex.platform.config import EngineConfig
from loraplex.platform.device import MemorySnapshot, select_device
from loraplex.platform.distributed import use_shared_memory
from loraplex.platform.models.llama import load_model
from loraplex.platform.models.sharding import ShardPlan, gate_up_rows, local_config, o_cols, plan_for, qkv_rows, span
from loraplex.platform.resolve import resolve

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a rank stuck past this in a collective fails instead of hanging


@dataclass(frozen=True)
class AdapterRef:
    """An adapter as the engine's registry holds it: workers read it from the same folder and check its hash."""

    name: str
    path: str
    content_hash: str
    confined: bool = False


@dataclass
class StepMessage:
    """One step's flat batch, as the engine's runner built it (`model_runner.StepInputs`), for every rank."""

    slot_changes: list[tuple[int, AdapterRef | None]]  # since the last step, in order
    forgotten: list[str]  # content hashes of adapters unloaded since: their shards dropped
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
    def __init__(self, config: EngineConfig, rank: int, size: int, num_blocks: int | None, segment: str) -> None:
        resolved = resolve(config)
        self.device = torch.device("cuda", rank) if resolved.device.type == "cuda" else torch.device("cpu")
        select_device(self.device)
        if self.device.type == "cpu" and resolved.kernels.dtype == torch.float32 and cpu_kernels.library():
            use_shared_memory(segment, rank, size)  # before the model: its layers take the all-reduce once
        self.memory_start = MemorySnapshot.measure(self.device) if self.device.type == "cuda" else None
        self.plan = plan_for(resolved.model, size, rank)
        self.full_config, self.config = resolved.model, local_config(resolved.model, self.plan)
        self.kernels, self.block_size = resolved.kernels, config.block_size
        self.max_lora_rank, self.engine_config, self.max_model_len = config.max_lora_rank, config, \
            resolved.max_model_len
        self.model = load_model(config.model, self.config, resolved.kernels, resolved.max_model_len, None,
                                self.device)
        stacked = resolved.kernels.stacked_lora
        self.slots = LoRASlots(self.config, resolved.max_loras, resolved.kernels.lora_dtype, self.device,
                               config.max_lora_rank if stacked else None)
        self.lora = attach_lora(self.model, self.slots, resolved.kernels)
        self.adapters: OrderedDict[str, LoRAWeights] = OrderedDict()  # content hash -> this rank's shards
        self.max_adapters = 2 * resolved.max_loras + 4
        self.kv_cache = self._kv_cache(num_blocks) if num_blocks is not None else None
        if self.device.type == "cpu":
            cpu_kernels.library()
        self.hidden: torch.Tensor | None = None

    def allocate_kv(self, num_blocks: int) -> None:
        self.kv_cache = self._kv_cache(num_blocks)

    def _kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        cache = torch.zeros(c.num_layers, 2, num_blocks, self.block_size, c.num_kv_heads, c.head_dim,
                            dtype=self.kernels.kv_dtype, device=self.device)
        self.kv_tensor = cache
        return [(cache[i, 0], cache[i, 1]) for i in range(c.num_layers)]

    # ---- what the engine calls --------------------------------------------------------------

    @torch.inference_mode()
    def step(self, msg: StepMessage):
        """-> (logits of `last_rows` [R, vocab] on the CPU, hidden rows of each `prompt_rows` run)."""
        for slot, ref in msg.slot_changes:
            self.slots.clear(slot) if ref is None else self.slots.load(slot, self.read_adapter(ref))
        for content_hash in msg.forgotten:
            self.forget_adapter(content_hash)
        for src, dst in msg.block_copies:
            self.kv_tensor[:, :, dst].copy_(self.kv_tensor[:, :, src])

        def put(values: list, dtype=torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device="cpu").to(self.device)

        meta = PagedAttentionMetadata.build(
            slot_mapping=put(msg.slots), block_tables=msg.block_tables.to(self.device), seq_lens=put(msg.seq_lens),
            query_start_loc=put(msg.starts), block_size=self.block_size, max_query_len=msg.max_query_len,
            max_seq_len=max(msg.seq_lens))
        if msg.mix_passes is not None:
            batch = LoRABatch.build_passes(msg.mix_passes, self.device)
        else:
            batch = LoRABatch.build(msg.lora_slots, self.device) if msg.lora_slots is not None else None
        with self.lora.mapping(batch=batch):
            hidden = self.model(put(msg.token_ids), put(msg.positions), self.kv_cache, meta)
        prompt = [hidden[start:end].cpu() for start, end in msg.prompt_rows]
        if not msg.last_rows:
            return None, prompt
        return self.logits(hidden[put(msg.last_rows)], msg.row_slots), prompt

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, slots: list[int] | None) -> torch.Tensor:
        """The whole logits of these rows (the head's all-gather), in the model's dtype, on the CPU."""
        with self.lora.mapping(rows=slots):
            return self.model.logits(hidden.to(self.device)).cpu()

    def read_adapter(self, ref: AdapterRef) -> LoRAWeights:
        """This rank's shards of an adapter, read once per content (the engine checked it first)."""
        held = self.adapters.get(ref.content_hash)
        if held is None:
            full = read_peft_adapter(ref.name, ref.path, self.full_config, self.max_lora_rank,
                                     self.kernels.lora_dtype, ref.confined)
            if full.content_hash != ref.content_hash:
                raise ValueError(f"adapter {ref.name!r} changed on disk since the engine read it ({ref.path})")
            held = shard_adapter(full, self.plan)
            self.adapters[ref.content_hash] = held
            while len(self.adapters) > self.max_adapters:
                self.adapters.popitem(last=False)
        self.adapters.move_to_end(ref.content_hash)
        return held

    def check_adapter(self, ref: AdapterRef) -> None:
        """An adapter being loaded: read and sharded now (a load fails on every rank if one cannot)."""
        self.read_adapter(ref)

    def forget_adapter(self, content_hash: str) -> None:
        self.adapters.pop(content_hash, None)

    def kv_blocks(self) -> int:
        """CUDA: how many KV blocks this rank's device holds after its shard and a profiling pass."""
        from loraplex.platform.engine import device_kv_blocks  # the engine's sizing, on this rank's device

        return device_kv_blocks(self.model, self.config, self.engine_config, self.max_model_len, self.device,
                                self.memory_start)


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
                conn, threads: int, segment: str) -> None:
    """A worker process: join the group, build the shard, then answer the engine until it closes the pipe."""
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
            result = getattr(worker, method)(*args)
            reply = ("ok", result if rank == 0 or method != "step" else None)  # a step's answer is rank 0's
        except Exception as exc:
            log.exception("tensor-parallel rank %d: %s failed", rank, method)
            reply = ("error", f"rank {rank}: {type(exc).__name__}: {exc}")
        conn.send_bytes(pickle.dumps(reply))
