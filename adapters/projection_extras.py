"""Per slot, what one projection's adapter adds beyond its LoRA delta (`variants.py` reads them): B's bias,
added to each of the slot's tokens, and DoRA's factor, which rescales each of the slot's tokens' outputs
(less the base layer's own bias, as peft's DoRA leaves that bias alone).

Both are stacked per slot, [S + 1, out] in the model's dtype on the model's device, made when the first slot needs
one (zero biases and unit factors elsewhere, which change nothing: x + 0 and x * 1 are exact), so a step applies
them to all of its tokens with a few whole-batch ops whatever the number of adapters. Only where the base layer
has a bias do the factors go to their own tokens alone: (y - b) * 1 + b is not always y.
Applied after every pass of the LoRA kernels; a step holding such a slot runs eagerly (a decode graph's batch
is captured without them), like one with an embedding adapter.
"""

from __future__ import annotations

import torch

from loraplex.adapters.saved_projections import Replacement, apply_replacement
from loraplex.kernels.lora_batch import LoRABatch


class ProjectionExtras:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.bias: torch.Tensor | None = None  # [S + 1, out], the part's scale folded in
        self.factor: torch.Tensor | None = None  # [S + 1, out]
        self.factor_slots: torch.Tensor | None = None  # [S + 1] bool, where a slot has a factor (on the device)
        self.replace: dict[int, Replacement] = {}  # slot -> rows under the adapter's own values
        # on the host, which slots hold a bias / a factor / anything: a step none of whose slots is here pays a
        # set test
        self.bias_slots: set[int] = set()
        self.factor_host: set[int] = set()
        self.active_slots: set[int] = set()

    def set(self, slot: int, bias: torch.Tensor | None, factor: torch.Tensor | None,
            replacement: Replacement | None = None) -> None:
        """`bias` and `factor` [out] (and `replacement`'s tensors), already in the model's dtype and on its device."""
        self.clear(slot)
        if bias is not None:
            self.bias = self._stack(self.bias, bias, 0.0)
            self.bias[slot] = bias
            self.bias_slots.add(slot)
        if factor is not None:
            self.factor = self._stack(self.factor, factor, 1.0)
            self.factor[slot] = factor
            if self.factor_slots is None:
                self.factor_slots = torch.zeros(self.num_slots + 1, dtype=torch.bool, device=factor.device)
            self.factor_slots[slot] = True
            self.factor_host.add(slot)
        if replacement is not None:
            self.replace[slot] = replacement
        if bias is not None or factor is not None or replacement is not None:
            self.active_slots.add(slot)

    def _stack(self, stack: torch.Tensor | None, row: torch.Tensor, fill: float) -> torch.Tensor:
        """A stacked layout's null slot (index S, tokens without an adapter) has its row too."""
        return stack if stack is not None else torch.full((self.num_slots + 1, row.shape[0]), fill,
                                                          dtype=row.dtype, device=row.device)

    def clear(self, slot: int) -> None:
        if slot in self.bias_slots:
            self.bias[slot] = 0.0
        if slot in self.factor_host:
            self.factor[slot] = 1.0
            self.factor_slots[slot] = False
        for held in (self.bias_slots, self.factor_host, self.active_slots):
            held.discard(slot)
        self.replace.pop(slot, None)

    def used_by(self, batch: LoRABatch) -> bool:
        """Whether a slot of this step (any pass) has anything here."""
        return bool(self.active_slots) and \
            not all(self.active_slots.isdisjoint(one.host_slots) for one in (batch, *batch.passes))

    def apply(self, y: torch.Tensor, batch: LoRABatch, base_bias: torch.Tensor | None, x: torch.Tensor
              ) -> torch.Tensor:
        """`y` (base output plus every pass's LoRA delta; `x` the input) with each pass's biases (times a mix's
        weights), then DoRA's factors and the rows under an adapter's own values (never in a mix, so on the first
        pass's tokens alone)."""
        if self.bias is not None:
            for one in (batch, *batch.passes):
                self._add_bias(y, one)
        if self.factor is not None:
            self._rescale(y, batch, base_bias)
        if self.replace:
            for slot, idx in batch.segments():
                if slot in self.replace:
                    apply_replacement(y, x, idx, self.replace[slot], base_bias)
        return y

    def _add_bias(self, y: torch.Tensor, batch: LoRABatch) -> None:
        add = self.bias.index_select(0, batch.order_slots)
        if batch.order_weights is not None:
            add *= batch.order_weights[:, None].to(add.dtype)
        y.index_add_(0, batch.token_order, add)

    def _rescale(self, y: torch.Tensor, batch: LoRABatch, base_bias: torch.Tensor | None) -> None:
        """DoRA's factor on each token's row (less the base's bias: a factor's own tokens alone)."""
        tokens, slots = batch.token_order, batch.order_slots
        if base_bias is not None:
            own = self.factor_slots.index_select(0, slots)
            tokens, slots = tokens[own], slots[own]
        rows = y.index_select(0, tokens)
        if base_bias is not None:
            rows = (rows - base_bias).mul_(self.factor.index_select(0, slots)).add_(base_bias)
        else:
            rows.mul_(self.factor.index_select(0, slots))
        y.index_copy_(0, tokens, rows)
