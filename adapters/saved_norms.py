"""Norms an adapter retrained (`modules_to_save` naming a decoder layer's norms, its q / k norms or the final
norm): read from the folder, then served per slot.

peft saves each such module's whole weight (`model.layers.3.input_layernorm.weight`; older peft with
`.modules_to_save.<adapter>` before `.weight`) and uses it for the adapter's tokens in place of the base's. A
norm's weight is a vector, so per norm module the slots' weights are stacked [S + 1, dim] (made when the first
slot needs them) and a step recomputes the rows of the tokens whose slot has one: the same statistics over the
norm's input, times that slot's weight. Every other token keeps the base's output untouched.
"""

from __future__ import annotations

import re

import torch

from loraplex.adapters.saved_projections import saved_module
from loraplex.kernels.custom_ops import RMSNorm
from loraplex.kernels.lora_batch import LoRABatch

# a norm's key: (layer or None for the final norm, module name)
NORM_KEY = re.compile(r"^(?:base_model\.model\.)?model\.(?:layers\.(\d+)\.(self_attn\.)?)?(\w*norm)"
                      r"(?:\.modules_to_save(?:\.[\w-]+)?)?\.weight$")
FINAL = -1  # the layer index of the final norm


def norm_modules(model) -> list[tuple[int, str, torch.nn.Module]]:
    """(layer, name, module) of every norm of a model's decoder layers, then (FINAL, "norm", its final norm)."""
    found = [(index, name, module) for index, layer in enumerate(model.layers)
             for name, module in layer.named_modules() if isinstance(module, RMSNorm)]
    return found + [(FINAL, "norm", model.norm)]


def norm_dims(model) -> dict[str, int]:
    """Each norm's width by its module name (the same in every layer; a TP rank holds them whole)."""
    return {name.rpartition(".")[2]: module.weight.shape[0] for _, name, module in norm_modules(model)}


def is_norm_entry(entry: str) -> bool:
    """A modules_to_save entry naming norms (peft matches it against the end of each module's name)."""
    return entry.endswith("norm")


def read_saved_norms(tensors: dict[str, torch.Tensor], entries: list[str], dims: dict[str, int] | None,
                     num_layers: int, offset: float, dtype: torch.dtype, fail) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, norm) -> the adapter's weight for it, from the folder's norm keys (`entries`: modules_to_save's
    entries inside the layers, a norm saved with a block too; `dims`: each norm module of the served model and its
    width; None: no model to check against; `offset`: what the model adds to a norm's weight when it loads it,
    Gemma's 1)."""
    entries_of_norms = [entry for entry in entries if is_norm_entry(entry)]
    if not tensors and not entries_of_norms:
        return {}
    norms, read = {}, []
    for key, tensor in tensors.items():
        layer, block, name = NORM_KEY.match(key).groups()
        layer = FINAL if layer is None else int(layer)
        full = "model.norm" if layer == FINAL else f"model.layers.{layer}.{block or ''}{name}"
        if not saved_module(full, entries):
            raise fail(f"unexpected weight {key!r} (modules_to_save lists {sorted(entries)})")
        if dims is None:
            raise fail("modules_to_save on norms needs the served model to check them against")
        if name not in dims or (layer == FINAL) != (name == "norm") or layer >= num_layers:
            raise fail(f"weight {key!r} is for a norm the base model does not have: wrong base model?")
        if tuple(tensor.shape) != (dims[name],):
            raise fail(f"{name} weight of shape {tuple(tensor.shape)} does not fit the served model's "
                       f"({dims[name]},) (under tensor parallelism a q / k norm over all heads is split)")
        norms[(layer, name)] = (tensor.float() + offset).to(dtype)
        read.append(full)
    missing = [entry for entry in entries_of_norms if not any(full.endswith(entry) for full in read)]
    if missing:
        raise fail(f"modules_to_save lists {missing}, but the folder holds no weight for it")
    return norms


class SavedNorms:
    """One norm module's slots: the weight each slot uses in place of the base's."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.weight: torch.Tensor | None = None  # [S + 1, dim]
        self.has = torch.zeros(num_slots + 1, dtype=torch.bool)  # moved with the first weight
        self.active_slots: set[int] = set()  # the same on the host

    def set(self, slot: int, weight: torch.Tensor | None) -> None:
        """`weight` [dim] in the model's dtype, on its device."""
        self.clear(slot)
        if weight is None:
            return
        if self.weight is None:
            self.weight = weight.new_zeros(self.num_slots + 1, weight.shape[0])
            self.has = self.has.to(weight.device)
        self.weight[slot] = weight
        self.has[slot] = True
        self.active_slots.add(slot)

    def clear(self, slot: int) -> None:
        if slot in self.active_slots:
            self.has[slot] = False
            self.active_slots.discard(slot)

    def apply(self, out: torch.Tensor, src: torch.Tensor, batch: LoRABatch, eps: float) -> None:
        """Rows of `out` (the norm of `src` under the base's weight) of the tokens whose slot has a weight,
        recomputed under it: weight * (src * rsqrt(mean(src^2) + eps)), statistics in float32."""
        own = self.has.index_select(0, batch.order_slots)
        tokens, slots = batch.token_order[own], batch.order_slots[own]
        if not len(tokens):
            return
        rows = src.index_select(0, tokens).float()
        rows = (rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)).to(out.dtype)
        weight = self.weight.index_select(0, slots)
        out.index_copy_(0, tokens, weight.view(len(tokens), *[1] * (rows.dim() - 2), -1) * rows)
