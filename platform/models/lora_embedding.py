"""The token embedding and the LM head with each adapter's own changes to them, batched by slot.

An adapter may bring, for either module, a LoRA and / or its own full weight (peft's `modules_to_save`, or a
changed base layer: `adapters/vocab_weights.py`). The embedding reads each token's slot from the step's
`LoRABatch` (`LoRAContext`, as the LoRA projections do): a token of a slot with its own table takes that
table's row, then adds its LoRA delta, scale * A^T[id] B^T. The head computes logits only for the rows being
sampled, whose slots the model runner passes in: rows are grouped by slot, each group multiplied by its
slot's own head (or the base head) and given its LoRA. Tokens without an adapter take the base path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels import quant
from loraplex.kernels.dispatch import to_device
from loraplex.kernels.linear_methods import QuantizedLinear
from loraplex.platform.models.linear import Linear
from loraplex.platform.models.lora_linear import LoRAContext


@dataclass
class VocabAdapters:
    """One vocabulary-sized module's adapters, per slot: a LoRA (A, B^T) with its scale, and / or a full weight
    [vocab, hidden]. Setting a slot stores references (the registry's tensors on the CPU, device copies with
    stacked slots), so they live as long as the slot points at them."""

    lora: list[tuple[torch.Tensor, torch.Tensor] | None]
    scales: list[float]
    weights: list[torch.Tensor | None]
    num_active: int = 0  # slots holding anything: with none, a step pays one comparison

    @staticmethod
    def empty(num_slots: int) -> "VocabAdapters":
        return VocabAdapters([None] * num_slots, [0.0] * num_slots, [None] * num_slots)

    def set(self, slot: int, lora: tuple[torch.Tensor, torch.Tensor] | None, scale: float,
            weight: torch.Tensor | None) -> None:
        self.clear(slot)
        self.lora[slot], self.scales[slot], self.weights[slot] = lora, scale, weight
        self.num_active += self.active(slot)

    def clear(self, slot: int) -> None:
        self.num_active -= self.active(slot)
        self.lora[slot], self.scales[slot], self.weights[slot] = None, 0.0, None

    def active(self, slot: int) -> bool:
        return slot >= 0 and (self.lora[slot] is not None or self.weights[slot] is not None)

    def used_by(self, slots: list[int] | None) -> bool:
        """Whether any of these slots (-1: none) changes the module."""
        return bool(self.num_active and slots) and any(self.active(s) for s in set(slots))


class LoRAEmbedding(nn.Embedding):
    """`nn.Embedding` plus each token's adapter (`adapters`, set by `attach_vocab_adapters`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, context: LoRAContext) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.context = context
        self.adapters: VocabAdapters | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.adapt(input_ids, super().forward(input_ids))

    def adapt(self, input_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`rows`: the base table's rows of `input_ids` (a fresh tensor, changed in place), wherever the table
        lies (its own weight, or a tied head's tiles)."""
        batch, adapters = self.context.batch, self.adapters
        if batch is None or adapters is None or not adapters.num_active:
            return rows
        for slot, idx in batch.segments():  # a decode graph's per-token batch has none: see ModelRunner
            weight, lora = adapters.weights[slot], adapters.lora[slot]
            if weight is None and lora is None:
                continue
            ids = input_ids.index_select(0, idx)
            if weight is not None:
                rows.index_copy_(0, idx, weight.index_select(0, ids).to(rows.dtype))
            if lora is not None:
                a_t, b_t = lora
                delta = a_t.index_select(0, ids).to(rows.dtype) @ b_t.to(rows.dtype)
                rows.index_add_(0, idx, delta, alpha=adapters.scales[slot])
        return rows


class LoRAHead(Linear):
    """The LM head (`Linear`, any weight format) plus each sampled row's adapter (`adapters`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.adapters: VocabAdapters | None = None

    def forward(self, x: torch.Tensor, slots: list[int] | None = None) -> torch.Tensor:
        """`slots`: each row's adapter slot (-1: none); None: every row the base head."""
        adapters = self.adapters
        if adapters is None or not adapters.used_by(slots):
            return self.apply_method(self, x)
        return self._per_slot(x, slots, adapters)

    def _per_slot(self, x: torch.Tensor, slots: list[int], adapters: VocabAdapters) -> torch.Tensor:
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            groups.setdefault(slot if adapters.active(slot) else -1, []).append(row)
        own = {s: rows for s, rows in groups.items() if s >= 0 and adapters.weights[s] is not None}
        if not own:
            y = self.apply_method(self, x)
        else:
            y = x.new_empty(x.shape[0], self.out_features)
            base_rows = [r for s, rows in groups.items() if s not in own for r in rows]
            if base_rows:
                index = self._index(base_rows, x)
                y.index_copy_(0, index, self.apply_method(self, x.index_select(0, index)).to(y.dtype))
        for slot, rows in groups.items():
            if slot >= 0:
                self._add_slot(x, y, self._index(rows, x), adapters, slot)
        return y

    @staticmethod
    def _add_slot(x: torch.Tensor, y: torch.Tensor, index: torch.Tensor, adapters: VocabAdapters, slot: int) -> None:
        rows = x.index_select(0, index)
        weight, lora = adapters.weights[slot], adapters.lora[slot]
        if weight is not None:
            y.index_copy_(0, index, F.linear(rows, weight.to(rows.dtype)).to(y.dtype))
        if lora is not None:
            a, b_t = lora
            delta = (rows @ a.to(rows.dtype).T) @ b_t.to(rows.dtype)
            y.index_add_(0, index, delta.to(y.dtype), alpha=adapters.scales[slot])

    @staticmethod
    def _index(rows: list[int], x: torch.Tensor) -> torch.Tensor:
        return to_device(torch.tensor(rows, dtype=torch.long, device="cpu"), x.device)


def attach_vocab_adapters(embedding: LoRAEmbedding, head: LoRAHead, slots, tied: bool, dtype: torch.dtype) -> None:
    """Point the embedding and the head at their slot tables (`adapters/slots.py`), and tell the slots what the
    served table and head are (`dtype`: the model's): an adapter's copy equal to them is not kept."""
    embedding.adapters, head.adapters = slots.embedding, slots.head

    def dense(module: str) -> torch.Tensor:
        """A tied head is the table (whatever format serves it); a table held only in the head's tiles has no
        weight of its own."""
        if (module == "embed_tokens" or tied) and embedding.weight is not None:
            return embedding.weight
        return head.dense_weight()

    def served(module: str, weight: torch.Tensor) -> torch.Tensor:
        """An untied quantized head serves its float weight rounded: a copy of that float weight is the same."""
        if module == "lm_head" and not tied and isinstance(head.method, QuantizedLinear):
            return quant.dequantize(quant.quantize(weight, head.method.kind, head.method.group))
        return weight

    slots.set_base(dtype, dense, served)
