"""A model's shape and what its family changes in the shared decoder, as one frozen value (`ModelConfig`): what every
model module, the adapters and the engine read. It imports nothing of the model code, so each of those can; the
value is read from a model folder's config.json through the family declarations by `registry.read_model_config`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a Hugging Face config.json our decoder needs; what a family changes in it is a field
    (docs/families.md). Read from a folder by `registry.read_model_config`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]  # each layer's: "full_attention" or "sliding_attention"
    rope_parameters: dict[str, dict]  # layer type -> its RoPE, standardized (models/rope.py)
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None  # the windowed layers' window (None: no layer has one)
    eos_token_ids: tuple[int, ...]
    layer_windows: tuple[int | None, ...]  # each layer's sliding window (None: it sees its whole context)
    hidden_act: str  # the MLP gate's activation (transformers' name)
    norm_offset: float  # each RMSNorm multiplies by (norm_offset + w): Gemma's are 1 + w
    post_norms: bool  # Gemma: attention and MLP outputs normalized too, and a norm before the MLP (4 a layer)
    qk_norm: bool  # Qwen3, Gemma 3: RMSNorm on each q and k head before RoPE
    attention_scale: float  # of q.k: head_dim^-0.5, Gemma's query_pre_attn_scalar^-0.5, Granite's multiplier
    attn_logit_softcap: float | None  # Gemma 2: scores become c tanh(s / c)
    final_logit_softcap: float | None  # Gemma: logits become c tanh(l / c)
    embedding_multiplier: float  # Gemma: sqrt(hidden) (rounded to the model's dtype, as transformers does); Granite's
    residual_multiplier: float  # Granite: each block's output is scaled before the residual add
    logits_scaling: float  # Granite: the logits are divided by it
    rope_layers: tuple[bool, ...] = ()  # each layer's: rotated by RoPE (SmolLM3 leaves some out); (): every one
    prequantized: tuple[str, int, bool] | None = None  # a GPTQ / AWQ checkpoint: (method, group, v1 zeros)
    moe: "MoEConfig | None" = None  # experts and routing of a mixture-of-experts model (models/experts.py)
    family: "Family | None" = field(default=None, compare=False, repr=False)  # its declaration (models/family.py)
    shard: "ShardPlan | None" = field(default=None, compare=False, repr=False)  # one TP rank's part (models/sharding.py)
