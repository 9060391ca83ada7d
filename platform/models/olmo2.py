"""OLMo 2's decoder layer (its declaration: `families.py`): the shared decoder's projections and MLP, in its own layer. Each block's output is normalized
before it joins the residual stream (post-attention and post-MLP norms, no norm before either), and q and k are
RMS-normalized over the whole projection (every head together) before RoPE, as transformers' Olmo2 does."""

from __future__ import annotations

import functools

import torch
from torch import nn

from loraplex.kernels.custom_ops import RMSNorm
from loraplex.kernels.dispatch import KernelConfig
from loraplex.platform.distributed import all_gather_rows
from loraplex.platform.models.llama import MLP, Attention
from loraplex.platform.models.model_config import ModelConfig


class Olmo2Attention(Attention):
    """Under tensor parallelism a rank holds some heads: q and k are gathered whole for their norms (the full
    weights, replicated), and each rank keeps its own heads after."""

    def __init__(self, config: ModelConfig, kernels: KernelConfig, index: int) -> None:
        super().__init__(config, kernels, index)
        self.qk_norm, plan = True, config.shard
        d = self.head_dim
        self.q_norm = RMSNorm(plan.num_heads * d if plan else self.q_size, config.rms_norm_eps, kernels)
        self.k_norm = RMSNorm(plan.num_kv_heads * d if plan else self.kv_size, config.rms_norm_eps, kernels)
        self.whole = (lambda x, part: x) if plan is None else functools.partial(_whole_heads, plan=plan, head_dim=d)
        self.own = (lambda x, part: x) if plan is None else functools.partial(_own_heads, plan=plan, head_dim=d)

    def norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """q and k each normalized over all their heads at once."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.own(self.q_norm(self.whole(q.contiguous(), "q_heads")), "q_heads")
        k = self.own(self.k_norm(self.whole(k.contiguous(), "kv_heads")), "kv_heads")
        return torch.cat([q, k, v], dim=-1)


def _whole_heads(x: torch.Tensor, part: str, plan, head_dim: int) -> torch.Tensor:
    """Every rank's heads of `part` gathered into the full projection, in head order (a head replicated on
    several ranks taken once)."""
    runs = plan.every_rank(part)
    gathered = all_gather_rows(x, [(end - first) * head_dim for first, end in runs])
    pieces, offset, done = [], 0, 0
    for first, end in runs:
        width = (end - first) * head_dim
        if end > done:
            pieces.append(gathered[:, offset + (max(first, done) - first) * head_dim:offset + width])
            done = end
        offset += width
    return torch.cat(pieces, dim=-1)


def _own_heads(x: torch.Tensor, part: str, plan, head_dim: int) -> torch.Tensor:
    first, end = getattr(plan, part)
    return x[:, first * head_dim:end * head_dim].contiguous()


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

