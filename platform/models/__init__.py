"""Model implementations, by Hugging Face architecture name."""

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
}

# Our fused projections and the Hugging Face / peft modules each one stacks, in output order.
# The model's weight loading, the adapter reader and the LoRA tables all follow this one map.
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
