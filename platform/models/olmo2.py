"""OLMo 2's decoder layer (its declaration: `families.py`): the shared decoder's projections and MLP, in its own layer. Each block's output is normalized
before it joins the residual stream (post-attention and post-MLP norms, no norm before either), and q and k are
RMS-normalized over the whole projection (every head together) before RoPE, as transformers' Olmo2 does."""

from __future__ import annotations

import torch
from torch import nn

from loraplex.kernels.custom_ops import RMSNorm
from loraplex.kernels.dispatch import KernelConfig
from loraplex.platform.config import ModelConfig
from loraplex.platform.models.llama import MLP, Attention


class Olmo2Attention(Attention):
    def __init__(self, config: ModelConfig, kernels: KernelConfig, index: int) -> None:
        super().__init__(config, kernels, index)
        self.qk_norm = True
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps, kernels)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps, kernels)

    def norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """q and k each normalized over all their heads at once."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return torch.cat([self.q_norm(q.contiguous()), self.k_norm(k.contiguous()), v], dim=-1)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: KernelConfig, index: int) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, kernels, index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.mlp = MLP(config, kernels)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)

    def forward(self, x, residual, rope, kv_cache, meta):
        """-> (this layer's normalized MLP output, the residual stream before adding it), as the shared decoder's
        layers return them (the model's final norm adds the last one)."""
        if residual is not None:
            x = x + residual
        x = x + self.post_attention_layernorm(self.self_attn(x, rope, kv_cache, meta))
        return self.post_feedforward_layernorm(self.mlp(x)), x

