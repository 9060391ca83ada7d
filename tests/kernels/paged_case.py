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


def dense_attention(query, k_cache, v_cache, tables, query_lens, seq_lens, scale, window=None, softcap=None):
    """Each request's attention on its contiguous K/V in float64, written out from the definitions: key k
    visible to query q iff k <= q and (with a window W) q - k < W; scores scaled, then soft-capped
    (cap * tanh(s / cap)), then masked."""
    heads, kv_heads = query.shape[1], k_cache.shape[2]
    out, start = [], 0
    for table, q_len, s_len in zip(tables, query_lens, seq_lens):
        k = k_cache[table].flatten(0, 1)[:s_len].double().repeat_interleave(heads // kv_heads, 1)  # [s, H, D]
        v = v_cache[table].flatten(0, 1)[:s_len].double().repeat_interleave(heads // kv_heads, 1)
        q = query[start:start + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos, k_pos = torch.arange(s_len - q_len, s_len)[:, None], torch.arange(s_len)[None, :]
        visible = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window is not None else True)
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", weights, v))
        start += q_len
    return torch.cat(out)


def poison_before_window(k_cache, v_cache, meta, tables, query_lens, seq_lens, window):
    """The caches with one more block of NaNs, and `meta` with every table entry of a block wholly before
    the first position a request's first query sees pointing at it: a kernel that reads such a block
    returns NaNs (the KV manager frees those blocks; their entries then hold the padding id)."""
    nan_block = k_cache.shape[0]
    k_cache = torch.cat([k_cache, torch.full_like(k_cache[:1], float("nan"))])
    v_cache = torch.cat([v_cache, torch.full_like(v_cache[:1], float("nan"))])
    block_tables = meta.block_tables.clone()
    block_size = k_cache.shape[1]
    for row, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        dead = max(0, s_len - q_len - window + 1) // block_size
        block_tables[row, :dead] = nan_block
    poisoned = PagedAttentionMetadata.build(meta.slot_mapping, block_tables, meta.seq_lens, meta.query_start_loc,
                                            meta.block_size)
    return k_cache, v_cache, poisoned, int((block_tables == nan_block).sum())  # how many entries were poisoned
