"""Slots: which adapters one batch may use, per layer and fused projection.

On the CPU a slot is a pointer, not a copy: `load` points each projection's `LoRATable` entry at
the adapter's own compact weights (`LoRAWeights.projections`, in its own rank), which the
multi-LoRA kernels read in place. Loading a slot costs microseconds, so `max_loras` is bounded
by memory (how many adapters may be resident at once), not by copy time.

Where the Triton kernels run (CUDA, or forced with `LORAPLEX_KERNELS=triton`), a slot is a copy:
each projection is a `StackedLoRA`, persistent device tensors the adapter is copied into (padded
to `max_lora_rank`), so a step reads adapters with no per-step allocation or host copy.

The embedding table and the LM head have a `VocabAdapters` each: per slot a LoRA and / or the adapter's
own full weight. On the CPU those are the adapter's tensors; with stacked slots they are copied to the
device when the slot is loaded (not preallocated: a full weight is vocab x hidden).

Each projection also has a `ProjectionExtras`: per slot B's bias and DoRA's factor, where the adapter has them
(`variants.py`). `eager_slots` holds the slots that have any: a step using one runs without decode graphs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from loraplex.adapters.lora_layers import VocabAdapters
from loraplex.adapters.peft_format import LoRAWeights, fused_offsets, module_shapes
from loraplex.adapters.moe_lora import MoESlots
from loraplex.adapters.moe_weights import MoELoRA
from loraplex.adapters.projection_extras import ProjectionExtras
from loraplex.adapters.saved_norms import SavedNorms
from loraplex.adapters.saved_projections import Replacement
from loraplex.adapters.vocab_weights import BaseTables
from loraplex.kernels.sgmv import LoRATable, StackedLoRA
from loraplex.platform.models.family import FUSED_PROJECTIONS
from loraplex.platform.models.model_config import ModelConfig


class LoRASlots:
    def __init__(self, config: ModelConfig, max_loras: int, dtype: torch.dtype, device: torch.device | None = None,
                 max_rank: int | None = None) -> None:
        """`max_rank` given: the stacked layout on `device`; else tables pointing in place (CPU)."""
        self.max_loras = max_loras
        self.stacked = max_rank is not None
        shapes = module_shapes(config)

        def table(fused: str) -> LoRATable | StackedLoRA:
            offsets = fused_offsets(fused, shapes)
            if not self.stacked:
                return LoRATable.empty(max_loras, offsets, dtype)
            return StackedLoRA.empty(max_loras, offsets, shapes[FUSED_PROJECTIONS[fused][0]][0], max_rank, dtype,
                                     device or torch.device("cpu"))

        self.layers: list[dict[str, LoRATable | StackedLoRA]] = [
            {fused: table(fused) for fused in FUSED_PROJECTIONS} for _ in range(config.num_layers)]
        self.extras: list[dict[str, ProjectionExtras]] = [
            {fused: ProjectionExtras(max_loras) for fused in FUSED_PROJECTIONS} for _ in range(config.num_layers)]
        self.norms: dict[tuple[int, str], SavedNorms] = {}  # per norm module, made as the model's are wrapped
        self.moe: dict[int, MoESlots] = {}  # per sparse layer, made as the model's MoE blocks are wrapped
        self.norm_dims: dict[str, int] | None = None  # each norm's width by name (saved_norms.norm_dims), once known
        self.eager_slots: set[int] = set()  # slots with extras or norms, which a decode graph does not apply
        self.dtype = dtype
        self.embedding, self.head = VocabAdapters.empty(max_loras), VocabAdapters.empty(max_loras)
        self.device = (device or torch.device("cpu")) if self.stacked else None  # None: the adapters' own tensors
        self.base: BaseTables | None = None  # set by the model (`set_base`), for adapters read after that
        self.listeners: list[Callable[[int, LoRAWeights | None], None]] = []

    def norm_table(self, key: tuple[int, str]) -> SavedNorms:
        """The slots of the norm module `key` (layer, name), made on first use."""
        return self.norms.setdefault(key, SavedNorms(self.max_loras))

    def moe_table(self, layer: int) -> MoESlots:
        """The slots of sparse layer `layer`'s router, experts and shared expert, made on first use."""
        return self.moe.setdefault(layer, MoESlots(self.max_loras))

    def listen(self, listener: Callable[[int, LoRAWeights | None], None]) -> None:
        """Call `listener(slot, weights)` whenever a slot is loaded (weights None: emptied), after the tables:
        tensor parallelism's workers follow the engine's slots this way."""
        self.listeners.append(listener)

    def set_base(self, dtype: torch.dtype, dense: Callable[[str], torch.Tensor],
                 served: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                 projection: Callable[[int, str], torch.Tensor] | None = None) -> None:
        """The served model's embedding table and head (`dense(module)`: [vocab, hidden]), which an adapter's
        copies of them are checked against when it is read, and its projections (DoRA's norms; None: this
        process holds a shard) (`vocab_weights.BaseTables`)."""
        self.base = BaseTables(dtype, dense, served, projection)

    @property
    def null_slot(self) -> int | None:
        """The slot index of tokens without an adapter in a stacked batch (rank 0), else None."""
        return self.max_loras if self.stacked else None

    def load(self, slot: int, lora: LoRAWeights) -> None:
        for index, layer in enumerate(self.layers):
            for fused, table in layer.items():
                pair = lora.projections.get((index, fused))
                if pair is None:
                    table.clear(slot)
                else:
                    table.set(slot, pair[0], pair[1], lora.scale_of((index, fused)))
        self._load_extras(slot, lora)
        self._load_vocab(slot, lora)
        for listener in self.listeners:
            listener(slot, lora)

    def load_projections(self, slot: int, lora: LoRAWeights) -> None:
        """Point an emptied slot's projection tables at an adapter of LoRA factors alone (no extras, norms, experts,
        vocabulary: `registry.preloadable`): what a fill beside a running step may write, touching no table
        that other slots share."""
        for index, layer in enumerate(self.layers):
            for fused, table in layer.items():
                pair = lora.projections.get((index, fused))
                if pair is not None:
                    table.set(slot, pair[0], pair[1], lora.scale_of((index, fused)))

    def _load_extras(self, slot: int, lora: LoRAWeights) -> None:
        dtype, device = self.base.dtype if self.base is not None else self.dtype, self.device or "cpu"
        put = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
        for index, layer in enumerate(self.extras):
            for fused, extras in layer.items():
                terms = lora.terms.get((index, fused))
                extras.set(slot, *((None, None, None) if terms is None else
                                   (put(terms.bias), put(terms.factor), _replacement_on(terms.replacement, put,
                                                                                         device))))
        for key, table in self.norms.items():
            table.set(slot, put(lora.norms.get(key)))
        for layer, table in self.moe.items():
            table.set(slot, _moe_on(lora.moe.get(layer), self.device))
        self.eager_slots.discard(slot)
        if lora.eager:  # decided on the whole adapter: every rank of a tensor-parallel group agrees
            self.eager_slots.add(slot)

    def _load_vocab(self, slot: int, lora: LoRAWeights) -> None:
        moved: dict[int, torch.Tensor] = {}  # a full weight both modules share is copied once

        def put(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or self.device is None:
                return t
            if id(t) not in moved:
                moved[id(t)] = t.to(self.device)
            return moved[id(t)]

        for table, lora_pair, module in ((self.embedding, lora.embedding, "embed_tokens"),
                                         (self.head, lora.head, "lm_head")):
            pair = None if lora_pair is None else (put(lora_pair[0]), put(lora_pair[1]))
            tokens = lora.tokens.get(module)
            tokens = None if tokens is None else (put(tokens[0]), put(tokens[1]))
            table.set(slot, pair, lora.scaling, put(lora.replacements.get(module)), tokens)

    def clear(self, slot: int) -> None:
        for layer in self.layers:
            for table in layer.values():
                table.clear(slot)
        for layer in self.extras:
            for extras in layer.values():
                extras.clear(slot)
        for table in self.norms.values():
            table.clear(slot)
        for table in self.moe.values():
            table.clear(slot)
        self.eager_slots.discard(slot)
        self.embedding.clear(slot)
        self.head.clear(slot)
        for listener in self.listeners:
            listener(slot, None)


def _moe_on(lora: MoELoRA | None, device: torch.device | None) -> MoELoRA | None:
    """A layer's MoE LoRA with its tensors on `device` (None: in place, the CPU's tables)."""
    if lora is None or device is None:
        return lora
    move = lambda part: part if part is None else dataclasses.replace(part, a=part.a.to(device),  # noqa: E731
                                                                       b=part.b.to(device))
    return MoELoRA(move(lora.router), move(lora.gate_up), move(lora.down),
                   {name: move(part) for name, part in lora.shared.items()})


def _replacement_on(replacement: Replacement | None, put, device) -> Replacement | None:
    """A replacement's values moved as `put` moves tensors, its row numbers to `device`."""
    if replacement is None:
        return None
    return Replacement(replacement.rows.to(device), put(replacement.weight), put(replacement.bias))
