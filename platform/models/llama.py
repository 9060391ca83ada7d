"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

q/k/v and gate/up are fused into one matmul each; weights load straight from safetensors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from loraplex.kernels import cpu_kernels
from loraplex.kernels.dispatch import use_cpu_kernel
from loraplex.kernels.paged_attention import PagedAttentionMetadata, paged_attention, write_kv
from loraplex.kernels.quant import dequantize
from loraplex.kernels.sgmv import LoRABatch
from loraplex.platform.config import ModelConfig
from loraplex.platform.models import FUSED_PROJECTIONS
from loraplex.platform.models.linear import PackedLinear, amx_packs, can_pack
from loraplex.platform.models.quantized import quantize_model, read_prequantized
from loraplex.platform.models.lora_linear import LoRAContext, LoRALinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); with `residual`: (RMSNorm(residual + x), residual + x), the sum written into
        `residual` (vLLM's fused add: the layer's residual add and the next norm in one pass)."""
        if use_cpu_kernel(x) and cpu_kernels.usable(x, self.weight, dtypes=cpu_kernels.LAYER_DTYPES) and \
                x.dtype == self.weight.dtype and (residual is None or residual.dtype == x.dtype and residual.is_contiguous()):
            out = cpu_kernels.add_rms_norm_c(x, self.weight, self.eps, residual)  # one call, not 2-8 ops
            return out if residual is None else (out, residual)
        if residual is not None:
            x = residual = residual + x
        out = self._norm(x)
        return out if residual is None else (out, residual)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one op, same numbers as below
        # float32 statistics, as the reference implementation does
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, lora: LoRAContext) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = LoRALinear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, lora)
        self.o_proj = LoRALinear(self.q_size, config.hidden_size, False, lora)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_cache, meta: PagedAttentionMetadata):
        qkv = self.qkv_proj(x)
        k_cache, v_cache = kv_cache
        if use_cpu_kernel(qkv) and cpu_kernels.usable_rope_kv(qkv, rope[0], k_cache, v_cache):
            # RoPE, the KV write and q's copy in one call instead of about ten ops
            q = cpu_kernels.rope_write_kv_c(qkv, *rope, self.num_heads, self.num_kv_heads, meta.slot_mapping,
                                            k_cache, v_cache)
        else:
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            # q and k rotate together: one pass over both instead of one each
            qk = apply_rope(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim), *rope)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            write_kv(k, v.view(-1, self.num_kv_heads, self.head_dim), k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, lora: LoRAContext) -> None:
        super().__init__()
        self.gate_up_proj = LoRALinear(config.hidden_size, 2 * config.intermediate_size, False, lora)
        self.down_proj = LoRALinear(config.intermediate_size, config.hidden_size, False, lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if use_cpu_kernel(gate_up) and cpu_kernels.usable(gate_up, dtypes=cpu_kernels.LAYER_DTYPES):
            return self.down_proj(cpu_kernels.silu_mul_c(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, lora: LoRAContext) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, lora)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, lora)

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
    def __init__(self, config: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.config = config
        self.lora_context = LoRAContext()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, self.lora_context) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config, max_len)
        self.lm_head = PackedLinear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

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
        if self.embed_tokens.weight is None:  # tied, and packed for the AMX kernel: no second copy of the table
            return cpu_kernels.rows_bf16_amx(self.lm_head.amx_packed, input_ids)
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


def load_model(folder: str | Path, config: ModelConfig, dtype: torch.dtype, max_len: int,
               pack_weights: bool = True, quantization: str = "none", gguf: Path | None = None,
               device: torch.device = torch.device("cpu")) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_len)
    model = model.to_empty(device=device)
    model.rope = RotaryEmbedding(config, max_len).to(device)  # buffers are computed, not loaded
    tensors = _read_safetensors(Path(folder))
    blocks = read_prequantized(tensors, config) if config.prequantized else None  # GPTQ / AWQ: bits kept
    if blocks is not None and quantization != "q4":
        raise ValueError(f"{Path(folder).name} is a {config.prequantized[0]} 4-bit checkpoint: serve it with "
                         f"quantization q4 (its bits as they are), not {quantization}")
    model.load_weights(folder, tensors)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # never trained here: without this, a matmul outside inference_mode on an unpacked weight
    # (prompt logprobs in bfloat16 on CPU, anything on CUDA) fails on the step's inference tensors
    model = model.eval().requires_grad_(False)
    if quantization != "none":  # from the float32 weights: GGUF bits checked / quantized before any bf16 rounding
        quantize_model(model, quantization, gguf, blocks)
    model = model.to(dtype)
    if pack_weights and device.type == "cpu":
        if quantization == "none" and can_pack(dtype):
            for module in model.modules():
                if isinstance(module, PackedLinear):
                    module.pack(keep_weight=module is model.lm_head and config.tie_word_embeddings)
        share_table_through_head_tiles(model)
    return model


def share_table_through_head_tiles(model: LlamaForCausalLM) -> None:
    """A tied table the head holds as AMX tiles is read from them (`embed`) and its plain copy dropped. A
    quantized (8-bit) head gets those tiles only where the table is exactly its values (the GGUF's Q8_0 blocks):
    then they take the head's calls of 3+ tokens, 2x faster than dequantizing its rows per call, and replace
    the table at no cost in memory (BENCHMARKS.md, "q4 in bf16 on AMX")."""
    head, table = model.lm_head, model.embed_tokens.weight
    if not model.config.tie_word_embeddings or not amx_packs(table):
        return
    if head.quantized is not None:
        if not torch.equal(dequantize(head.quantized).to(table.dtype), table):
            return  # quantized at load: the head's numbers are not the table's
        head.amx_packed = cpu_kernels.pack_bf16_amx(table.detach())
    if head.amx_packed is None:
        return
    head.weight = None
    model.embed_tokens.weight = None
