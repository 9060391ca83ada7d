"""SmolLM3, declared: a Llama decoder whose RoPE is left out on some layers (`no_rope_layers`: 0 for a layer
without it; by default every `no_rope_layer_interval`-th), and on which, with use_sliding_window, exactly
those layers slide, as transformers' SmolLM3 config lays them out."""

from __future__ import annotations

from loraplex.platform.models.families import qwen_window
from loraplex.platform.models.family import Family, given_layer_types


def rope_layers(raw: dict) -> tuple[bool, ...]:
    """Each layer's: rotated by RoPE."""
    n = raw["num_hidden_layers"]
    given = raw.get("no_rope_layers")
    if given is None:
        return tuple(bool((i + 1) % raw["no_rope_layer_interval"]) for i in range(n))
    if len(given) != n:
        raise ValueError(f"no_rope_layers must give 0 or 1 for each of the {n} layers, got {given}")
    return tuple(bool(flag) for flag in given)


def layer_types(raw: dict) -> tuple[str, ...]:
    given = given_layer_types(raw)
    if given is not None:
        return given
    slides = raw.get("use_sliding_window") and raw.get("sliding_window") is not None
    return tuple("sliding_attention" if slides and not rotated else "full_attention" for rotated in rope_layers(raw))


def fields(raw: dict, head_dim: int) -> dict:
    return {"rope_layers": rope_layers(raw)}


SMOLLM3 = Family("smollm3", ("SmolLM3ForCausalLM",),
                 defaults={"no_rope_layer_interval": 4, "tie_word_embeddings": True},
                 layer_types=layer_types, window=qwen_window, fields=fields)
