"""SGMV shrink / expand for multi-LoRA batches (Punica / S-LoRA style).

For each token t with adapter slot s = slots[t] (-1: no adapter):
    shrink:  h[t, i*R:(i*R + rank[s])] = x[t] @ A[s, i*R:(i*R + rank[s])].T     (fp32)
    expand:  y[t, off[i]:off[i+1]]    += scale[s] * h[t, i*R:(i*R + rank[s])] @ B[s, off[i]:off[i+1], :rank[s]].T
where i runs over the slices of a fused projection (q/k/v, gate/up) and R is the max rank.

That stacked layout is what the Triton kernels read (CUDA). On the CPU, adapters are not copied
into stacked slots: a `LoRATable` points at each adapter's own compact weights, which the C kernel
(`cpu_kernels.py`, decode-shaped batches, float32 or bfloat16) or per-segment GEMMs read in place.
Tokens are grouped into segments of one slot through a sorted index list (`LoRABatch`, `lora_batch.py`),
so the batch itself is never reordered; each Triton program works on its segments' tokens, and a rank block
beyond a slot's own rank is skipped, so mixed ranks cost what their ranks cost.
Layouts: A [S, n_slices * R, in], B [S, sum(out_i), R], ranks [S] int32, scales [S] float.
A request that mixes adapters (`platform/adapter_mix.py`) gives its tokens a weight per pass: the batch's
`order_weights` multiply each token's delta (every path: C kernel, GEMMs, Triton, reference), and a step
runs one weighted pass per adapter of its largest mix (`LoRABatch.passes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraplex.kernels import cpu_kernels
from loraplex.kernels.dispatch import Backend, KernelConfig
from loraplex.kernels.lora_batch import LoRABatch
from loraplex.kernels.lora_tiles import LoRATiles, tune_for


# ---- PyTorch path (reference, and the CPU implementation) -------------------------------------

def sgmv_shrink_reference(x: torch.Tensor, lora_a: torch.Tensor, ranks: list[int] | torch.Tensor,
                          batch: LoRABatch, out: torch.Tensor, num_slices: int = 1) -> torch.Tensor:
    max_rank = lora_a.shape[1] // num_slices
    ranks = _host_list(ranks)
    out_slices = out.view(out.shape[0], num_slices, max_rank)
    for slot, idx in batch.segments():
        r = ranks[slot]
        if r == 0:
            continue
        a = lora_a[slot].view(num_slices, max_rank, -1)[:, :r].reshape(num_slices * r, -1)
        h = _f32(x.index_select(0, idx)) @ _f32(a).T
        out_slices[idx, :, :r] = h.view(-1, num_slices, r).to(out.dtype)
    return out


def sgmv_expand_reference(h: torch.Tensor, lora_b: torch.Tensor, ranks: list[int] | torch.Tensor,
                          scales: list[float] | torch.Tensor, batch: LoRABatch, y: torch.Tensor,
                          slice_offsets: list[int]) -> torch.Tensor:
    max_rank = lora_b.shape[2]
    ranks, scales = _host_list(ranks), _host_list(scales)
    for (slot, idx), weights in zip(batch.segments(), batch.segment_weights()):
        r = ranks[slot]
        if r == 0:
            continue
        h_seg = h.index_select(0, idx)
        delta = torch.empty(len(idx), y.shape[1], dtype=torch.float32, device=y.device)
        for i, (lo, hi) in enumerate(zip(slice_offsets[:-1], slice_offsets[1:])):
            torch.matmul(_f32(h_seg[:, i * max_rank:i * max_rank + r]), _f32(lora_b[slot, lo:hi, :r]).T,
                         out=delta[:, lo:hi])
        if weights is not None:
            delta *= weights
        # one read-modify-write of the segment's rows, in fp32, as the kernel does
        y.index_copy_(0, idx, (_f32(y.index_select(0, idx)) + scales[slot] * delta).to(y.dtype))
    return y


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _host_list(values) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


# ---- CPU path: adapters read where they lie ------------------------------------------------------

@dataclass
class LoRATable:
    """One fused projection's adapters on the CPU. Slot s points at its adapter's own weights,
    A [num_slices * r_s, in] and B transposed, Bt [r_s, out_total] (the expand then adds r
    contiguous rows), in each adapter's own rank: no stacked copy
    padded to a max rank (on CPU the "device" memory is the RAM the adapter already lies in).
    Setting a slot stores references, so the weights live as long as the slot points at them."""

    offsets: list[int]  # output offset of each slice, plus the total
    dtype: torch.dtype  # of every slot's weights
    a: list[torch.Tensor | None]
    b: list[torch.Tensor | None]
    ranks: list[int]  # 0: the slot does not touch this projection
    scales: list[float]
    # the same as arrays the C kernel reads; numpy, since setting a slot writes 4 x 4 x layers
    # scalars, and a torch scalar write costs far more than a numpy one
    a_ptrs: np.ndarray  # int64 [S] addresses
    b_ptrs: np.ndarray
    ranks_arr: np.ndarray  # int64 [S]
    scales_arr: np.ndarray  # float32 [S]
    offsets_arr: np.ndarray  # int64 [num_slices + 1]
    max_rank: int = 0  # the largest rank any slot was set to: the C kernel's scratch bound

    def __post_init__(self) -> None:
        # the arrays' addresses, read once: the kernel is called ~120 times a step
        self.c_arrays = tuple(arr.ctypes.data for arr in (self.a_ptrs, self.b_ptrs, self.ranks_arr,
                                                           self.scales_arr, self.offsets_arr))

    @staticmethod
    def empty(num_slots: int, offsets: list[int], dtype: torch.dtype = torch.float32) -> "LoRATable":
        return LoRATable(list(offsets), dtype, [None] * num_slots, [None] * num_slots, [0] * num_slots,
                         [0.0] * num_slots, np.zeros(num_slots, np.int64), np.zeros(num_slots, np.int64),
                         np.zeros(num_slots, np.int64), np.zeros(num_slots, np.float32),
                         np.array(offsets, dtype=np.int64))

    @staticmethod
    def from_stacked(lora_a: torch.Tensor, lora_b: torch.Tensor, ranks: list[int], scales: list[float],
                     offsets: list[int]) -> "LoRATable":
        """The same adapters as the stacked layout above, each cut to its own rank (rank 0: empty)."""
        num_slices, max_rank = len(offsets) - 1, lora_b.shape[2]
        table = LoRATable.empty(lora_a.shape[0], offsets, lora_a.dtype)
        for slot, r in enumerate(ranks):
            if r:
                a = lora_a[slot].view(num_slices, max_rank, -1)[:, :r].reshape(num_slices * r, -1).contiguous()
                table.set(slot, a, lora_b[slot, :, :r].T.contiguous(), scales[slot])
        return table

    @property
    def num_slices(self) -> int:
        return len(self.offsets) - 1

    def set(self, slot: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """`b` is B transposed: [rank, out_total]."""
        rank = b.shape[0]
        if not (a.is_contiguous() and b.is_contiguous()) or a.dtype != self.dtype or b.dtype != self.dtype:
            raise ValueError(f"LoRA table weights must be contiguous {self.dtype}, got {a.dtype} / {b.dtype}")
        if a.shape[0] != self.num_slices * rank or b.shape[1] != self.offsets[-1]:
            raise ValueError(f"LoRA table slot {slot}: A{tuple(a.shape)} B{tuple(b.shape)} do not fit "
                             f"{self.num_slices} slices of rank {rank} and {self.offsets[-1]} outputs")
        self.a[slot], self.b[slot], self.ranks[slot], self.scales[slot] = a, b, rank, scale
        self.a_ptrs[slot], self.b_ptrs[slot] = a.data_ptr(), b.data_ptr()
        self.ranks_arr[slot], self.scales_arr[slot] = rank, scale
        self.max_rank = max(self.max_rank, rank)

    def clear(self, slot: int) -> None:
        self.a[slot] = self.b[slot] = None
        self.ranks[slot], self.scales[slot] = 0, 0.0
        self.a_ptrs[slot] = self.b_ptrs[slot] = self.ranks_arr[slot] = 0
        self.scales_arr[slot] = 0.0


def lora_kernel(config: KernelConfig):
    """The multi-LoRA delta `(x, slots, batch, y) -> y` a model (or a test) runs, chosen once: the Triton SGMV
    kernels on stacked slots (CUDA, or forced), their reference on stacked slots elsewhere; on CPU tables, the C
    kernel while a batch's segments are short (`TuneTable.lora_kernel_mean_segment_*`) and per-segment GEMMs
    else."""
    if config.stacked_lora:
        if config.backend != Backend.TRITON:
            return sgmv_lora_stacked_reference
        return sgmv_lora_stacked_triton  # split-K by the input width only: batch-invariant, --deterministic too
    c_pair = config.dtype in cpu_kernels.SGMV_DTYPES and (config.dtype, config.lora_dtype) in cpu_kernels.SGMV_KINDS
    if config.backend != Backend.CPU or not c_pair:
        return sgmv_lora_table_torch
    tune = config.tune
    limit = tune.lora_kernel_mean_segment_bf16 if config.lora_dtype == torch.bfloat16 else \
        tune.lora_kernel_mean_segment_f32
    if config.deterministic:  # each token's delta summed alone, whatever its segment's length: always the C kernel
        limit = float("inf")

    def c_or_gemms(x, table, batch, y):
        if batch.num_tokens < limit * batch.num_segments:  # decode-shaped: each token's A and B read in place
            return cpu_kernels.sgmv_lora_table_c(x.contiguous(), table, batch.token_order, batch.order_slots, y,
                                                 batch.order_weights)
        return sgmv_lora_table_torch(x, table, batch, y)

    return c_or_gemms


def sgmv_lora_table_torch(x: torch.Tensor, table: LoRATable, batch: LoRABatch, y: torch.Tensor) -> torch.Tensor:
    """The PyTorch path: shrink and expand fused per segment (one GEMM pair per adapter), in the
    model's dtype (16-bit adapters on a float32 model widened per segment); a segment of
    contiguous rows (a prefill chunk) adds into y in place, others gather their rows and
    `index_add_` once."""
    offsets = table.offsets
    for (slot, idx), rows, weights in zip(batch.segments(), batch.host_ranges, batch.segment_weights()):
        r = table.ranks[slot]
        if r == 0:
            continue
        if rows is not None:  # one request's chunk: its rows in place, no gather or scatter
            lo, hi = rows
            h = _weighted(x[lo:hi] @ table.a[slot].to(x.dtype).T, weights)
            b = table.b[slot].to(x.dtype)
            for i, (o_lo, o_hi) in enumerate(zip(offsets[:-1], offsets[1:])):
                y[lo:hi, o_lo:o_hi].addmm_(h[:, i * r:(i + 1) * r], b[:, o_lo:o_hi], alpha=table.scales[slot])
            continue
        h = _weighted(x.index_select(0, idx) @ table.a[slot].to(x.dtype).T, weights)
        b = table.b[slot].to(x.dtype)
        delta = torch.empty(len(idx), y.shape[1], dtype=y.dtype, device=y.device)
        for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            torch.matmul(h[:, i * r:(i + 1) * r], b[:, lo:hi], out=delta[:, lo:hi])
        y.index_add_(0, idx, delta, alpha=table.scales[slot])
    return y


def _weighted(h: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The shrink's rows times their tokens' weights (the delta is linear in them)."""
    return h if weights is None else h * weights.to(h.dtype)


# ---- stacked layout on the device: what the Triton kernels read ----------------------------------

@dataclass
class StackedLoRA:
    """One fused projection's slots as persistent device tensors: A [S, n_slices * R, in],
    B [S, out_total, R], ranks [S + 1] int32 and scales [S + 1] float32 (entry S is the null slot,
    rank 0, for tokens without an adapter), slice offsets [n_slices + 1] int32. Loading a slot
    copies the adapter in, padded to R; nothing is created per step, so CUDA graphs stay valid.
    `tiles`: the Triton launches' shape, decided here once from the shapes and the card."""

    offsets: list[int]
    a: torch.Tensor
    b: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    offsets_t: torch.Tensor
    host_ranks: list[int]  # the same ranks and scales on the host, for the reference path
    host_scales: list[float]
    tiles: LoRATiles

    @staticmethod
    def empty(num_slots: int, offsets: list[int], in_features: int, max_rank: int, dtype: torch.dtype,
              device: torch.device) -> "StackedLoRA":
        n = len(offsets) - 1
        device = torch.device(device)
        tune = tune_for(torch.cuda.get_device_name(device) if device.type == "cuda" else "")
        return StackedLoRA(
            list(offsets), torch.zeros(num_slots, n * max_rank, in_features, dtype=dtype, device=device),
            torch.zeros(num_slots, offsets[-1], max_rank, dtype=dtype, device=device),
            torch.zeros(num_slots + 1, dtype=torch.int32, device=device),
            torch.zeros(num_slots + 1, dtype=torch.float32, device=device),
            torch.tensor(offsets, dtype=torch.int32, device=device), [0] * (num_slots + 1), [0.0] * (num_slots + 1),
            LoRATiles.plan(in_features, list(offsets), max_rank, tune))

    @property
    def num_slices(self) -> int:
        return len(self.offsets) - 1

    @property
    def max_rank(self) -> int:
        return self.b.shape[2]

    def set(self, slot: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """`a` [n_slices * r, in] and `b` = B transposed [r, out_total], as `LoRATable.set` takes them."""
        rank = b.shape[0]
        if rank > self.max_rank or a.shape != (self.num_slices * rank, self.a.shape[2]) or b.shape[1] != self.offsets[-1]:
            raise ValueError(f"LoRA slot {slot}: A{tuple(a.shape)} B{tuple(b.shape)} do not fit {self.num_slices} "
                             f"slices of rank <= {self.max_rank}, {self.a.shape[2]} inputs, {self.offsets[-1]} outputs")
        self.clear(slot)
        self.a[slot].view(self.num_slices, self.max_rank, -1)[:, :rank].copy_(a.view(self.num_slices, rank, -1))
        self.b[slot, :, :rank].copy_(b.T)
        self.ranks[slot], self.scales[slot] = rank, scale
        self.host_ranks[slot], self.host_scales[slot] = rank, scale

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot], self.scales[slot] = 0, 0.0
        self.host_ranks[slot], self.host_scales[slot] = 0, 0.0


def sgmv_lora_stacked_triton(x: torch.Tensor, table: StackedLoRA, batch: LoRABatch, y: torch.Tensor) -> torch.Tensor:
    """Shrink into fp32 planes (one per K share), expand into y: two launches for every slice of the projection.
    Both read only what the shrink wrote (the columns below each token's rank, the rows of tokens with an
    adapter): no memset."""
    from loraplex.kernels.sgmv_triton import sgmv_expand_triton, sgmv_shrink_triton

    tiles = table.tiles
    h = torch.empty(tiles.split_k, x.shape[0], table.a.shape[1], dtype=torch.float32, device=x.device)
    sgmv_shrink_triton(x, table.a, table.ranks, batch, h, tiles)
    return sgmv_expand_triton(h, table.b, table.ranks, table.scales, batch, y, table.offsets_t, tiles)


def sgmv_lora_stacked_reference(x: torch.Tensor, table: StackedLoRA, batch: LoRABatch, y: torch.Tensor
                                ) -> torch.Tensor:
    h = torch.empty(x.shape[0], table.a.shape[1], dtype=torch.float32, device=x.device)
    sgmv_shrink_reference(x, table.a, table.host_ranks, batch, h, table.num_slices)
    return sgmv_expand_reference(h, table.b, table.host_ranks, table.host_scales, batch, y, table.offsets)


# ---- entry points on raw stacked weights (tests, benchmarks): Triton where the config says, else the reference ----

def sgmv_shrink(config: KernelConfig, x, lora_a, ranks, batch: LoRABatch, out, num_slices: int = 1):
    """`out` [T, num_slices x R]: the whole K in one share."""
    if config.backend == Backend.TRITON:
        from loraplex.kernels.sgmv_triton import sgmv_shrink_triton

        max_rank = lora_a.shape[1] // num_slices
        tiles = LoRATiles.plan(x.shape[1], list(range(num_slices + 1)), max_rank, split=False)
        return sgmv_shrink_triton(x, lora_a, _as_tensor(ranks, torch.int32, x.device), batch, out, tiles)
    return sgmv_shrink_reference(x, lora_a, ranks, batch, out, num_slices)


def sgmv_expand(config: KernelConfig, h, lora_b, ranks, scales, batch: LoRABatch, y, slice_offsets: list[int]):
    if config.backend == Backend.TRITON:
        from loraplex.kernels.sgmv_triton import sgmv_expand_triton

        tiles = LoRATiles.plan(1, slice_offsets, lora_b.shape[2], split=False)
        return sgmv_expand_triton(h, lora_b, _as_tensor(ranks, torch.int32, y.device),
                                  _as_tensor(scales, torch.float32, y.device), batch, y,
                                  _as_tensor(slice_offsets, torch.int32, y.device), tiles)
    return sgmv_expand_reference(h, lora_b, ranks, scales, batch, y, slice_offsets)


def _as_tensor(values, dtype, device) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=dtype)
    return torch.tensor(values, dtype=dtype, device=device)
