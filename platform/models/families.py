"""Every family, each one declaration (docs/families.md): what its config.json means for the decoder, as
transformers' config and model classes for the family read it. All run the shared decoder (`llama.py`); a family
whose layers differ names its decoder layer, written beside it (`olmo2.py`)."""

from __future__ import annotations

from loraplex.platform.models.family import (PREFUSED_PROJECTIONS, Experts, Family, given_layer_types,
                                             one_window)
from loraplex.platform.models.olmo2 import Olmo2DecoderLayer


def qwen_layer_types(raw: dict) -> tuple[str, ...]:
    """Qwen2 / Qwen3: `layer_types`, else sliding from layer `max_window_layers` on when use_sliding_window."""
    given = given_layer_types(raw)
    if given is not None:
        return given
    slides = raw.get("use_sliding_window") and raw.get("sliding_window")
    return tuple("sliding_attention" if slides and i >= raw.get("max_window_layers", 28) else "full_attention"
                 for i in range(raw["num_hidden_layers"]))


def qwen_window(raw: dict) -> int | None:
    return raw.get("sliding_window") if raw.get("use_sliding_window") else None


def qk_norm(raw: dict, head_dim: int) -> dict:
    return {"qk_norm": True}


def gemma_layer_types(every: int | None):
    """Gemma: `layer_types`, else every `every`-th layer global (Gemma 3: the config's sliding_window_pattern)."""
    def layer_types(raw: dict) -> tuple[str, ...]:
        given = given_layer_types(raw)
        if given is not None:
            return given
        pattern = every or raw["sliding_window_pattern"]
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(raw["num_hidden_layers"]))
    return layer_types


def gemma_fields(raw: dict, head_dim: int) -> dict:
    """(1 + w) norms, four a layer, embeddings times sqrt(hidden), its own attention scale, final soft cap."""
    return dict(norm_offset=1.0, post_norms=True, attention_scale=raw["query_pre_attn_scalar"] ** -0.5,
                final_logit_softcap=raw.get("final_logit_softcapping"), embedding_multiplier=raw["hidden_size"] ** 0.5)


def gemma2_fields(raw: dict, head_dim: int) -> dict:
    return {**gemma_fields(raw, head_dim), "attn_logit_softcap": raw.get("attn_logit_softcapping")}


def gemma3_fields(raw: dict, head_dim: int) -> dict:
    # transformers' Gemma 3 reads attn_logit_softcapping but never applies it: neither do we
    return {**gemma_fields(raw, head_dim), "qk_norm": True}


def granite_fields(raw: dict, head_dim: int) -> dict:
    return dict(attention_scale=raw.get("attention_multiplier", 1.0),
                embedding_multiplier=raw.get("embedding_multiplier", 1.0),
                residual_multiplier=raw.get("residual_multiplier", 1.0), logits_scaling=raw.get("logits_scaling", 1.0))


def always(raw: dict) -> bool:
    return True


def qwen2_moe_bias(raw: dict) -> bool:
    return bool(raw.get("qkv_bias", True)) or bool(raw.get("attention_bias", False))  # Qwen2-MoE's own key


def smollm3_rope_layers(raw: dict) -> tuple[bool, ...]:
    """SmolLM3: each layer's, rotated by RoPE (`no_rope_layers`: 0 for a layer without it; by default every
    `no_rope_layer_interval`-th has none)."""
    n = raw["num_hidden_layers"]
    given = raw.get("no_rope_layers")
    if given is None:
        return tuple(bool((i + 1) % raw["no_rope_layer_interval"]) for i in range(n))
    if len(given) != n:
        raise ValueError(f"no_rope_layers must give 0 or 1 for each of the {n} layers, got {given}")
    return tuple(bool(flag) for flag in given)


def smollm3_layer_types(raw: dict) -> tuple[str, ...]:
    """With use_sliding_window, exactly the layers without RoPE slide, as transformers' SmolLM3 config lays them out."""
    given = given_layer_types(raw)
    if given is not None:
        return given
    slides = raw.get("use_sliding_window") and raw.get("sliding_window") is not None
    return tuple("sliding_attention" if slides and not rotated else "full_attention" for rotated in smollm3_rope_layers(raw))


def smollm3_fields(raw: dict, head_dim: int) -> dict:
    return {"rope_layers": smollm3_rope_layers(raw)}


GEMMA_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                  "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}
QWEN_EXPERTS = dict(size_key="moe_intermediate_size", names=("gate_proj", "up_proj", "down_proj"), windows=False)

LLAMA = Family("llama", ("LlamaForCausalLM",))
MISTRAL = Family("mistral", ("MistralForCausalLM",), layer_types=one_window)
QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), layer_types=qwen_layer_types, window=qwen_window, qkv_bias=always)
QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), defaults={"head_dim": 128}, layer_types=qwen_layer_types,
               window=qwen_window, fields=qk_norm)
GEMMA2 = Family("gemma2", ("Gemma2ForCausalLM",),
                defaults={**GEMMA_DEFAULTS, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
                layer_types=gemma_layer_types(2), activation_key="hidden_activation", fields=gemma2_fields)
GEMMA3 = Family("gemma3", ("Gemma3ForCausalLM",),
                defaults={**GEMMA_DEFAULTS, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                          "sliding_window_pattern": 6},
                layer_types=gemma_layer_types(None), activation_key="hidden_activation", fields=gemma3_fields)
# Phi-3's checkpoints (and so the peft adapters trained on them) hold q/k/v and gate/up already fused
PHI3 = Family("phi3", ("Phi3ForCausalLM",), defaults={"original_max_position_embeddings": 4096},
              layer_types=one_window, projections=PREFUSED_PROJECTIONS,
              rope_aliases={"su": "longrope", "yarn": "longrope"})  # its older names for LongRoPE
GRANITE = Family("granite", ("GraniteForCausalLM",), fields=granite_fields)
MIXTRAL = Family("mixtral", ("MixtralForCausalLM",), layer_types=one_window,
                 experts=Experts(defaults={"num_local_experts": 8, "num_experts_per_tok": 2},
                                 size_key="intermediate_size", names=("w1", "w3", "w2"),
                                 blocks=("mlp", "block_sparse_moe"), always_renormalize=True, float_weights=True,
                                 sparse_step=False))
QWEN2_MOE = Family("qwen2_moe", ("Qwen2MoeForCausalLM",), qkv_bias=qwen2_moe_bias,
                   experts=Experts(defaults={"num_experts": 60, "num_experts_per_tok": 4,
                                             "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632},
                                   **QWEN_EXPERTS))
QWEN3_MOE = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), fields=qk_norm,
                   experts=Experts(defaults={"num_experts": 128, "num_experts_per_tok": 8,
                                             "moe_intermediate_size": 768}, **QWEN_EXPERTS))

OLMO2 = Family("olmo2", ("Olmo2ForCausalLM",), decoder_layer=Olmo2DecoderLayer)
SMOLLM3 = Family("smollm3", ("SmolLM3ForCausalLM",), defaults={"no_rope_layer_interval": 4, "tie_word_embeddings": True},
                 layer_types=smollm3_layer_types, window=qwen_window, fields=smollm3_fields)

DECLARED = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, PHI3, GRANITE, MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMO2, SMOLLM3)
