"""Paged attention: KV write at a slot mapping and attention over block tables.

This file holds the PyTorch reference (the KV write's too: on the Triton backend the write is fused into RoPE,
`layer_triton.py`) and the choice a model makes once (`attention_kernel`): the Triton kernel
(`paged_attention_triton.py`) on CUDA; on CPU, requests with short query chunks
(decode, jump-forward) take the C kernel (`cpu_kernels.py`), which reads blocks in place, and
prefill chunks take the reference, whose SDPA wins there. The reference gathers each request's
blocks into a padded [batch, context] view and runs one SDPA call with a lower-right causal
mask (a chunk of queries sees the cached context plus itself; `is_causal=True` would be
top-left aligned, wrong whenever the query is shorter than the keys).

A layer may have a sliding window W (a key at position k is visible to a query at q iff k <= q and
q - k < W, transformers' sliding-window mask) and a soft cap c (scaled scores become c tanh(s / c)
before masking, as Gemma 2). Every kernel starts its walk at the window, so blocks before it, which the
KV manager frees, are never read; both are bound into the kernel a layer picks once (`attention_kernel`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_kernels
from loraplex.kernels.autotune import TuneTable
from loraplex.kernels.dispatch import Backend, KernelConfig

# Query chunks up to this length take the C kernel on CPU; longer ones (prefill) the gathered SDPA, which
# runs the many-query case as blocked GEMMs (a model reads it from its `TuneTable`).
CPU_KERNEL_MAX_QUERY_LEN = TuneTable.attention_kernel_query_len
DETERMINISTIC_QUERY_LEN = 1 << 62  # --deterministic on CPU: every query chunk takes the C kernel


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) per token; -1 skips
    block_tables: torch.Tensor  # [B, max_blocks] int, padded with 0
    seq_lens: torch.Tensor  # [B] context length after this step (cached + new tokens)
    query_start_loc: torch.Tensor  # [B + 1] offsets of each request's tokens in the flat batch
    max_query_len: int
    max_seq_len: int
    block_size: int
    _reference: dict | None = None  # window -> view, derived once per step for the PyTorch path, shared by layers
    _cpu_parts: tuple | None = None  # derived once per step for the CPU dispatch

    @staticmethod
    def build(slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              query_start_loc: torch.Tensor, block_size: int, max_query_len: int | None = None,
              max_seq_len: int | None = None) -> "PagedAttentionMetadata":
        """The maxima are read from the tensors unless given (the runner knows them on the host:
        reading them from a device tensor would wait for the device)."""
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        return PagedAttentionMetadata(slot_mapping, block_tables, seq_lens, query_start_loc, max_query_len,
                                      max_seq_len, block_size)

    def reference_view(self, window: int | None = None) -> tuple:
        """(query_batch, query_pos, attn_mask, used block tables) for the PyTorch path, under a sliding
        window or none; one per window and step, shared by the layers that have it."""
        views = self._reference if self._reference is not None else {}
        self._reference = views
        if window not in views:
            views[window] = self._view(window)
        return views[window]

    def _view(self, window: int | None) -> tuple:
        starts = self.query_start_loc
        query_lens = starts[1:] - starts[:-1]
        num_tokens = int(starts[-1])
        query_batch = torch.repeat_interleave(torch.arange(len(query_lens), device=starts.device), query_lens,
                                              output_size=num_tokens)
        query_pos = torch.arange(num_tokens, device=starts.device) - starts[:-1][query_batch]
        q_abs = (self.seq_lens - query_lens)[:, None] + torch.arange(self.max_query_len, device=starts.device)
        if window is not None:
            return (query_batch, query_pos, *self._window_view(q_abs, query_lens, window))
        num_blocks = -(-self.max_seq_len // self.block_size)
        kv_pos = torch.arange(num_blocks * self.block_size, device=starts.device)
        mask = kv_pos[None, None, :] <= q_abs[:, :, None]
        return query_batch, query_pos, mask[:, None], self.block_tables[:, :num_blocks]

    def _window_view(self, q_abs: torch.Tensor, query_lens: torch.Tensor, window: int) -> tuple:
        """(mask, tables) over each request's own blocks from the one holding the first position its first query
        sees: blocks before the window (freed, their table entries the padding id) are not gathered. The width
        bounds every request's span on the host (query chunk + window, plus a block of misalignment)."""
        bs = self.block_size
        width = min(-(-self.max_seq_len // bs), -(-(self.max_query_len + window - 1) // bs) + 1)
        first = (self.seq_lens - query_lens - window + 1).clamp(min=0) // bs  # [B]
        steps = torch.arange(width, device=first.device)
        index = (first[:, None] + steps).clamp(max=self.block_tables.shape[1] - 1)  # past the table: masked
        kv_pos = first[:, None] * bs + torch.arange(width * bs, device=first.device)  # [B, L] absolute
        distance = q_abs[:, :, None] - kv_pos[:, None, :]  # [B, Q, L]
        mask = (distance >= 0) & (distance < window)
        return mask[:, None], self.block_tables.gather(1, index)

    def cpu_parts(self, max_short: int = CPU_KERNEL_MAX_QUERY_LEN) -> tuple["RequestPart | None", "RequestPart | None"]:
        """(requests of at most `max_short` query tokens, the others) for the CPU kernels; None when empty.
        Derived once per step: every layer passes the same `max_short`."""
        if self._cpu_parts is None:
            query_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
            short = query_lens <= max_short
            self._cpu_parts = (self._part(torch.nonzero(short).flatten()),
                               self._part(torch.nonzero(~short).flatten()))
        return self._cpu_parts

    def _part(self, requests: torch.Tensor) -> "RequestPart | None":
        if len(requests) == 0:
            return None
        starts, ends = self.query_start_loc[requests], self.query_start_loc[requests + 1]
        lens = ends - starts
        num_tokens = int(lens.sum())
        everything = len(requests) == len(self.seq_lens)
        token_request = torch.repeat_interleave(torch.arange(len(requests), device=lens.device), lens,
                                                output_size=num_tokens)
        rows = None if everything else starts[token_request] + (
            torch.arange(num_tokens, device=lens.device) - torch.cumsum(lens, 0)[token_request] + lens[token_request])
        meta = self if everything else PagedAttentionMetadata.build(
            self.slot_mapping.new_empty(0), self.block_tables[requests], self.seq_lens[requests],
            torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)]), self.block_size)
        return RequestPart(rows, meta, token_request)


@dataclass
class RequestPart:
    """Some requests of a step's batch: their token rows in the flat batch (None: all of them),
    their own metadata, and each of their tokens' request index within the part."""

    rows: torch.Tensor | None
    meta: PagedAttentionMetadata
    token_request: torch.Tensor


def write_kv_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at slot_mapping."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    # a float16 / float8 KV cache stores rounded copies (float8: torch's rounding, saturating at +-448;
    # torch has no index_copy_ for float8, so its bytes are copied)
    for src, cache in ((key, k_cache), (value, v_cache)):
        rows, src = cache.view(-1, *cache.shape[2:]), src.to(cache.dtype)
        if cache.dtype == torch.float8_e4m3fn:
            rows, src = rows.view(torch.uint8), src.view(torch.uint8)
        rows.index_copy_(0, slot_mapping, src)


def paged_attention_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: PagedAttentionMetadata, scale: float, sliding_window: int | None = None,
                              softcap: float | None = None) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D], attending to each request's paged context (the last `sliding_window`
    positions of it when given; scores soft-capped at `softcap` when given)."""
    num_tokens, num_heads, head_dim = query.shape
    query_batch, query_pos, mask, tables = meta.reference_view(sliding_window)
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2).to(query.dtype)  # [B, Hkv, L, D]
    values = v_cache[tables].flatten(1, 2).transpose(1, 2).to(query.dtype)
    if meta.max_query_len == 1:
        q = query[:, :, None, :]  # one query per request: already [B, Hq, 1, D]
    else:
        q = query.new_zeros(tables.shape[0], meta.max_query_len, num_heads, head_dim)
        q[query_batch, query_pos] = query
        q = q.transpose(1, 2)
    if softcap is None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=num_heads != keys.shape[1])
    else:
        out = softcapped_attention(q, keys, values, mask, scale, softcap)
    if meta.max_query_len == 1:
        return out[:, :, 0, :]
    return out.transpose(1, 2)[query_batch, query_pos]


def softcapped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                         scale: float, softcap: float) -> torch.Tensor:
    """SDPA with the scaled scores capped before masking (SDPA itself cannot), as transformers' Gemma 2 eager
    attention: softmax in float32, weights in the query's dtype. q [B, Hq, Q, D], keys / values [B, Hkv, L, D],
    mask [B, 1, Q, L]."""
    batch, num_heads, num_queries, head_dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(batch, kv_heads, num_heads // kv_heads * num_queries, head_dim)  # query head h: kv h // G
    scores = grouped @ keys.transpose(-1, -2) * scale
    scores = (torch.tanh(scores / softcap) * softcap).view(batch, kv_heads, -1, num_queries, scores.shape[-1])
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return (weights @ values[:, :, None]).view(batch, num_heads, num_queries, head_dim)


@dataclass(frozen=True)
class AttentionBounds:
    """A layer's sliding window (None: its whole context) and soft cap on the scores (None: none), checked: a
    window of at least one position, a positive finite cap."""

    sliding_window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        window, cap = self.sliding_window, self.softcap
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {window!r}")
        if cap is not None and not (isinstance(cap, (int, float)) and 0 < cap < math.inf):
            raise ValueError(f"softcap must be a positive finite number or None, got {cap!r}")
        object.__setattr__(self, "softcap", None if cap is None else float(cap))


def attention_kernel(config: KernelConfig, sliding_window: int | None = None, softcap: float | None = None):
    """`(query, k_cache, v_cache, meta, scale) -> out` for a model's backend and dtypes, chosen once: Triton;
    on CPU the C kernel for short query chunks (where it reads the model's and the cache's dtypes) and the
    reference for the rest; else the reference. The layer's window and soft cap are bound in here."""
    bounds = AttentionBounds(sliding_window, softcap)
    if config.backend == Backend.TRITON:
        from loraplex.kernels.paged_attention_triton import paged_attention_triton, sm_count

        def triton(query, k_cache, v_cache, meta, scale):
            return paged_attention_triton(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                          meta.query_start_loc, meta.max_query_len, scale,
                                          sliding_window=bounds.sliding_window, softcap=bounds.softcap,
                                          max_seq_len=meta.max_seq_len, num_sms=sm_count(query.device),
                                          deterministic=config.deterministic)
        return triton
    if config.backend == Backend.CPU and config.dtype in (torch.float32, torch.bfloat16) and \
            c_kernel_reads_kv(config.kv_dtype, config.caps.f16c):
        # deterministic: every chunk through the C kernel, which walks a query's context in the same chunks
        # whatever was cached or computed with it (the reference's SDPA would sum prefill otherwise)
        max_short = DETERMINISTIC_QUERY_LEN if config.deterministic else config.tune.attention_kernel_query_len
        return lambda query, k_cache, v_cache, meta, scale: _paged_attention_cpu(query, k_cache, v_cache, meta,
                                                                                  scale, bounds, max_short)
    if bounds == AttentionBounds():
        return paged_attention_reference  # without a window or cap: the plain kernel itself
    return functools.partial(paged_attention_reference, sliding_window=bounds.sliding_window, softcap=bounds.softcap)


def c_kernel_reads_kv(kv_dtype: torch.dtype, f16c: bool) -> bool:
    """K/V caches the C attention kernel reads: float32, bfloat16, float8 e4m3, or float16 where F16C converts."""
    return kv_dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn) or kv_dtype == torch.float16 and f16c


def _paged_attention_cpu(query, k_cache, v_cache, meta: PagedAttentionMetadata, scale: float,
                         bounds: AttentionBounds = AttentionBounds(), max_short: int = CPU_KERNEL_MAX_QUERY_LEN
                         ) -> torch.Tensor:
    """Short-query requests through the C kernel, the others through the reference, both within `bounds`."""
    short, long = meta.cpu_parts(max_short)
    window, cap = bounds.sliding_window, bounds.softcap

    def c_kernel(q, part):
        return cpu_kernels.paged_attention_c(q, k_cache, v_cache, part.meta.block_tables, part.meta.seq_lens,
                                             part.meta.query_start_loc, part.token_request, scale,
                                             sliding_window=window, softcap=cap)

    def reference(q, part_meta):
        return paged_attention_reference(q, k_cache, v_cache, part_meta, scale, sliding_window=window, softcap=cap)

    if long is None:
        return c_kernel(query, short)
    if short is None:
        return reference(query, meta)
    out = torch.empty_like(query)
    out[short.rows] = c_kernel(query[short.rows], short)
    out[long.rows] = reference(query[long.rows], long.meta)
    return out
