"""CUDA graphs for decode batches: the model's forward pass for B one-token requests, captured
once per padded batch size (1, 2, 4, then every 8 up to max_num_seqs), with and without LoRA,
replayed with the step's inputs copied into persistent buffers. Prefill, jump-forward chunks
and batches above the largest size run eagerly.

A graph replays the kernels it recorded on the buffers it recorded, so everything the forward
pass reads lives in those buffers: token ids, positions, slot mapping and sequence lengths (rows
of one tensor, filled from one persistent pinned staging buffer in one copy), the int32 block
tables (max_model_len wide, copied from the step's rows: the engine's block table, or its copy sent to a worker),
and each token's adapter slot (tokens grouped by adapter slot on the device inside the graph, the null slot for
tokens without one: `LoRABatch.grouped`). Steps with adapter mixes of up to `mix_passes` adapters replay graphs
of their own, one grouped pass per adapter of a mix with each token's weight (a gather on the device), unused
passes on the null slot; larger mixes run eagerly.
Padding rows write no KV (slot -1) and attend to one cached position (their table rows hold
whatever valid block ids an earlier step left). The staging buffers are reused: the last copy out of
them is waited for before they are written again (`CopyFence`), since under --async-scheduling a step is
built before the previous one's tokens are read back; those tokens' ids are gathered into the input ids
on the device (`gather_pending`).
The capture itself is a parameter: `CudaCapture` on CUDA, `FakeCapture` on CPU, which replays by
running the function again and refuses host syncs while capturing, as a real capture does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from enum import StrEnum

import numpy as np
import torch

from loraplex.kernels.dispatch import to_device
from loraplex.kernels.paged_attention import PagedAttentionMetadata
from loraplex.kernels.lora_batch import LoRABatch
from loraplex.platform.device import CopyFence, NoHostSync

Capture = Callable[[Callable[[], None]], Callable[[], None]]  # forward -> replay
# the largest mix with graphs: every pass costs each projection its launches, used or not
MIX_GRAPH_PASSES = 2


def capture_sizes(max_num_seqs: int, largest: int = 512) -> list[int]:
    top = min(max_num_seqs, largest)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    return sizes if sizes[-1] == top else sizes + [top]


def padded_size(sizes: list[int], num_tokens: int) -> int | None:
    """The smallest captured size that holds `num_tokens`; None above the largest."""
    return next((s for s in sizes if s >= num_tokens), None)


class CudaCapture:
    """torch.cuda.graph, every size sharing one memory pool (captured largest first)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, forward: Callable[[], None]) -> Callable[[], None]:
        forward()  # warm-up outside the capture: Triton compiles, cuBLAS sets up its workspace
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            forward()
        return graph.replay


class FakeCapture:
    """CPU stand-in: capturing runs the forward once refusing host syncs; replaying runs it
    again as it is (reading only the persistent buffers, like a graph)."""

    def __init__(self) -> None:
        self.captured = 0
        self.replays = 0

    def __call__(self, forward: Callable[[], None]) -> Callable[[], None]:
        with NoHostSync():
            forward()
        self.captured += 1

        def replay() -> None:
            self.replays += 1
            forward()

        return replay


class GraphMode(StrEnum):
    """What a decode graph holds: the base model only, one adapter per token, or adapter mixes' weighted passes."""

    BASE = "base"
    LORA = "lora"
    MIX = "mix"


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, lora, kv_caches: list, sizes: list[int], max_blocks: int,
                 block_size: int, max_model_len: int, null_slot: int | None, capture: Capture,
                 mix_passes: int = 0) -> None:
        """`lora`: the step's adapter mapping the model's LoRA layers read (`adapters/lora_layers.LoRAContext`);
        `null_slot`: the adapter slot of tokens without one (None: no LoRA graphs); `mix_passes`: the
        largest adapter mix with graphs of its own (0: steps with mixes run eagerly)."""
        self.lora = lora
        device = model.embed_tokens.weight.device
        largest = sizes[-1]
        self.sizes, self.null_slot, self.block_size = sizes, null_slot, block_size
        self.device = device
        pin = device.type == "cuda"
        # token ids, positions, slot mapping, sequence lengths: one tensor, so one copy per step
        self.inputs = torch.tensor(PADDING, dtype=torch.long, device="cpu").repeat(1, largest).to(device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = self.inputs
        self._staging = torch.zeros(self.inputs.shape, dtype=torch.long, device="cpu", pin_memory=pin)
        self._lora_staging = torch.zeros(largest, dtype=torch.int32, device="cpu", pin_memory=pin)
        self.block_tables = torch.zeros(largest, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.long, device=device)
        self.lora_slots = torch.full((largest,), null_slot if null_slot is not None else -1, dtype=torch.int32,
                                     device=device)
        self.hidden = torch.zeros(largest, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype,
                                  device=device)
        self.mix_passes = mix_passes if null_slot is not None else 0
        self.pass_slots = torch.full((self.mix_passes, largest), -1 if null_slot is None else null_slot,
                                     dtype=torch.int32, device=device)
        self.pass_weights = torch.zeros(self.mix_passes, largest, dtype=torch.float32, device=device)
        self._pass_staging = torch.zeros(2, self.mix_passes, largest, dtype=torch.float32, device="cpu",
                                         pin_memory=pin)
        self._fence = CopyFence(device)  # the last step's copies out of the staging buffers
        self.num_replays: Counter[tuple[int, GraphMode]] = Counter()
        self._graphs: dict[tuple[int, GraphMode], Callable[[], None]] = {}
        modes = tuple(GraphMode) if self.mix_passes else \
            (GraphMode.BASE, GraphMode.LORA) if null_slot is not None else (GraphMode.BASE,)
        for size in reversed(sizes):  # largest first: smaller graphs reuse its memory
            for mode in modes:
                self._graphs[size, mode] = capture(self._forward(model, kv_caches, size, mode, max_model_len))

    def _forward(self, model, kv_caches, size: int, mode: GraphMode, max_model_len: int) -> Callable[[], None]:
        meta = PagedAttentionMetadata(self.slot_mapping[:size], self.block_tables[:size], self.seq_lens[:size],
                                      self.query_start_loc[:size + 1], max_query_len=1, max_seq_len=max_model_len,
                                      block_size=self.block_size)

        def forward() -> None:
            meta._reference = meta._cpu_parts = None  # derived views are recomputed, as a graph would
            # tokens grouped by slot inside the graph (a sort on the device each replay): one read of an
            # adapter's A and B per segment, not per token
            lora = self._mix_batch(size) if mode == GraphMode.MIX else \
                LoRABatch.grouped(self.lora_slots[:size], self.null_slot) if mode == GraphMode.LORA else None
            with self.lora.mapping(batch=lora):
                self.hidden[:size] = model(self.input_ids[:size], self.positions[:size], kv_caches, meta)

        return forward

    def _mix_batch(self, size: int) -> LoRABatch:
        """One grouped pass per adapter of the mixes, each token's weight gathered into the pass's order."""
        batches = []
        for k in range(self.mix_passes):
            batch = LoRABatch.grouped(self.pass_slots[k, :size], self.null_slot)
            batch.order_weights = self.pass_weights[k, :size].index_select(0, batch.token_order)
            batches.append(batch)
        batches[0].passes = tuple(batches[1:])
        return batches[0]

    def fits(self, num_tokens: int, with_lora: bool, mix_passes: int = 0) -> bool:
        """Whether a decode step of `num_tokens` (using adapters or not, with mixes of `mix_passes` adapters
        at most) has a graph."""
        if num_tokens > self.sizes[-1] or mix_passes > self.mix_passes:
            return False
        return not with_lora or self.null_slot is not None

    def run(self, step) -> torch.Tensor:
        """The hidden states [n, hidden] of a decode step (a `model_runner.ModelInput`: a token per request) of
        n <= the largest size."""
        n = len(step.token_ids)
        size = padded_size(self.sizes, n)
        with_lora = step.lora_slots is not None
        self._fence.wait()
        staged = self._staging.numpy()  # written in place: no host tensor per input and step
        staged[:, :n] = (step.token_ids, step.positions, step.slots, step.seq_lens)
        staged[:, n:size] = PADDING
        self.inputs.copy_(self._staging, non_blocking=True)
        gather_pending(self.input_ids, step)
        step.table.commit(self.block_tables)
        mode = GraphMode.MIX if step.mix_passes is not None else GraphMode.LORA if with_lora else GraphMode.BASE
        if mode == GraphMode.MIX:
            self._stage_passes(step.mix_passes, n)
        elif with_lora:
            slots = self._lora_staging.numpy()
            slots[:n] = [self.null_slot if s < 0 else s for s in step.lora_slots]
            slots[n:size] = self.null_slot
            self.lora_slots.copy_(self._lora_staging, non_blocking=True)
        self._fence.record()
        self._graphs[size, mode]()
        self.num_replays[size, mode] += 1
        return self.hidden[:n]

    def _stage_passes(self, passes: list[tuple[list[int], list[float]]], n: int) -> None:
        """Each pass's slots and weights into the mix graphs' buffers (passes beyond the step's: null slot,
        weight 0), in one copy each."""
        staged = self._pass_staging.numpy()
        staged[0], staged[1] = self.null_slot, 0.0
        for k, (slots, weights) in enumerate(passes):
            staged[0, k, :n] = [self.null_slot if s < 0 else s for s in slots]
            staged[1, k, :n] = weights
        self.pass_slots.copy_(self._pass_staging[0], non_blocking=True)  # float32 holds slot ids exactly
        self.pass_weights.copy_(self._pass_staging[1], non_blocking=True)


def gather_pending(input_ids: torch.Tensor, step) -> None:
    """--async-scheduling: the input ids of `step.pending`'s tokens from the previous step's sampled ids, still
    on the device (`step.previous_tokens`): one gather, no host read."""
    if not step.pending:
        return
    pairs = torch.tensor(list(zip(*step.pending)), dtype=torch.long, device="cpu")  # [2, n]: one copy
    index, rows = to_device(pairs, input_ids.device)
    input_ids.index_copy_(0, index, step.previous_tokens.index_select(0, rows).to(input_ids.dtype))


# A padding row of (token id, position, KV slot, sequence length): no KV written, one cached position read
PADDING = np.array([[0], [0], [-1], [1]])
