"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

q/k/v and gate/up are fused into one matmul each; weights load straight from safetensors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from loraplex.kernels.dispatch import KernelConfig
from loraplex.kernels.linear_methods import tile_table_into_head
from loraplex.kernels.paged_attention import PagedAttentionMetadata
from loraplex.kernels.sgmv import LoRABatch
from loraplex.platform.config import ModelConfig
from loraplex.platform.models import FUSED_PROJECTIONS
from loraplex.kernels.custom_ops import PagedAttention, RMSNorm, RopeKVWrite, SiluAndMul
from loraplex.platform.models.linear import Linear
from loraplex.platform.models.lora_linear import LoRAContext, LoRALinear
from loraplex.platform.models.quantized import head_format, quantize_model, read_prequantized


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, max_len: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(config))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] of a step's positions: looked up once, used by every layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, lora: LoRAContext, kernels: KernelConfig) -> None:
        super().__init__()
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = heads * head_dim
        self.qkv_proj = LoRALinear(config.hidden_size, (heads + 2 * kv_heads) * head_dim, config.qkv_bias, lora,
                                   kernels, "qkv_proj")
        self.o_proj = LoRALinear(self.q_size, config.hidden_size, False, lora, kernels, "o_proj")
        self.rope_kv_write = RopeKVWrite(heads, kv_heads, head_dim, kernels)
        self.attn = PagedAttention(head_dim ** -0.5, kernels)

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_cache, meta: PagedAttentionMetadata):
        k_cache, v_cache = kv_cache
        q = self.rope_kv_write(self.qkv_proj(x), rope, k_cache, v_cache, meta)
        out = self.attn(q, k_cache, v_cache, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, lora: LoRAContext, kernels: KernelConfig) -> None:
        super().__init__()
        self.gate_up_proj = LoRALinear(config.hidden_size, 2 * config.intermediate_size, False, lora, kernels,
                                       "gate_up_proj")
        self.down_proj = LoRALinear(config.intermediate_size, config.hidden_size, False, lora, kernels, "down_proj")
        self.act = SiluAndMul(kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, lora: LoRAContext, kernels: KernelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.self_attn = Attention(config, lora, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.mlp = MLP(config, lora, kernels)

    def forward(self, x, residual, rope, kv_cache, meta):
        """-> (this layer's MLP output, the residual stream before adding it); the add happens in
        the next norm (fused with it)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, kv_cache, meta), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_len: int, kernels: KernelConfig | None = None) -> None:
        super().__init__()
        kernels = kernels or KernelConfig()
        self.config, self.kernels = config, kernels
        self.lora_context = LoRAContext()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, self.lora_context, kernels) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.rope = RotaryEmbedding(config, max_len)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, kernels, head_format(kernels.quantization))
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
            self.lm_head.shared_weight = True  # kept when the head's weight is processed: it is the table

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: PagedAttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        """Flat batch of tokens -> final hidden states [T, hidden]. `lora`: each token's adapter
        slot (None: no token uses one), read by every LoRA layer of this pass."""
        self.lora_context.batch = lora
        try:
            x, residual = self.embed(input_ids), None
            rope = self.rope.at(positions, x.dtype)
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, residual = layer(x, residual, rope, kv_cache, meta)
            return self.norm(x, residual)[0]
        finally:
            self.lora_context.batch = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> their rows of the embedding table."""
        if self.embed_tokens.weight is None:  # tied, and held once in the head's weight format
            return self.lm_head.method.rows(self.lm_head, input_ids)
        return self.embed_tokens(input_ids)

    def attach_lora(self, slots) -> None:
        """Point each LoRA-capable projection at its slot table (`adapters/slots.py`)."""
        for layer, projections in zip(self.layers, slots.layers):
            for fused, table in projections.items():
                block = layer.self_attn if hasattr(layer.self_attn, fused) else layer.mlp
                getattr(block, fused).lora = table

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: the sampler widens them only where it needs float32."""
        return self.lm_head(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden).float()

    @torch.no_grad()
    def load_weights(self, folder: str | Path, tensors: dict[str, torch.Tensor] | None = None) -> None:
        tensors = _read_safetensors(Path(folder)) if tensors is None else tensors
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, value: torch.Tensor) -> None:
            param = params[name]
            if param.shape != value.shape:
                raise ValueError(f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
            param.copy_(value)
            loaded.add(name)

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"weight {name} missing from {folder}")
            return tensors.pop(name)

        put("embed_tokens.weight", take("model.embed_tokens.weight"))
        put("norm.weight", take("model.norm.weight"))
        if not self.config.tie_word_embeddings:
            put("lm_head.weight", take("lm_head.weight"))
        for i in range(self.config.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            for norm in ("input_layernorm", "post_attention_layernorm"):
                put(dst + norm + ".weight", take(src + norm + ".weight"))
            for fused, parts in FUSED_PROJECTIONS.items():
                block = "self_attn." if fused in ("qkv_proj", "o_proj") else "mlp."
                put(dst + block + fused + ".weight", torch.cat([take(src + block + p + ".weight") for p in parts]))
                if fused == "qkv_proj" and self.config.qkv_bias:
                    put(dst + block + fused + ".bias", torch.cat([take(src + block + p + ".bias") for p in parts]))
        tensors.pop("lm_head.weight", None)  # tied checkpoints may still carry a copy
        leftovers = [k for k in tensors if not k.endswith("rotary_emb.inv_freq")]
        if leftovers:
            raise ValueError(f"unexpected weights in {folder}: {leftovers[:5]}")
        missing = set(params) - loaded - ({"lm_head.weight"} if self.config.tie_word_embeddings else set())
        if missing:
            raise ValueError(f"weights not loaded: {sorted(missing)[:5]}")


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {folder}")
    tensors = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def load_model(folder: str | Path, config: ModelConfig, kernels: KernelConfig, max_len: int,
               gguf: Path | None = None, device: torch.device = torch.device("cpu")) -> LlamaForCausalLM:
    """The model in `kernels.dtype` on `device`, each linear layer's weight processed into its format."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_len, kernels)
    model = model.to_empty(device=device)
    model.rope = RotaryEmbedding(config, max_len).to(device)  # buffers are computed, not loaded
    tensors = _read_safetensors(Path(folder))
    blocks = read_prequantized(tensors, config) if config.prequantized else None  # GPTQ / AWQ: bits kept
    if blocks is not None and kernels.quantization != "q4":
        raise ValueError(f"{Path(folder).name} is a {config.prequantized[0]} 4-bit checkpoint: serve it with "
                         f"quantization q4 (its bits as they are), not {kernels.quantization}")
    model.load_weights(folder, tensors)
    model.tie_weights()
    # never trained here: without this, a matmul outside inference_mode on an unpacked weight
    # (prompt logprobs in bfloat16 on CPU, anything on CUDA) fails on the step's inference tensors
    model = model.eval().requires_grad_(False)
    if kernels.quantization != "none":  # from the float32 weights: GGUF bits checked / quantized before any rounding
        quantize_model(model, kernels.quantization, gguf, blocks)
    model = model.to(kernels.dtype)
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading()
    if config.tie_word_embeddings and tile_table_into_head(kernels, model.lm_head, model.embed_tokens.weight):
        model.embed_tokens.weight = None
    return model
