"""Paged attention and KV write: Triton kernels against the PyTorch reference, and the
reference against plain causal attention on contiguous K/V."""

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels import dispatch
from loraplex.kernels.paged_attention import paged_attention, write_kv
from paged_case import make_case

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-3, rtol=2e-3), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def attend(backend, query, k_cache, v_cache, meta, scale):
    with dispatch.forced_backend(backend):
        return paged_attention(query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), meta, scale).cpu()


def write_both(key, value, slots, dtype):
    """(k_cache, v_cache) after write_kv on each backend: torch first, then triton."""
    out = []
    for backend in ("torch", "triton"):
        with dispatch.forced_backend(backend):
            kc = torch.zeros(2, 16, 2, 16, dtype=dtype, device=DEVICE)
            vc = torch.zeros_like(kc)
            write_kv(key.to(DEVICE), value.to(DEVICE), kc, vc, slots.to(DEVICE))
            out.append((kc.cpu(), vc.cpu()))
    return out


CASES = [
    # seed, query lens, cached lens, heads, kv heads, head dim, block size, dtype
    (0, [1, 1, 1], [5, 16, 40], 4, 4, 64, 16, torch.float32),  # decode, MHA
    (1, [1, 1], [31, 70], 8, 1, 64, 32, torch.float16),  # decode, GQA 8
    (2, [7, 20, 1], [0, 13, 33], 6, 2, 32, 16, torch.float32),  # prefill chunks over context + decode
    (3, [17], [0], 4, 2, 64, 32, torch.bfloat16),  # pure prefill, T not a multiple of the tile
    (4, [5, 9], [16, 3], 9, 3, 64, 16, torch.float32),  # SmolLM2's 9 heads / 3 KV heads
]


@pytest.mark.parametrize("seed,qlens,clens,heads,kv_heads,dim,bs,dtype", CASES)
def test_triton_matches_reference(seed, qlens, clens, heads, kv_heads, dim, bs, dtype):
    query, kc, vc, meta, _, _ = make_case(seed, qlens, clens, heads, kv_heads, dim, bs, dtype, DEVICE)
    ref = attend("torch", query, kc, vc, meta, dim ** -0.5)
    tri = attend("triton", query, kc, vc, meta, dim ** -0.5)
    torch.testing.assert_close(tri.float(), ref.float(), **TOL[dtype])


def test_reference_is_lower_right_causal_attention():
    qlens, clens = [3, 1, 6], [10, 4, 0]
    query, kc, vc, meta, tables, seq_lens = make_case(9, qlens, clens, 4, 2, 16, 16, torch.float32, DEVICE)
    out = attend("torch", query, kc, vc, meta, 0.25)
    start = 0
    for table, q, s in zip(tables, qlens, seq_lens):
        k = kc[table].flatten(0, 1)[:s].transpose(0, 1).repeat_interleave(2, 0)  # [H, s, D]
        v = vc[table].flatten(0, 1)[:s].transpose(0, 1).repeat_interleave(2, 0)
        qq = query[start:start + q].transpose(0, 1)
        mask = torch.arange(s)[None, :] <= (s - q + torch.arange(q))[:, None]
        expected = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=0.25).transpose(0, 1)
        torch.testing.assert_close(out[start:start + q], expected, atol=1e-5, rtol=1e-5)
        start += q


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_skips_negative_slots(dtype):
    g = torch.Generator().manual_seed(0)
    key = torch.randn(6, 2, 16, generator=g).to(dtype)
    value = torch.randn(6, 2, 16, generator=g).to(dtype)
    slots = torch.tensor([3, -1, 17, 0, -1, 31])
    (kr, vr), (kt, vt) = write_both(key, value, slots, dtype)
    assert torch.equal(kr, kt) and torch.equal(vr, vt)
    assert torch.equal(kr.view(-1, 2, 16)[17], key[2]) and int((kr != 0).any(-1).any(-1).sum()) == 4


def test_write_kv_from_a_strided_qkv_split():
    """K and V arrive as views into the fused qkv output: rows are strided."""
    qkv = torch.randn(5, 3 * 2 * 16)
    _, k, v = qkv.split([32, 32, 32], dim=-1)
    k, v = k.view(5, 2, 16), v.view(5, 2, 16)
    slots = torch.tensor([0, 1, 2, 20, 21])
    (kr, vr), (kt, vt) = write_both(k, v, slots, torch.float32)
    assert torch.equal(kr, kt) and torch.equal(vr, vt)
    assert torch.equal(kr.view(-1, 2, 16)[20], k[3])


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_randomized_sweep(seed):
    g = torch.Generator().manual_seed(200 + seed)
    pick = lambda xs: xs[int(torch.randint(0, len(xs), (1,), generator=g))]
    n = pick([1, 2, 5])
    kv_heads, ratio = pick([1, 2, 4]), pick([1, 2, 3, 8])
    qlens = [pick([1, 1, 3, 16, 33]) for _ in range(n)]
    clens = [pick([0, 1, 15, 16, 47]) for _ in range(n)]
    test_triton_matches_reference(seed, qlens, clens, kv_heads * ratio, kv_heads, pick([32, 64]), pick([16, 32]),
                                  pick([torch.float32, torch.float16, torch.bfloat16]))
