"""Paged attention: KV write at a slot mapping and attention over block tables.

This file holds the PyTorch reference, which is also the CPU path: each request's blocks are
gathered into a padded [batch, context] view and one SDPA call runs with a lower-right causal
mask (a chunk of queries sees the cached context plus itself; `is_causal=True` would be
top-left aligned, wrong whenever the query is shorter than the keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) per token; -1 skips
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    seq_lens: torch.Tensor  # [B] context length after this step (cached + new tokens)
    query_start_loc: torch.Tensor  # [B + 1] offsets of each request's tokens in the flat batch
    max_query_len: int
    max_seq_len: int
    # Derived once per step and shared by every layer (PyTorch path):
    query_batch: torch.Tensor | None = None  # [T] request of each token
    query_pos: torch.Tensor | None = None  # [T] position of each token inside its request's chunk
    attn_mask: torch.Tensor | None = None  # [B, 1, max_query_len, max_blocks_used * block_size]

    @staticmethod
    def build(slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              query_start_loc: torch.Tensor, block_size: int) -> "PagedAttentionMetadata":
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        max_query_len = int(query_lens.max())
        max_seq_len = int(seq_lens.max())
        num_tokens = int(query_start_loc[-1])
        query_batch = torch.repeat_interleave(torch.arange(len(seq_lens)), query_lens, output_size=num_tokens)
        query_pos = torch.arange(num_tokens) - query_start_loc[:-1][query_batch]
        num_blocks_used = -(-max_seq_len // block_size)
        kv_pos = torch.arange(num_blocks_used * block_size)
        q_abs = (seq_lens - query_lens)[:, None] + torch.arange(max_query_len)[None, :]
        mask = kv_pos[None, None, :] <= q_abs[:, :, None]
        return PagedAttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables[:, :num_blocks_used],
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_batch=query_batch,
            query_pos=query_pos,
            attn_mask=mask[:, None],
        )


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
    batch = meta.block_tables.shape[0]
    keys = k_cache[meta.block_tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[meta.block_tables].flatten(1, 2).transpose(1, 2)
    if meta.max_query_len == 1:
        q = query[:, :, None, :]  # one query per request: already [B, Hq, 1, D]
    else:
        q = query.new_zeros(batch, meta.max_query_len, num_heads, head_dim)
        q[meta.query_batch, meta.query_pos] = query
        q = q.transpose(1, 2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.attn_mask, scale=scale,
                                         enable_gqa=num_heads != keys.shape[1])
    if meta.max_query_len == 1:
        return out[:, :, 0, :]
    return out.transpose(1, 2)[meta.query_batch, meta.query_pos]


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    write_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query, k_cache, v_cache, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    # The Triton kernel (CUDA) arrives with the kernels issue; the reference serves every device now.
    return paged_attention_reference(query, k_cache, v_cache, meta, scale)
