"""Projections an adapter holds its own values for, beside or instead of LoRA:

- `modules_to_save` naming a projection or a block of them (`"mlp"`, `"self_attn"`, `"k_proj"`,
  `"layers.1.mlp"`; peft matches each entry against the end of a module's name, or of one above it): peft saves
  each such module's whole weight (and bias) and uses it for the adapter's tokens;
- `bias="lora_only"` / `"all"`: the trained biases of the LoRA-targeted modules (`....q_proj.base_layer.bias`), or
  of every module that has one (`....k_proj.bias`), replacing the base's.

Per fused projection they are the adapter's own rows (`Replacement`): for its tokens those outputs are
recomputed from the rows' own weight and bias, or (a trained bias alone) moved by their bias's difference from
the base's (`projection_extras.py` applies them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.platform.models.family import FUSED_PROJECTIONS, PREFUSED_PROJECTIONS

BLOCKS = ("self_attn", "mlp")
# every projection module name peft may save, of every family
PROJECTIONS = tuple({p for table in (FUSED_PROJECTIONS, PREFUSED_PROJECTIONS) for fused, parts in table.items()
                     for p in (fused, *parts)})


@dataclass
class Replacement:
    rows: torch.Tensor  # int64 [n], rows of the fused projection's output
    weight: torch.Tensor | None  # [n, in]: their own weight (a saved module); None: only their bias is the adapter's
    bias: torch.Tensor | None  # [n]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.rows, self.weight, self.bias) if t is not None)


def saved_module(name: str, entries: list[str]) -> bool:
    """Whether modules_to_save (`entries`) covers the module of this full name: it, or a module above it, ends
    with an entry (peft's `key.endswith(entry)`, the whole module saved with what it holds)."""
    parts = name.split(".")
    return any(".".join(parts[:i]).endswith(entry) for entry in entries for i in range(len(parts), 0, -1))


def is_projection_entry(entry: str) -> bool:
    """A modules_to_save entry naming projections, or a block of them."""
    return entry.rpartition(".")[2] in (*BLOCKS, *PROJECTIONS)


def fuse_replacements(parts: list[dict[str, torch.Tensor] | None], offsets: list[int], dtype: torch.dtype
                      ) -> Replacement | None:
    """One fused projection's replacement from its parts' own tensors ({"weight", "bias"}; None: the base's)."""
    rows, weights, biases = [], [], []
    for part, lo, hi in zip(parts, offsets[:-1], offsets[1:]):
        if part:
            rows.append(torch.arange(lo, hi))
            weights.append(part.get("weight"))
            biases.append(part.get("bias"))
    if not rows:
        return None
    if any(w is None for w in weights) and any(w is not None for w in weights):
        raise ValueError("a fused projection mixes saved parts with parts whose trained bias alone is saved")
    weight = None if weights[0] is None else torch.cat(weights).to(dtype).contiguous()
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else torch.zeros(len(r)) for b, r in zip(biases, rows)]).to(dtype)
    return Replacement(torch.cat(rows), weight, bias)


def shard_replacement(replacement: Replacement, columns: torch.Tensor | None, input_columns: torch.Tensor | None,
                      rank: int) -> Replacement | None:
    """As a rank holds the projection: a column-parallel rank's rows of it (`columns`, renumbered as the rank's
    own); a row-parallel rank's input columns of the weight, the bias on rank 0 alone (partial sums add up)."""
    if columns is not None:
        local = torch.full((max(int(replacement.rows.max()), int(columns.max())) + 1,), -1, dtype=torch.long)
        local[columns] = torch.arange(len(columns))
        at = local[replacement.rows]
        keep = at >= 0
        if not bool(keep.any()):
            return None
        pick = lambda t: None if t is None else t[keep]  # noqa: E731
        return Replacement(at[keep], pick(replacement.weight), pick(replacement.bias))
    weight = None if replacement.weight is None else replacement.weight.index_select(1, input_columns).contiguous()
    bias = replacement.bias if rank == 0 else None
    if weight is None and bias is None:
        return None
    return Replacement(replacement.rows, weight, bias)


def apply_replacement(y: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, replacement: Replacement,
                      base_bias: torch.Tensor | None) -> None:
    """The rows of `y` of these tokens (`idx`) under the adapter's own values."""
    cols = replacement.rows.to(y.device)
    if replacement.weight is None:  # a trained bias: the base's replaced
        delta = replacement.bias - (base_bias.index_select(0, cols) if base_bias is not None else 0)
        y[idx[:, None], cols[None, :]] += delta.to(y.dtype)
        return
    out = torch.nn.functional.linear(x.index_select(0, idx).to(replacement.weight.dtype), replacement.weight,
                                     replacement.bias)
    y[idx[:, None], cols[None, :]] = out.to(y.dtype)
