"""Paged attention: KV write at a slot mapping and attention over block tables.

This file holds the PyTorch reference, which is also the CPU path, and the dispatch (Triton
kernels in `paged_attention_triton.py` for CUDA tensors). The reference gathers each request's
blocks into a padded [batch, context] view and runs one SDPA call with a lower-right causal
mask (a chunk of queries sees the cached context plus itself; `is_causal=True` would be
top-left aligned, wrong whenever the query is shorter than the keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.kernels.dispatch import use_triton


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) per token; -1 skips
    block_tables: torch.Tensor  # [B, max_blocks] int, padded with 0
    seq_lens: torch.Tensor  # [B] context length after this step (cached + new tokens)
    query_start_loc: torch.Tensor  # [B + 1] offsets of each request's tokens in the flat batch
    max_query_len: int
    max_seq_len: int
    block_size: int
    _reference: tuple | None = None  # derived once per step for the PyTorch path, shared by all layers

    @staticmethod
    def build(slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              query_start_loc: torch.Tensor, block_size: int) -> "PagedAttentionMetadata":
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        return PagedAttentionMetadata(slot_mapping, block_tables, seq_lens, query_start_loc,
                                      int(query_lens.max()), int(seq_lens.max()), block_size)

    def reference_view(self) -> tuple:
        """(query_batch, query_pos, attn_mask, used block tables) for the PyTorch path."""
        if self._reference is None:
            starts = self.query_start_loc
            query_lens = starts[1:] - starts[:-1]
            num_tokens = int(starts[-1])
            query_batch = torch.repeat_interleave(torch.arange(len(query_lens), device=starts.device), query_lens,
                                                  output_size=num_tokens)
            query_pos = torch.arange(num_tokens, device=starts.device) - starts[:-1][query_batch]
            num_blocks = -(-self.max_seq_len // self.block_size)
            kv_pos = torch.arange(num_blocks * self.block_size, device=starts.device)
            q_abs = (self.seq_lens - query_lens)[:, None] + torch.arange(self.max_query_len, device=starts.device)
            mask = kv_pos[None, None, :] <= q_abs[:, :, None]
            self._reference = (query_batch, query_pos, mask[:, None], self.block_tables[:, :num_blocks])
        return self._reference


def write_kv_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at slot_mapping."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def paged_attention_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D], attending to each request's paged context."""
    num_tokens, num_heads, head_dim = query.shape
    query_batch, query_pos, mask, tables = meta.reference_view()
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[tables].flatten(1, 2).transpose(1, 2)
    if meta.max_query_len == 1:
        q = query[:, :, None, :]  # one query per request: already [B, Hq, 1, D]
    else:
        q = query.new_zeros(tables.shape[0], meta.max_query_len, num_heads, head_dim)
        q[query_batch, query_pos] = query
        q = q.transpose(1, 2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=num_heads != keys.shape[1])
    if meta.max_query_len == 1:
        return out[:, :, 0, :]
    return out.transpose(1, 2)[query_batch, query_pos]


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    if use_triton(key):
        from loraplex.kernels.paged_attention_triton import write_kv_triton

        return write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    write_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query, k_cache, v_cache, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    if use_triton(query):
        from loraplex.kernels.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      meta.query_start_loc, meta.max_query_len, scale)
    return paged_attention_reference(query, k_cache, v_cache, meta, scale)
