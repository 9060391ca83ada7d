"""Model implementations, by Hugging Face architecture name."""

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",  # the per-family differences: ModelConfig's fields (docs/families.md)
    "Gemma2ForCausalLM": "llama",
    "Gemma3ForCausalLM": "llama",
    "Phi3ForCausalLM": "llama",
    "GraniteForCausalLM": "llama",
    "MixtralForCausalLM": "llama",  # sparse MLPs: models/moe.py
    "Qwen2MoeForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",
}

# Our fused projections and the Hugging Face / peft modules each one stacks, in output order.
# The model's weight loading, the adapter reader and the LoRA tables all follow this map (per family:
# `fused_projections`).
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}

# Phi-3's checkpoints, and so the peft adapters trained on them, hold q/k/v and gate/up already fused,
# under our names: each of our projections is one of its modules.
PHI3_PROJECTIONS = {fused: (fused,) for fused in FUSED_PROJECTIONS}


def fused_projections(architecture: str) -> dict[str, tuple[str, ...]]:
    """The Hugging Face / peft modules each of our fused projections stacks, for this architecture."""
    return PHI3_PROJECTIONS if architecture == "Phi3ForCausalLM" else FUSED_PROJECTIONS


ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP gate's, by transformers' names

# transformers' defaults for config.json keys that change what a family computes, where a checkpoint
# may leave them out (older Gemma configs have no layer_types, Phi-3's no original_max_position_embeddings)
CONFIG_DEFAULTS = {
    "Qwen3ForCausalLM": {"head_dim": 128},
    "Gemma2ForCausalLM": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                          "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    "Gemma3ForCausalLM": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                          "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                          "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6},
    "Phi3ForCausalLM": {"original_max_position_embeddings": 4096},
}
