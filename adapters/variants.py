"""What an adapter's projections hold beyond one rank and one scale, as trainers write them, read into the
terms the engine applies per slot (`projection_extras.py`):

- `rank_pattern` / `alpha_pattern`: a module's own rank and alpha (peft matches each key, a regex, against the
  end of the module's full name; the first key that matches wins). The parts of one fused projection (q, k, v)
  are padded to their largest rank with zeros, which add nothing, and a part whose scale differs from the
  projection's first part has the ratio folded into its B columns.
- `lora_bias`: B's own bias; the delta is `scale * (B A x + b)`, so the bias joins each of the adapter's tokens
  times the part's scale.
- DoRA (`use_dora`, without lora_bias, which peft refuses beside it): the output is
  `m / ||W + scale * B A||_row * (W x + scale * B A x) + bias` (peft's unmerged forward, the norm per output row). The factor
  `m / ||...||` is a vector per projection, computed once when the adapter is read from the served base
  weights, and the layer rescales each of the adapter's tokens by it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import regex
import torch

from loraplex.adapters.saved_projections import Replacement


PATTERN_BUDGET_S = 2.0  # a client's patterns against every module name, all together


@dataclass
class ModuleWeights:
    """One targeted module of one layer, as the folder holds it."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float
    lora_bias: torch.Tensor | None = None  # [out]
    magnitude: torch.Tensor | None = None  # [out], DoRA's m

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class ProjectionTerms:
    """What a fused projection adds beyond (A, B^T) and the adapter's scale, all [out_total] float32:
    `bias` (each part's scale folded in; zero where a part has none), `magnitude` (NaN where a part is not DoRA's)
    and, once the base weights are known, `factor` (DoRA's per-row rescaling; 1 where a part is not DoRA's)."""

    scale: float
    bias: torch.Tensor | None = None
    magnitude: torch.Tensor | None = None
    factor: torch.Tensor | None = None
    replacement: Replacement | None = None  # rows the adapter holds its own values for (saved_projections.py)

    @property
    def nbytes(self) -> int:
        own = self.replacement.nbytes if self.replacement is not None else 0
        return sum(t.nbytes for t in (self.bias, self.factor) if t is not None) + own


class ModulePatterns:
    """peft's rank_pattern and alpha_pattern over the adapter's r and lora_alpha."""

    def __init__(self, raw: dict, max_lora_rank: int, fail) -> None:
        self.rank, self.alpha = int(raw["r"]), float(raw.get("lora_alpha", raw["r"]))
        self.rslora = bool(raw.get("use_rslora"))
        self.ranks = _pattern(raw, "rank_pattern", fail)
        self.alphas = _pattern(raw, "alpha_pattern", fail)
        self.seen: dict[str, tuple[int, float]] = {}  # module name -> its rank and scale
        self.left = [PATTERN_BUDGET_S]  # seconds of matching left, spent by every match
        for key, r in self.ranks.items():
            if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= max_lora_rank:
                raise fail(f"rank_pattern[{key!r}] must be an integer rank in [1, {max_lora_rank}], got {r!r}")
        for key, alpha in self.alphas.items():
            if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
                raise fail(f"alpha_pattern[{key!r}] must be a finite number, got {alpha!r}")

    def rank_and_scale(self, name: str, fail) -> tuple[int, float]:
        """The rank and scale of the module of this full name (`model.layers.3.self_attn.q_proj`)."""
        if name not in self.seen:
            rank = self.ranks.get(_first_match(self.ranks, name, self.left, fail), self.rank)
            alpha = float(self.alphas.get(_first_match(self.alphas, name, self.left, fail), self.alpha))
            self.seen[name] = rank, self._scale(rank, alpha)
        return self.seen[name]

    @property
    def scale(self) -> float:
        """The scale of a module no pattern names."""
        return self._scale(self.rank, self.alpha)

    def _scale(self, rank: int, alpha: float) -> float:
        return alpha / rank ** 0.5 if self.rslora else alpha / rank


def _pattern(raw: dict, key: str, fail) -> dict:
    value = raw.get(key) or {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and 0 < len(k) <= 1024 for k in value):
        raise fail(f"{key} must map module name patterns (at most 1024 characters) to values, got {value!r}")
    return value


def _first_match(patterns: dict, name: str, left: list[float], fail) -> str | None:
    """The first key matching `name`; `left` [seconds]: the matching time left to the adapter, spent here."""
    for key in patterns:  # peft: re.match(rf"(.*\.)?({key})$", name); a client's regex, so time-bounded
        if left[0] <= 0:
            raise fail(f"rank_pattern / alpha_pattern take longer than {PATTERN_BUDGET_S:g}s to match in all")
        start = time.monotonic()
        try:
            found = regex.match(rf"(.*\.)?({key})$", name, timeout=min(0.05, left[0]))
        except regex.error as exc:
            raise fail(f"pattern {key!r} is not a valid regex ({exc})") from None
        except TimeoutError:
            raise fail(f"pattern {key!r} takes too long to match (catastrophic backtracking)") from None
        left[0] -= time.monotonic() - start
        if found:
            return key
    return None


def fuse_terms(parts: list[ModuleWeights | None], offsets: list[int]) -> ProjectionTerms:
    """The terms of one fused projection from its parts (None: a part the adapter leaves alone)."""
    present = [p for p in parts if p is not None]
    terms = ProjectionTerms(present[0].scale)
    if any(p.lora_bias is not None for p in present):
        terms.bias = torch.zeros(offsets[-1])
    if any(p.magnitude is not None for p in present):
        terms.magnitude = torch.full((offsets[-1],), math.nan)
    for part, lo, hi in zip(parts, offsets[:-1], offsets[1:]):
        if part is not None and part.lora_bias is not None:
            terms.bias[lo:hi] = part.lora_bias.float() * part.scale
        if part is not None and part.magnitude is not None:
            terms.magnitude[lo:hi] = part.magnitude.float()
    return terms


def folded_b(part: ModuleWeights, projection_scale: float) -> torch.Tensor:
    """The part's B with its scale's ratio to the projection's folded in (exactly B where they agree)."""
    return part.b if part.scale == projection_scale else part.b.float() * (part.scale / projection_scale)


@torch.no_grad()
def dora_factor(terms: ProjectionTerms, weight: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor,
                offsets: list[int]) -> torch.Tensor:
    """DoRA's per-row factor m / ||W + scale * B A||_row of one fused projection (`weight` the served base
    weight [out_total, in]; `a` [n * r, in] and `b_t` [r, out_total] as the tables hold them, any part's scale
    ratio already in B), 1 on rows whose part is not DoRA's."""
    rank = b_t.shape[0]
    delta = torch.empty(offsets[-1], a.shape[1])
    for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        delta[lo:hi] = b_t[:, lo:hi].T.float() @ a[i * rank:(i + 1) * rank].float()
    norm = torch.linalg.norm(weight.detach().cpu().float() + terms.scale * delta, dim=1)  # the host's memory
    dora = ~torch.isnan(terms.magnitude)
    return torch.where(dora, terms.magnitude / norm, torch.ones_like(norm))
