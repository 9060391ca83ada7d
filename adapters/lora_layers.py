"""LoRA as layers that wrap the model's own: the model is built without knowing adapters exist, and `attach_lora`
replaces each module its family's declaration lets LoRA target (`platform/models/family.py`) by a wrapper
around it, as vLLM's `*WithLoRA` layers do.

- `LoRALinear`: y = base(x) + scale[s] (x A[s]^T) B[s]^T, each token with its own slot's `LoRATable` /
  `StackedLoRA` (`adapters/slots.py`); shrink and expand through `kernels/sgmv.py` (`LoRADelta`); then a slot's
  B bias and DoRA factor (`ProjectionExtras`), where it has them.
- `LoRAEmbedding`: a token of a slot with its own table takes that table's row, then adds its LoRA delta.
- `LoRAHead`: the logits of the rows being sampled, grouped by slot, each group through its slot's own head
  (or the base head) plus its LoRA.
- `LoRAMoE`: a sparse MoE block whose router, experts and shared expert add each token's adapter
  (`adapters/moe_lora.py`).
- `SavedNormLayer`: a norm (RMSNorm, fused with the residual add or not) whose rows of tokens of a slot with a
  saved weight are recomputed under it (`adapters/saved_norms.py`).

Which slot each token and each sampled row uses reaches every wrapper through one `LoRAContext` (the step's
mapping, like punica's wrapper), which the model runner sets around a forward pass and a logits call.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.adapters.moe_lora import MoEDelta, MoESlots
from loraplex.adapters.projection_extras import ProjectionExtras
from loraplex.adapters.saved_norms import FINAL, SavedNorms, norm_dims, norm_modules
from loraplex.adapters.trainable_tokens import token_rows
from loraplex.kernels.custom_ops import LoRADelta, RMSNorm
from loraplex.kernels.dispatch import KernelConfig, to_device
from loraplex.kernels.lora_batch import LoRABatch
from loraplex.kernels.sgmv import LoRATable, StackedLoRA
from loraplex.platform.models.experts import is_sparse_layer
from loraplex.platform.models.family import PROJECTION_BLOCKS
from loraplex.platform.models.linear import Linear


class LoRAContext:
    """The current step's adapter mapping: `batch`, each token's slot grouping (None: no token uses an adapter),
    and `rows`, each logits row's slot (-1: none; None: every row the base head)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None
        self.rows: list[int] | None = None
        self.embedding: VocabAdapters | None = None  # set by `attach_lora`
        self.eager_slots: set[int] = set()  # the slots' own set (`LoRASlots.eager_slots`), set by `attach_lora`

    @contextmanager
    def mapping(self, batch: LoRABatch | None = None, rows: list[int] | None = None):
        """The mapping of one forward pass (`batch`) or one logits call (`rows`), cleared after it."""
        self.batch, self.rows = batch, rows
        try:
            yield
        finally:
            self.batch = self.rows = None

    def needs_eager(self, slots: list[int] | None) -> bool:
        """Whether a token's adapter changes the embedding or has projection extras (a decode graph holds
        neither)."""
        if self.eager_slots and slots and not self.eager_slots.isdisjoint(slots):
            return True
        return self.embedding is not None and self.embedding.used_by(slots)


class Wrapper(nn.Module):
    """A LoRA layer around a base module (`base_layer`, peft's name); what it does not define reads the base's."""

    def __init__(self, base: nn.Module, context: LoRAContext) -> None:
        super().__init__()
        self.base_layer, self.context = base, context
        self.__dict__["base"] = base  # the same module, read on the hot path without nn.Module's attribute lookup

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self.__dict__.get("_modules", {}).get("base_layer")
            if base is None:
                raise
            return getattr(base, name)


class LoRALinear(Wrapper):
    def __init__(self, base: Linear, context: LoRAContext, kernels: KernelConfig, lora: LoRATable | StackedLoRA,
                 extras: ProjectionExtras | None = None) -> None:
        super().__init__(base, context)
        self.lora, self.extras = lora, extras or ProjectionExtras(0)
        self.apply_base = base.apply_method  # the base's format, called directly: one module call a projection
        self.add_lora = LoRADelta(kernels)  # the layout of `lora` follows the same config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.apply_base(self.base, x)
        batch = self.context.batch
        if batch is None:
            return y
        y = self.add_lora(x, self.lora, batch, y)
        for mix_pass in batch.passes:  # adapter mixes: each token's further (slot, weight) pairs
            y = self.add_lora(x, self.lora, mix_pass, y)
        if self.extras.used_by(batch):
            y = self.extras.apply(y, batch, getattr(self.base, "bias", None), x)
        return y


class LoRAMoE(Wrapper):
    """A sparse MoE block whose router, experts and shared expert take each token's adapter (`MoEDelta`)."""

    def __init__(self, base: nn.Module, context: LoRAContext, slots: MoESlots) -> None:
        super().__init__(base, context)
        self.slots = slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self.context.batch
        if batch is None or not self.slots.used_by(batch):
            return self.base(x)
        return self.base(x, MoEDelta(self.slots, batch, x.shape[0]))


class SavedNormLayer(Wrapper):
    """A norm whose output, for the tokens of a slot with the norm's own weight, is recomputed under that weight."""

    def __init__(self, base: RMSNorm, context: LoRAContext, saved: SavedNorms) -> None:
        super().__init__(base, context)
        self.saved, self.norm = saved, base.forward  # the base's implementation, called without Module.__call__

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out = self.norm(x) if residual is None else self.norm(x, residual)
        batch = self.context.batch
        if batch is None or self.saved.active_slots.isdisjoint(batch.host_slots):
            return out
        if residual is None:  # the norm's input is x; fused with the residual add, it is the sum it returns
            self.saved.apply(out, x, batch, self.base.eps)
        else:
            self.saved.apply(out[0], out[1], batch, self.base.eps)
        return out


@dataclass
class VocabAdapters:
    """One vocabulary-sized module's adapters, per slot: a LoRA (A, B^T) with its scale, and / or a full weight
    [vocab, hidden]. Setting a slot stores references (the registry's tensors on the CPU, device copies with
    stacked slots), so they live as long as the slot points at them."""

    lora: list[tuple[torch.Tensor, torch.Tensor] | None]
    scales: list[float]
    weights: list[torch.Tensor | None]
    tokens: list[tuple[torch.Tensor, torch.Tensor] | None]  # trained rows of some token ids (trainable_tokens.py)
    num_active: int = 0  # slots holding anything: with none, a step pays one comparison

    @staticmethod
    def empty(num_slots: int) -> "VocabAdapters":
        return VocabAdapters([None] * num_slots, [0.0] * num_slots, [None] * num_slots, [None] * num_slots)

    def set(self, slot: int, lora: tuple[torch.Tensor, torch.Tensor] | None, scale: float,
            weight: torch.Tensor | None, tokens: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.clear(slot)
        self.lora[slot], self.scales[slot], self.weights[slot], self.tokens[slot] = lora, scale, weight, tokens
        self.num_active += self.active(slot)

    def clear(self, slot: int) -> None:
        self.num_active -= self.active(slot)
        self.lora[slot], self.scales[slot], self.weights[slot], self.tokens[slot] = None, 0.0, None, None

    def active(self, slot: int) -> bool:
        return slot >= 0 and (self.lora[slot] is not None or self.weights[slot] is not None
                              or self.tokens[slot] is not None)

    def used_by(self, slots: list[int] | None) -> bool:
        """Whether any of these slots (-1: none) changes the module."""
        return bool(self.num_active and slots) and any(self.active(s) for s in set(slots))


class LoRAEmbedding(Wrapper):
    """The token embedding plus each token's adapter."""

    def __init__(self, base: nn.Module, context: LoRAContext, adapters: VocabAdapters) -> None:
        super().__init__(base, context)
        self.adapters = adapters

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.base(input_ids)  # a fresh tensor, changed in place below
        batch, adapters = self.context.batch, self.adapters
        if batch is None or not adapters.num_active:
            return rows
        for slot, idx in batch.segments():  # a decode graph's per-token batch has none: see ModelRunner
            weight, lora, tokens = adapters.weights[slot], adapters.lora[slot], adapters.tokens[slot]
            if weight is None and lora is None and tokens is None:
                continue
            ids = input_ids.index_select(0, idx)
            if weight is not None:
                rows.index_copy_(0, idx, weight.index_select(0, ids).to(rows.dtype))
            if tokens is not None:  # trained rows replace the base's
                at, which = token_rows(tokens, ids)
                rows.index_copy_(0, idx.index_select(0, at), tokens[1].index_select(0, which).to(rows.dtype))
            if lora is not None:
                a_t, b_t = lora
                delta = a_t.index_select(0, ids).to(rows.dtype) @ b_t.to(rows.dtype)
                rows.index_add_(0, idx, delta, alpha=adapters.scales[slot])
        return rows


class LoRAHead(Wrapper):
    """The LM head (a `Linear` of any weight format) plus each sampled row's adapter (`context.rows`)."""

    def __init__(self, base: Linear, context: LoRAContext, adapters: VocabAdapters) -> None:
        super().__init__(base, context)
        self.adapters = adapters
        self.apply_base = base.apply_method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slots, adapters = self.context.rows, self.adapters
        if not adapters.used_by(slots):
            return self.apply_base(self.base, x)
        return self._per_slot(x, slots, adapters)

    def _per_slot(self, x: torch.Tensor, slots: list[int], adapters: VocabAdapters) -> torch.Tensor:
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            groups.setdefault(slot if adapters.active(slot) else -1, []).append(row)
        own = {s: rows for s, rows in groups.items() if s >= 0 and adapters.weights[s] is not None}
        if not own:
            y = self.apply_base(self.base, x)
        else:
            y = x.new_empty(x.shape[0], self.base_layer.out_features)
            base_rows = [r for s, rows in groups.items() if s not in own for r in rows]
            if base_rows:
                index = _index(base_rows, x)
                y.index_copy_(0, index, self.apply_base(self.base, x.index_select(0, index)).to(y.dtype))
        for slot, rows in groups.items():
            if slot >= 0:
                _add_slot(x, y, _index(rows, x), adapters, slot)
        return y


def _add_slot(x: torch.Tensor, y: torch.Tensor, index: torch.Tensor, adapters: VocabAdapters, slot: int) -> None:
    rows = x.index_select(0, index)
    weight, lora, tokens = adapters.weights[slot], adapters.lora[slot], adapters.tokens[slot]
    if weight is not None:
        y.index_copy_(0, index, F.linear(rows, weight.to(rows.dtype)).to(y.dtype))
    if tokens is not None:  # the trained rows' logits replace the base's
        ids, trained = tokens
        y[index[:, None], ids.to(y.device)[None, :]] = F.linear(rows, trained.to(rows.dtype)).to(y.dtype)
    if lora is not None:
        a, b_t = lora
        delta = (rows @ a.to(rows.dtype).T) @ b_t.to(rows.dtype)
        y.index_add_(0, index, delta.to(y.dtype), alpha=adapters.scales[slot])


def _index(rows: list[int], x: torch.Tensor) -> torch.Tensor:
    return to_device(torch.tensor(rows, dtype=torch.long, device="cpu"), x.device)


def attach_lora(model: nn.Module, slots, kernels: KernelConfig) -> LoRAContext:
    """Wrap every module the model's family lets LoRA target, each pointed at its slot table (`slots`: the
    registry's `LoRASlots`); the projections of a sparse (MoE) layer's experts take none. Returns the context
    the model runner sets each step."""
    config, context = model.config, LoRAContext()
    for index, (layer, tables, extras) in enumerate(zip(model.layers, slots.layers, slots.extras)):
        for fused in config.family.projections:
            block_name = PROJECTION_BLOCKS[fused]
            if block_name == "mlp" and is_sparse_layer(config, index):
                continue  # its experts' adapters: LoRAMoE
            block = getattr(layer, block_name)
            setattr(block, fused, LoRALinear(getattr(block, fused), context, kernels, tables[fused], extras[fused]))
    for index, layer in enumerate(model.layers):
        if is_sparse_layer(config, index):
            layer.mlp = LoRAMoE(layer.mlp, context, slots.moe_table(index))
    wrap_norms(model, slots, context)
    context.embedding, context.eager_slots = slots.embedding, slots.eager_slots
    model.embed_tokens = LoRAEmbedding(model.embed_tokens, context, slots.embedding)
    model.lm_head = LoRAHead(model.lm_head, context, slots.head)
    tell_base_tables(model, slots, kernels.dtype)
    return context


def wrap_norms(model: nn.Module, slots, context: LoRAContext) -> None:
    """Every norm of the decoder layers and the final norm wrapped for saved norms."""
    slots.norm_dims = norm_dims(model)
    for index, name, module in norm_modules(model):
        owner = model if index == FINAL else model.layers[index]
        parent, _, leaf = name.rpartition(".")
        setattr(owner.get_submodule(parent), leaf, SavedNormLayer(module, context, slots.norm_table((index, leaf))))


def tell_base_tables(model: nn.Module, slots, dtype: torch.dtype) -> None:
    """Tell the slots what the served table and head are (`dtype`: the model's): an adapter's copy equal to them
    is not kept."""
    embedding, head, tied = model.embed_tokens.base_layer, model.lm_head.base_layer, model.config.tie_word_embeddings

    def dense(module: str) -> torch.Tensor:
        """A tied head is the table (whatever format serves it); a table held only in the head's tiles has no
        weight of its own."""
        if (module == "embed_tokens" or tied) and embedding.weight is not None:
            return embedding.weight
        return head.dense_weight()

    def served(module: str, weight: torch.Tensor) -> torch.Tensor:
        """An untied head serves a float weight as its format rounds it: a copy of that weight is the same."""
        return head.served(weight) if module == "lm_head" and not tied else weight

    def projection(layer: int, fused: str) -> torch.Tensor:
        return getattr(getattr(model.layers[layer], PROJECTION_BLOCKS[fused]), fused).base_layer.dense_weight()

    slots.set_base(dtype, dense, served, projection if model.config.shard is None else None)
