"""Random paged attention inputs shared by the kernel tests."""

import torch

from loraplex.kernels.paged_attention import PagedAttentionMetadata


def make_case(seed, query_lens, cached_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device="cpu"):
    """Random paged K/V for requests with `cached_lens` cached tokens and `query_lens` new ones,
    in shuffled blocks; returns the flat inputs and each request's contiguous K/V."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, cached_lens)]
    blocks_per = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, cursor = [], 0
    for n in blocks_per:
        tables.append(perm[cursor:cursor + n])
        cursor += n
    width = max(blocks_per)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    slots = []
    for table, q, c in zip(tables, query_lens, cached_lens):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
    meta = PagedAttentionMetadata.build(
        torch.tensor(slots, device=device), torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
        torch.tensor(seq_lens, device=device), torch.tensor(starts, device=device), block_size)
    return query, k_cache, v_cache, meta, tables, seq_lens
