"""A step's tokens grouped by adapter slot (`LoRABatch`): built once per step on the host and shared by every
LoRA layer and by each implementation of the delta (`sgmv.py`'s PyTorch path and C-kernel dispatch,
`sgmv_triton.py`'s kernels), which is why it sits below them all."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels.dispatch import to_device


@dataclass
class LoRABatch:
    """Per-step grouping of tokens by adapter slot, shared by every LoRA layer."""

    token_order: torch.Tensor  # [N] indices of tokens with a slot, sorted by slot (stable)
    order_slots: torch.Tensor  # [N] the slot of each token in token_order
    seg_starts: torch.Tensor  # [G + 1] int32 offsets into token_order
    seg_slots: torch.Tensor  # [G] int32 slot of each segment
    max_seg_len: int
    host_starts: list[int]  # the same offsets and slots on the host, for the PyTorch path
    host_slots: list[int]
    host_ranges: list[tuple[int, int] | None]  # per segment: its rows [lo, hi) when contiguous (prefill)
    num_segments: int
    num_tokens: int  # len(token_order), kept as an int: every LoRA layer of the step asks
    # float32 [N]: each token_order entry's weight on its delta (an adapter mix); None: 1 (no multiply)
    order_weights: torch.Tensor | None = None
    # a step with adapter mixes: pass k maps each token to its k-th (slot, weight); this batch is pass 0,
    # `passes` the others, each added by every LoRA layer after this one's delta
    passes: tuple["LoRABatch", ...] = ()

    @staticmethod
    def build(token_slots: list[int] | torch.Tensor, device: torch.device | str = "cpu",
              token_weights: list[float] | None = None) -> "LoRABatch":
        """Grouped on the host in plain Python (a step's few thousand tokens at most), so that
        building it reads nothing back from any device. `token_weights`: each token's weight on its
        delta (None: all 1, no weights kept)."""
        slots = token_slots.tolist() if isinstance(token_slots, torch.Tensor) else list(token_slots)
        rows = sorted((t for t, slot in enumerate(slots) if slot >= 0), key=slots.__getitem__)  # stable
        sorted_slots = [slots[t] for t in rows]
        starts = [0] + [j for j in range(1, len(rows)) if sorted_slots[j] != sorted_slots[j - 1]]
        uniq = [sorted_slots[j] for j in starts] if rows else []
        starts = starts + [len(rows)] if rows else [0]
        ranges = [(rows[lo], rows[hi - 1] + 1) if rows[hi - 1] - rows[lo] == hi - 1 - lo else None
                  for lo, hi in zip(starts[:-1], starts[1:])]
        device = torch.device(device)

        def put(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=dtype, device="cpu"), device)

        return LoRABatch(
            token_order=put(rows, torch.int64),
            order_slots=put(sorted_slots, torch.int64),
            seg_starts=put(starts, torch.int32),
            seg_slots=put(uniq, torch.int32),
            max_seg_len=max((hi - lo for lo, hi in zip(starts[:-1], starts[1:])), default=0),
            host_starts=starts,
            host_slots=uniq,
            host_ranges=ranges,
            num_segments=len(uniq),
            num_tokens=len(rows),
            order_weights=None if token_weights is None else
            to_device(torch.tensor([token_weights[t] for t in rows], dtype=torch.float32), device),
        )

    @staticmethod
    def build_passes(passes: list[tuple[list[int], list[float]]], device: torch.device | str = "cpu"
                     ) -> "LoRABatch":
        """A step with adapter mixes: one weighted batch per (token slots, token weights) pass; the first
        carries the others."""
        first, *rest = [LoRABatch.build(slots, device, weights) for slots, weights in passes]
        first.passes = tuple(rest)
        return first

    @staticmethod
    def grouped(token_slots: torch.Tensor, num_slots: int) -> "LoRABatch":
        """Tokens grouped by slot on the device with capture-safe ops (a stable sort, a scan and a search, no
        host read), for the decode graphs: called inside the captured forward, it regroups each replay's slots,
        so a segment's A and B are read once per adapter rather than once per token (vLLM's punica wrapper
        sorts its token-to-LoRA mapping the same way). The segments are the slots present, in slot order (the
        null slot `num_slots`, rank 0, among them), then empty ones up to min(N, slots + 1): the launch's shape
        depends only on the batch size and never holds more segments than tokens.
        `token_slots` [N] int32 in [0, num_slots]. Triton kernels only (no host copy)."""
        n = len(token_slots)
        order_slots, token_order = torch.sort(token_slots, stable=True)
        first = torch.ones(n, dtype=torch.int32, device=token_slots.device)
        first[1:] = order_slots[1:] != order_slots[:-1]
        segment_of = torch.cumsum(first, 0)  # [N]: 1 + the segment of each token in the order
        num_segments = min(n, num_slots + 1)
        bounds = torch.arange(1, num_segments + 2, dtype=segment_of.dtype, device=token_slots.device)
        seg_starts = torch.searchsorted(segment_of, bounds, out_int32=True)  # segment g's first token; N past the last
        seg_slots = order_slots.gather(0, seg_starts[:-1].clamp(max=n - 1).long()).to(torch.int32)
        return LoRABatch(token_order, order_slots, seg_starts, seg_slots, n, [], [], [], num_segments, n)

    def segments(self):
        """(slot, token indices) per segment, for the PyTorch path."""
        for g, slot in enumerate(self.host_slots):
            yield slot, self.token_order[self.host_starts[g]:self.host_starts[g + 1]]

    def segment_weights(self):
        """Per segment its tokens' weights as a column [n, 1] (None: unweighted), beside `segments`."""
        if self.order_weights is None:
            return [None] * self.num_segments
        return [self.order_weights[lo:hi, None] for lo, hi in zip(self.host_starts[:-1], self.host_starts[1:])]
