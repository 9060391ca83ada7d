"""Fused ops as modules that pick their implementation once, in `__init__`, from the model's `KernelConfig`
(vLLM's `CustomOp`): `forward_native` (PyTorch ops), `forward_cpu` (our C kernels, where they take the
model's dtypes) and `forward_cuda` (Triton: `layer_triton.py`, one launch per op). The model files
(`platform/models/`) build these and name no kernel."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels import cpu_kernels
from loraplex.kernels.dispatch import Backend, KernelConfig, PrefillAttention
from loraplex.kernels.paged_attention import PagedAttentionMetadata, attention_kernel, write_kv_reference
from loraplex.kernels.sgmv import lora_kernel

LAYER_DTYPES = (torch.float32, torch.bfloat16)  # what the C layer ops read and write


POINTWISE_CHUNK = 1 << 14  # elements per call of `pointwise_op` under --deterministic on CPU


def pointwise_op(config: KernelConfig, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """`fn` (a transcendental elementwise op: tanh, sigmoid, gelu) as it runs for `config`. Torch's CPU loops
    compute whole vectors with one routine and the elements past the last whole vector (of the tensor, or of a
    thread's share) with another, and the two differ in the last bit: which elements fall there depends on the
    tensor's size, so on the batch. Under --deterministic on CPU, `fn` runs on fixed chunks of POINTWISE_CHUNK
    elements (under torch's parallel grain: one thread, whole vectors only), the last one padded."""
    if not (config.deterministic and config.device_type == "cpu"):
        return fn
    return functools.partial(_in_chunks, fn)


def _in_chunks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1)
    n = flat.numel()
    if n == 0:
        return fn(x)
    padded = F.pad(flat, (0, -n % POINTWISE_CHUNK))
    return torch.cat([fn(chunk) for chunk in padded.split(POINTWISE_CHUNK)])[:n].view(x.shape)


def layer_triton_kernel(name: str) -> Callable:
    """A kernel of `layer_triton.py`, imported when an op is built for the Triton backend: Triton stays
    optional on CPU installs (as `attention_kernel` imports its kernel)."""
    from loraplex.kernels import layer_triton

    return getattr(layer_triton, name)


class CustomOp(nn.Module):
    """`TRITON_KERNEL`: the name of the op's kernel in `layer_triton.py`, bound as `self.kernel` on the Triton
    backend (its rows are independent: batch-invariant, --deterministic included)."""

    TRITON_KERNEL = ""

    def __init__(self, config: KernelConfig) -> None:
        super().__init__()
        if config.backend == Backend.CPU and self.cpu_kernel_takes(config):
            self.forward = self.forward_cpu
        elif config.backend == Backend.TRITON:
            self.kernel = layer_triton_kernel(self.TRITON_KERNEL)
            self.forward = self.forward_cuda
        else:
            self.forward = self.forward_native

    def cpu_kernel_takes(self, config: KernelConfig) -> bool:
        return config.dtype in LAYER_DTYPES


class RMSNorm(CustomOp):
    """RMSNorm(x); with `residual`: (RMSNorm(residual + x), residual + x), the sum written into `residual`
    (vLLM's fused add: the layer's residual add and the next norm in one pass)."""

    TRITON_KERNEL = "rms_norm_triton"

    def __init__(self, dim: int, eps: float, config: KernelConfig) -> None:
        super().__init__(config)
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out = self.kernel(x, self.weight, self.eps, residual)
        return out if residual is None else (out, residual)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out = cpu_kernels.add_rms_norm_c(x, self.weight, self.eps, residual)
        return out if residual is None else (out, residual)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = residual = residual + x
        out = self._norm(x)
        return out if residual is None else (out, residual)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one op, same numbers as below
        h = x.float()  # float32 statistics, as the reference implementation does
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class SiluAndMul(CustomOp):
    """[..., 2I] -> silu(gate) * up [..., I]."""

    TRITON_KERNEL = "act_and_mul_triton"

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.silu_mul_c(gate_up)

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cuda(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernel(gate_up, gelu=False)


class GeluTanhAndMul(CustomOp):
    """[..., 2I] -> gelu(gate, tanh approximation) * up [..., I]: Gemma's GeGLU (no C kernel: PyTorch ops on
    CPU, through `pointwise_op` under --deterministic)."""

    TRITON_KERNEL = "act_and_mul_triton"

    def __init__(self, config: KernelConfig) -> None:
        super().__init__(config)
        self.gelu = pointwise_op(config, functools.partial(F.gelu, approximate="tanh"))

    def cpu_kernel_takes(self, config: KernelConfig) -> bool:
        return False

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.gelu(gate) * up

    def forward_cuda(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernel(gate_up, gelu=True)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class RopeKVWrite(CustomOp):
    """The fused qkv rows [T, (Hq + 2 Hkv) D] -> rotated q [T, Hq, D]; rotated k and v written into the caches
    at the step's slot mapping."""

    TRITON_KERNEL = "rope_kv_write_triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, config: KernelConfig) -> None:
        super().__init__(config)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def cpu_kernel_takes(self, config: KernelConfig) -> bool:
        """The model's kind in the caches, float16 caches under a float32 model where F16C converts, or float8
        e4m3 caches under either."""
        kv, dtype = config.kv_dtype, config.dtype
        return dtype in LAYER_DTYPES and (kv in (dtype, torch.float8_e4m3fn) or
                                          dtype == torch.float32 and kv == torch.float16 and config.caps.f16c)

    def forward_cpu(self, qkv, rope, k_cache, v_cache, meta: PagedAttentionMetadata) -> torch.Tensor:
        return cpu_kernels.rope_write_kv_c(qkv, *rope, self.num_heads, self.num_kv_heads, meta.slot_mapping,
                                           k_cache, v_cache)

    def forward_native(self, qkv, rope, k_cache, v_cache, meta: PagedAttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
        # q and k rotate together: one pass over both instead of one each
        qk = apply_rope(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim), *rope)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        write_kv_reference(k, v.view(-1, self.num_kv_heads, self.head_dim), k_cache, v_cache, meta.slot_mapping)
        return q

    def forward_cuda(self, qkv, rope, k_cache, v_cache, meta: PagedAttentionMetadata) -> torch.Tensor:
        return self.kernel(qkv, *rope, self.num_heads, self.num_kv_heads, meta.slot_mapping, k_cache, v_cache)


# auto's pick: the paged kernel until benchmarks/gpu_check.py ("prefill attention") measures SDPA faster
PREFILL_AUTO = PrefillAttention.TRITON


class PagedAttention(nn.Module):
    """Attention of each query token over its request's paged context (`kernels/paged_attention.py` chooses
    the kernel once from the config). `sliding_window` W: a key at position k is visible to a query at q iff
    k <= q and q - k < W (None: every k <= q); `softcap` c: the scaled scores become c tanh(s / c) before
    masking (Gemma 2). Both are bound into the kernel here, so a layer without them runs the plain one.

    `prefill` (a `PrefillAttention`, chosen once at engine build): on the Triton backend, "sdpa" sends steps
    whose requests are all first chunks without a prefix hit to torch SDPA (`is_causal`, no mask: its flash
    backend), everything else to the paged kernel. SDPA cannot cap scores nor slide a window: such a layer
    keeps the paged kernel."""

    def __init__(self, scale: float, config: KernelConfig, sliding_window: int | None = None,
                 softcap: float | None = None, prefill: PrefillAttention = PrefillAttention.TRITON) -> None:
        super().__init__()
        self.scale = scale
        self.sliding_window, self.softcap = sliding_window, softcap
        self.kernel = attention_kernel(config, sliding_window, softcap)
        if sdpa_prefill_applies(config, prefill, sliding_window, softcap):
            self.forward = self.forward_cuda

    def forward(self, q, k_cache, v_cache, meta: PagedAttentionMetadata) -> torch.Tensor:
        return self.kernel(q, k_cache, v_cache, meta, self.scale)

    def forward_cuda(self, q, k_cache, v_cache, meta: PagedAttentionMetadata) -> torch.Tensor:
        """SDPA for a step of fresh prompts of one length (told by host-side numbers only: no sync), else the
        paged kernel."""
        if fresh_prompts(q, meta):
            return sdpa_prefill(q, k_cache, v_cache, meta, self.scale)
        return self.kernel(q, k_cache, v_cache, meta, self.scale)


def sdpa_prefill_applies(config: KernelConfig, prefill: PrefillAttention, sliding_window: int | None,
                         softcap: float | None) -> bool:
    """Whether a layer takes the SDPA prefill path; decided once when it is built."""
    if prefill not in list(PrefillAttention):
        raise ValueError(f"prefill attention must be one of {', '.join(PrefillAttention)}, got {prefill!r}")
    chosen = PREFILL_AUTO if prefill == PrefillAttention.AUTO else prefill
    if chosen == PrefillAttention.TRITON or config.backend != Backend.TRITON or config.deterministic:
        return False
    # SDPA takes no window without a mask and caps no scores: such layers (Gemma 2) keep the paged kernel
    return sliding_window is None and softcap is None


def fresh_prompts(q: torch.Tensor, meta: PagedAttentionMetadata) -> bool:
    """Every request of the step is a first chunk without cached context, all of one length: with each query
    length at most the maximum, T = B * max_query_len makes them all equal to it, and max_seq_len equal to it
    leaves no room for cached tokens. Decode steps (one query each) never take it: graphs capture those."""
    num_requests = meta.query_start_loc.shape[0] - 1
    return meta.max_query_len > 1 and meta.max_seq_len == meta.max_query_len and \
        q.shape[0] == num_requests * meta.max_query_len


def sdpa_prefill(q, k_cache, v_cache, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """Causal SDPA of fresh prompts of one length L on their own K/V, gathered contiguous from the blocks they
    were just written to. q [B * L, Hq, D] -> [B * L, Hq, D]."""
    num_requests, length = meta.query_start_loc.shape[0] - 1, meta.max_query_len
    num_blocks = -(-length // meta.block_size)
    tables = meta.block_tables[:, :num_blocks]
    keys = k_cache[tables].flatten(1, 2)[:, :length].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
    values = v_cache[tables].flatten(1, 2)[:, :length].transpose(1, 2).to(q.dtype)
    queries = q.view(num_requests, length, *q.shape[1:]).transpose(1, 2)  # [B, Hq, L, D]
    out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale,
                                         enable_gqa=queries.shape[1] != keys.shape[1])
    return out.transpose(1, 2).reshape(q.shape)


class LoRADelta:
    """y += each token's adapter delta, through the multi-LoRA kernel chosen once for the config."""

    def __init__(self, config: KernelConfig) -> None:
        self.kernel = lora_kernel(config)

    def __call__(self, x, slots, batch, y) -> torch.Tensor:
        return self.kernel(x, slots, batch, y)
