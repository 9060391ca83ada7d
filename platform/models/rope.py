"""Rotary position embeddings: each layer type's parameters read from a config.json, and the cos/sin tables
computed as transformers computes them (default, linear, llama3, YaRN, LongRoPE).

A config.json spells RoPE as transformers 5's `rope_parameters` (one dict, or one per layer type: Gemma 3) or
as 4.x's `rope_scaling` + `rope_theta` (+ Gemma 3's `rope_local_base_freq`); both become one standardized
dict per layer type here. A RoPE we would not apply exactly as transformers does is a ValueError naming it.
"""

from __future__ import annotations

import json
import math

from collections.abc import Mapping

import torch
from torch import nn

from loraplex.platform.models.family import LAYER_TYPES

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_REQUIRED = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
             "yarn": (), "longrope": ("short_factor", "long_factor")}


def rope_parameters(raw: dict, aliases: Mapping[str, str], head_dim: int) -> dict[str, dict]:
    """Layer type -> its RoPE parameters (`rope_type`, `rope_theta` and the type's own keys), filled in as
    transformers' configs fill them in. `raw`: the config.json over the family's defaults; `aliases`: the
    family's older names of RoPE types."""
    given = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    nested = any(key in given for key in LAYER_TYPES)  # transformers 5, one RoPE per layer type (Gemma 3)
    if nested:
        per_type = {kind: dict(given.get(kind) or {}) for kind in LAYER_TYPES}
    elif "rope_local_base_freq" in raw:  # Gemma 3 as 4.x wrote it: the scaling is the global layers'
        per_type = {"full_attention": dict(given), "sliding_attention": {}}
    else:
        per_type = {kind: dict(given) for kind in LAYER_TYPES}
    if "rope_local_base_freq" in raw:  # Gemma 3's local layers turn at their own base
        per_type["sliding_attention"].setdefault("rope_theta", raw["rope_local_base_freq"])
    return {kind: _standardize(params, raw, aliases, head_dim, nested) for kind, params in per_type.items()}


def _standardize(params: dict, raw: dict, aliases: Mapping[str, str], head_dim: int, nested: bool) -> dict:
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params.pop("type", None)
    rope_type = aliases.get(rope_type, rope_type)  # as transformers reads the family's older names
    params["rope_type"] = rope_type
    params.setdefault("rope_theta", float(raw.get("rope_theta", 10000.0)))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)} "
                         "(dynamic NTK scaling changes with each sequence's length: not servable with a KV cache)")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (RoPE over the whole head only)")
    missing = [key for key in _REQUIRED[rope_type] if params.get(key) is None]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)} in the config")
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers: a top-level original_max_position_embeddings (Phi-3 writes it there) wins, but not in a
        # per-layer-type dict
        top = None if nested else raw.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = top or params.get("original_max_position_embeddings") \
            or raw.get("max_position_embeddings", 2048)
        if params.get("factor") is None:  # YaRN and LongRoPE then scale by how far the context was stretched
            params["factor"] = raw.get("max_position_embeddings", 2048) / params["original_max_position_embeddings"]
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(params[key]) != head_dim // 2:
                raise ValueError(f"longrope {key} has {len(params[key])} entries, the head needs {head_dim // 2}")
    return params


def inv_freq(params: dict, dim: int, max_len: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], the factor cos and sin are multiplied by), as transformers computes them.
    LongRoPE: transformers picks the long factors whenever the sequence is longer than the original context;
    a KV cache needs one choice for every position, so the long ones are used exactly when this engine may
    serve positions past the original context (`max_len`)."""
    base, kind = params["rope_theta"], params["rope_type"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if kind == "default":
        return 1.0 / (base ** exponents), 1.0
    if kind == "linear":
        return 1.0 / (base ** exponents) / params["factor"], 1.0
    if kind == "llama3":
        return _llama3(1.0 / (base ** exponents), params), 1.0
    if kind == "yarn":
        return _yarn(base, dim, params)
    return _longrope(base ** exponents, params, max_len)


def _llama3(inv: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, params: dict) -> tuple[torch.Tensor, float]:
    factor, old_len = params["factor"], params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in old_len
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero in the ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # high-frequency dimensions keep their frequency, low ones are interpolated
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attention_factor


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope(powers: torch.Tensor, params: dict, max_len: int) -> tuple[torch.Tensor, float]:
    factor, old_len = params["factor"], params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    ext = params["long_factor"] if max_len > old_len else params["short_factor"]
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * powers), attention_factor


NO_ROTATION = {"rope_type": "none"}  # a layer RoPE leaves out (SmolLM3's NoPE layers)


class RotaryEmbedding(nn.Module):
    """The cos/sin table of each distinct RoPE the layers use (Gemma 3: a local and a global one), over
    positions [0, max_len), with each layer's table."""

    def __init__(self, config, max_len: int) -> None:
        super().__init__()
        keys: dict[str, int] = {}
        self.layer_table: list[int] = []
        rotated = config.rope_layers or (True,) * config.num_layers
        for kind, rotates in zip(config.layer_types, rotated):
            params = config.rope_parameters[kind] if rotates else NO_ROTATION
            key = json.dumps(params, sort_keys=True)
            if key not in keys:
                keys[key] = len(keys)
                self._add_table(len(keys) - 1, params, config.head_dim, max_len)
            self.layer_table.append(keys[key])
        self.num_tables = len(keys)

    def _add_table(self, index: int, params: dict, dim: int, max_len: int) -> None:
        if params is NO_ROTATION:  # cos 1, sin 0: each layer's own RoPE kernel leaves q and k as they are
            self.register_buffer(f"cos{index}", torch.ones(max_len, dim), persistent=False)
            self.register_buffer(f"sin{index}", torch.zeros(max_len, dim), persistent=False)
            return
        inv, attention_factor = inv_freq(params, dim, max_len)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer(f"cos{index}", emb.cos() * attention_factor, persistent=False)
        self.register_buffer(f"sin{index}", emb.sin() * attention_factor, persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos, sin [T, 1, D] at a step's positions: looked up once per table, shared by the
        layers that use it."""
        tables = [(getattr(self, f"cos{i}")[positions].to(dtype)[:, None, :],
                   getattr(self, f"sin{i}")[positions].to(dtype)[:, None, :]) for i in range(self.num_tables)]
        return [tables[i] for i in self.layer_table]
