"""Llama-family decoder over a paged KV cache: Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, Granite (what
each family changes is a `ModelConfig` field: docs/families.md).

q/k/v and gate/up are fused into one matmul each; weights load straight from safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from loraplex.kernels.dispatch import KernelConfig
from loraplex.kernels.linear_methods import tile_table_into_head
from loraplex.kernels.paged_attention import PagedAttentionMetadata
from loraplex.kernels.sgmv import LoRABatch
from loraplex.platform.config import ModelConfig
from loraplex.platform.models import fused_projections
from loraplex.kernels.custom_ops import PagedAttention, RMSNorm, RopeKVWrite, SiluAndMul
from loraplex.platform.models.linear import Linear
from loraplex.platform.models.lora_embedding import LoRAEmbedding, LoRAHead, attach_vocab_adapters
from loraplex.platform.models.lora_linear import LoRAContext, LoRALinear
from loraplex.platform.models.moe import SparseMoEBlock, is_sparse_layer
from loraplex.platform.models.quantized import head_format, quantize_model, read_prequantized
from loraplex.platform.models.rope import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, lora: LoRAContext, kernels: KernelConfig, index: int) -> None:
        super().__init__()
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.qkv_proj = LoRALinear(config.hidden_size, (heads + 2 * kv_heads) * head_dim, config.qkv_bias, lora,
                                   kernels, "qkv_proj")
        self.o_proj = LoRALinear(self.q_size, config.hidden_size, False, lora, kernels, "o_proj")
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, kernels)
        self.rope_kv_write = RopeKVWrite(heads, kv_heads, head_dim, kernels)
        self.attn = PagedAttention(config.attention_scale, kernels, sliding_window=config.layer_windows[index],
                                   prefill=kernels.prefill_attention,
                                   softcap=config.attn_logit_softcap)

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_cache, meta: PagedAttentionMetadata):
        k_cache, v_cache = kv_cache
        qkv = self.qkv_proj(x)
        if self.qk_norm:
            qkv = self.norm_heads(qkv)
        q = self.rope_kv_write(qkv, rope, k_cache, v_cache, meta)
        out = self.attn(q, k_cache, v_cache, meta)
        return self.o_proj(out.reshape(-1, self.q_size))

    def norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """Each q and k head RMS-normalized over head_dim (before RoPE, as Qwen3 and Gemma 3 do)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.contiguous().view(-1, self.num_heads, self.head_dim))  # the norm reads contiguous rows
        k = self.k_norm(k.contiguous().view(-1, self.num_kv_heads, self.head_dim))
        return torch.cat([q.flatten(1), k.flatten(1), v], dim=-1)


class GeluTanhAndMul(nn.Module):
    """[..., 2I] -> gelu(gate, tanh approximation) * up [..., I]: Gemma's GeGLU, in PyTorch ops."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def activation_and_mul(name: str, kernels: KernelConfig) -> nn.Module:
    """The MLP's gate activation times up, by transformers' activation name (ModelConfig checks it)."""
    return GeluTanhAndMul() if name == "gelu_pytorch_tanh" else SiluAndMul(kernels)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, lora: LoRAContext, kernels: KernelConfig) -> None:
        super().__init__()
        self.gate_up_proj = LoRALinear(config.hidden_size, 2 * config.intermediate_size, False, lora, kernels,
                                       "gate_up_proj")
        self.down_proj = LoRALinear(config.intermediate_size, config.hidden_size, False, lora, kernels, "down_proj")
        self.act = activation_and_mul(config.hidden_act, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, lora: LoRAContext, kernels: KernelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.self_attn = Attention(config, lora, kernels, index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_norms = config.post_norms
        if config.post_norms:  # Gemma: post_attention_layernorm normalizes the attention output itself
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.residual_multiplier = config.residual_multiplier
        self.mlp = SparseMoEBlock(config, kernels) if is_sparse_layer(config, index) else MLP(config, lora, kernels)

    def forward(self, x, residual, rope, kv_cache, meta):
        """-> (this layer's MLP output, the residual stream before adding it); the add happens in
        the next norm (fused with it)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, kv_cache, meta)
        if self.post_norms:
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(self.scaled(h), residual)
        return self.scaled(self.mlp(h)), residual

    def scaled(self, h: torch.Tensor) -> torch.Tensor:
        """A block's output as it joins the residual stream: times Granite's residual_multiplier."""
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_len: int, kernels: KernelConfig | None = None) -> None:
        super().__init__()
        kernels = kernels or KernelConfig()
        self.config, self.kernels = config, kernels
        self.lora_context = LoRAContext()
        self.embed_tokens = LoRAEmbedding(config.vocab_size, config.hidden_size, self.lora_context)
        self.layers = nn.ModuleList(DecoderLayer(config, self.lora_context, kernels, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.rope = RotaryEmbedding(config, max_len)
        self.embed_scale = float(torch.tensor(config.embedding_multiplier, device="cpu").to(kernels.dtype))
        self.lm_head = LoRAHead(config.hidden_size, config.vocab_size, False, kernels, head_format(kernels.quantization))
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
            x, residual = self.scale_embeddings(self.embed(input_ids)), None
            ropes = self.rope.at(positions, x.dtype)
            for layer, kv_cache, rope in zip(self.layers, kv_caches, ropes):
                x, residual = layer(x, residual, rope, kv_cache, meta)
            return self.norm(x, residual)[0]
        finally:
            self.lora_context.batch = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> their rows of the embedding table (each token's adapter's own where it has one)."""
        if self.embed_tokens.weight is None:  # tied, and held once in the head's weight format
            return self.embed_tokens.adapt(input_ids, self.lm_head.method.rows(self.lm_head, input_ids))
        return self.embed_tokens(input_ids)

    def scale_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        """Gemma's sqrt(hidden) and Granite's embedding_multiplier (rounded to the model's dtype in `__init__`,
        as transformers' Gemma rounds it), on the embedding's output: adapters' rows and deltas included, as
        transformers does for Granite and peft for Gemma's scaled embedding."""
        return x if self.embed_scale == 1.0 else x * self.embed_scale

    def attach_lora(self, slots) -> None:
        """Point each LoRA-capable projection, the embedding and the head at their slot tables
        (`adapters/slots.py`)."""
        for layer, projections in zip(self.layers, slots.layers):
            for fused, table in projections.items():
                block = layer.self_attn if hasattr(layer.self_attn, fused) else layer.mlp
                if hasattr(block, fused):  # a MoE layer has no dense MLP (adapters on its experts are refused)
                    getattr(block, fused).lora = table
        attach_vocab_adapters(self.embed_tokens, self.lm_head, slots, self.config.tie_word_embeddings,
                              self.kernels.dtype)

    def logits(self, hidden: torch.Tensor, slots: list[int] | None = None) -> torch.Tensor:
        """In the model's dtype: the sampler widens them only where it needs float32. `slots`: each row's
        adapter slot (-1: none), for adapters that change the head; None: the base head for every row."""
        return self.shape_logits(self.lm_head(hidden, slots))

    def shape_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Granite's logits_scaling (a division) and Gemma's final soft cap c tanh(logits / c)."""
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def compute_logits(self, hidden: torch.Tensor, slots: list[int] | None = None) -> torch.Tensor:
        return self.logits(hidden, slots).float()

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
            for norm, module in self.layers[i].named_modules():  # the layer's norms, q/k norms included
                if isinstance(module, RMSNorm):
                    put(dst + norm + ".weight", take(src + norm + ".weight"))
            for fused, parts in fused_projections(self.config.architecture).items():
                block = "self_attn." if fused in ("qkv_proj", "o_proj") else "mlp."
                if block == "mlp." and isinstance(self.layers[i].mlp, SparseMoEBlock):
                    continue  # the block reads its own names below
                put(dst + block + fused + ".weight", torch.cat([take(src + block + p + ".weight") for p in parts]))
                if fused == "qkv_proj" and self.config.qkv_bias:
                    put(dst + block + fused + ".bias", torch.cat([take(src + block + p + ".bias") for p in parts]))
            if isinstance(self.layers[i].mlp, SparseMoEBlock):  # router, experts, shared expert
                self.layers[i].mlp.load_weights(take, src)
                loaded.update(dst + "mlp." + name for name, _ in self.layers[i].mlp.named_parameters())
        tensors.pop("lm_head.weight", None)  # tied checkpoints may still carry a copy
        leftovers = [k for k in tensors if not k.endswith("rotary_emb.inv_freq")]
        if leftovers:
            raise ValueError(f"unexpected weights in {folder}: {leftovers[:5]}")
        missing = set(params) - loaded - ({"lm_head.weight"} if self.config.tie_word_embeddings else set())
        if missing:
            raise ValueError(f"weights not loaded: {sorted(missing)[:5]}")
        if self.config.norm_offset:  # Gemma's norms multiply by (1 + w): the 1 added once, here
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight += self.config.norm_offset


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
    """The model in `kernels.dtype` on `device`, each linear layer's weight processed into its format. Built in
    that dtype on that device, each checkpoint tensor converted as it is copied in: a float32 model converted
    after would hold twice the weights (an 8B model: 32 GB to load into 16). Quantization reads float32 weights
    (GGUF bits checked, or quantized before any rounding), so that path builds in float32 on the CPU, the only
    device it runs on, and converts after."""
    float_first = kernels.quantization != "none"
    dtype = torch.float32 if float_first else kernels.dtype
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_len, kernels)
    model = model.to(dtype).to_empty(device=device)  # on meta the dtype costs nothing
    model.rope = RotaryEmbedding(config, max_len).to(device=device, dtype=dtype)  # computed, not loaded
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
    if float_first:
        quantize_model(model, kernels.quantization, gguf, blocks)
        model = model.to(kernels.dtype)
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading()
    if config.tie_word_embeddings and tile_table_into_head(kernels, model.lm_head, model.embed_tokens.weight):
        model.embed_tokens.weight = None
    return model
