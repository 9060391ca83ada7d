"""A request's mix of adapters: y = W x + sum_i w_i * (alpha_i / r_i) * B_i A_i x.

That is what peft's `add_weighted_adapter(..., combination_type="cat")` builds into one adapter, served
here without merging: each adapter keeps its own slot, and the mix's weights scale each token's deltas
(`kernels/sgmv.py`, token weights), so requests with different mixes share one batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field as dataclass_field
from functools import cached_property

MAX_MIX_WEIGHT = 4.0  # |w| bound: beyond it a mix is far outside what any adapter was trained for


@dataclass(frozen=True)
class AdapterMix:
    """(adapter name, weight) pairs in the caller's order, validated by `parse`."""

    entries: tuple[tuple[str, float], ...]
    field: str = dataclass_field(default="adapter", compare=False)  # what the caller named it, for errors

    @property
    def heaviest(self) -> str:
        """The adapter of the largest |weight| (the first of equals): where a router sends the mix."""
        return max(self.entries, key=lambda entry: abs(entry[1]))[0]

    @cached_property  # the scheduler asks for each waiting and running request every step
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.entries)

    @property
    def plain(self) -> str | None:
        """The one adapter's name when the mix is one adapter at weight 1.0 (today's fast path), else None."""
        if len(self.entries) == 1 and self.entries[0][1] == 1.0:
            return self.entries[0][0]
        return None


def parse_mix(spec, max_adapters: int, field: str = "adapter") -> AdapterMix:
    """An `AdapterMix` from a list of (name, weight) pairs, a dict name -> weight or an `AdapterMix`;
    ValueError naming `field` for an empty mix, a name twice, too many adapters, a weight that is not a
    finite number in [-MAX_MIX_WEIGHT, MAX_MIX_WEIGHT]."""
    if isinstance(spec, AdapterMix):  # checked again where it is used: under the name its caller gave it
        pairs, field = spec.entries, spec.field
    else:
        pairs = list(spec.items()) if isinstance(spec, dict) else spec
    try:
        entries = tuple((name, weight) for name, weight in pairs)
    except (TypeError, ValueError):
        raise ValueError(f"{field}: a mix is a list of (adapter name, weight) pairs or a dict") from None
    if not entries:
        raise ValueError(f"{field}: an adapter mix needs at least one adapter")
    if len(entries) > max_adapters:
        raise ValueError(f"{field}: {len(entries)} adapters in one mix, at most {max_adapters} "
                         f"(max_adapters_per_request)")
    mix = AdapterMix(tuple(_entry(name, weight, i, field) for i, (name, weight) in enumerate(entries)), field)
    twice = next((name for name in mix.names if mix.names.count(name) > 1), None)
    if twice is not None:
        raise ValueError(f"{field}: adapter {twice!r} appears more than once in the mix")
    return mix


def _entry(name, weight, index: int, field: str) -> tuple[str, float]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{field}[{index}]: the adapter name must be a non-empty string")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ValueError(f"{field}[{index}].weight: a number, got {type(weight).__name__}")
    if not math.isfinite(weight) or abs(weight) > MAX_MIX_WEIGHT:
        raise ValueError(f"{field}[{index}].weight: {weight} is not a finite number in "
                         f"[-{MAX_MIX_WEIGHT:g}, {MAX_MIX_WEIGHT:g}]")
    return name, float(weight)
