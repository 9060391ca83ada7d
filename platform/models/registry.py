"""Architecture name (a config.json's `architectures[0]`) -> its family's declaration, and a model folder's
config.json -> its `ModelConfig` through that declaration (`read_model_config`). Adding a family: its
declaration in `families.py` (and, where its layers differ, its decoder layer in a module of its own)."""

from __future__ import annotations

import json
from pathlib import Path

from loraplex.platform.models.experts import MoEConfig
from loraplex.platform.models.families import DECLARED
from loraplex.platform.models.family import ACTIVATIONS, Family
from loraplex.platform.models.model_config import ModelConfig
from loraplex.platform.models.quantized import checkpoint_quantization
from loraplex.platform.models.rope import rope_parameters

FAMILIES: dict[str, Family] = {arch: family for family in DECLARED for arch in family.architectures}


def family_for(architecture: str) -> Family:
    """The declaration of `architecture`; a ValueError naming what is supported for any other."""
    family = FAMILIES.get(architecture)
    if family is None:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: {', '.join(sorted(FAMILIES))}")
    return family


def read_model_config(path: str | Path) -> ModelConfig:
    """The `ModelConfig` of the model folder `path`, by its family's declaration; an unsupported architecture or
    setting is a ValueError naming it and the folder."""
    raw = json.loads((Path(path) / "config.json").read_text())
    arch = (raw.get("architectures") or [raw.get("model_type", "unknown")])[0]
    try:
        family = family_for(arch)
        raw = {**family.defaults, **raw}  # what the file leaves out, as transformers fills it in
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        fields = _family_fields(raw, family, head_dim)
    except ValueError as exc:
        raise ValueError(f"{exc} (in {path})") from None
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=family.qkv_bias(raw),
        eos_token_ids=_as_tuple(raw.get("eos_token_id")),
        **fields,
        prequantized=checkpoint_quantization(raw.get("quantization_config")),
        moe=MoEConfig.from_raw(raw, family.experts, arch),
        family=family,
    )


def _family_fields(raw: dict, family: Family, head_dim: int) -> dict:
    """The ModelConfig fields in which the families differ: the shared decoder's defaults, then what the family's
    declaration sets (docs/families.md); what we would not serve exactly is a ValueError naming it."""
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (attention to later tokens) is not supported")
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias (biases on the MLP projections) is not supported")
    act = raw.get(family.activation_key, "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    types, window = family.layer_types(raw), family.window(raw)
    windows = tuple(window if kind == "sliding_attention" else None for kind in types)
    shared = dict(layer_types=types, rope_parameters=rope_parameters(raw, family.rope_aliases, head_dim),
                  sliding_window=window if any(windows) else None, layer_windows=windows, hidden_act=act,
                  norm_offset=0.0, post_norms=False, qk_norm=False, attention_scale=head_dim ** -0.5,
                  attn_logit_softcap=None, final_logit_softcap=None, embedding_multiplier=1.0,
                  residual_multiplier=1.0, logits_scaling=1.0)
    return {**shared, **family.fields(raw, head_dim)}


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)
