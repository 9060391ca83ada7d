"""Paged attention and KV write: Triton kernels against the PyTorch reference, and the
reference against plain causal attention on contiguous K/V."""

import pytest
import torch

import torch.nn.functional as F
import triton

from loraplex.kernels import cpu_kernels
from loraplex.kernels.custom_ops import PagedAttention
from loraplex.kernels.dispatch import KernelConfig
from loraplex.kernels import paged_attention_triton
from loraplex.kernels.paged_attention import (PagedAttentionMetadata, attention_kernel, write_kv_reference,
                                               paged_attention_reference)
from kernel_case import configured
from paged_case import dense_attention, make_case, poison_before_window
from compile_case import RecordGrid

pytestmark = pytest.mark.usefixtures("every_core")  # the kernels split work over every thread

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-3, rtol=2e-3), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def attend(backend, query, k_cache, v_cache, meta, scale):
    return attend_with(backend, query, k_cache, v_cache, meta, scale, None, None)


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
    """The reference KV write (the CPU and PyTorch paths'; Triton's is fused into RoPE: test_layer_triton.py)."""
    g = torch.Generator().manual_seed(0)
    key = torch.randn(6, 2, 16, generator=g).to(dtype)
    value = torch.randn(6, 2, 16, generator=g).to(dtype)
    kc, vc = torch.zeros(2, 16, 2, 16, dtype=dtype), torch.zeros(2, 16, 2, 16, dtype=dtype)
    write_kv_reference(key, value, kc, vc, torch.tensor([3, -1, 17, 0, -1, 31]))
    assert torch.equal(kc.view(-1, 2, 16)[17], key[2]) and torch.equal(vc.view(-1, 2, 16)[31], value[5])
    assert int((kc != 0).any(-1).any(-1).sum()) == 4


def test_write_kv_from_a_strided_qkv_split():
    """K and V arrive as views into the fused qkv output: rows are strided."""
    qkv = torch.randn(5, 3 * 2 * 16)
    _, k, v = qkv.split([32, 32, 32], dim=-1)
    k, v = k.view(5, 2, 16), v.view(5, 2, 16)
    kc, vc = torch.zeros(2, 16, 2, 16), torch.zeros(2, 16, 2, 16)
    write_kv_reference(k, v, kc, vc, torch.tensor([0, 1, 2, 20, 21]))
    assert torch.equal(kc.view(-1, 2, 16)[20], k[3]) and torch.equal(vc.view(-1, 2, 16)[21], v[4])


WINDOW_CASES = [
    # seed, query lens, cached lens, heads, kv heads, head dim, block size, window, soft cap
    (10, [1, 1, 1, 1], [5, 15, 16, 40], 4, 2, 32, 16, 16, None),  # decode; window = block: inside, at and past it
    (11, [1, 1], [31, 70], 8, 1, 64, 32, 33, 30.0),  # window off the block grid, GQA 8, cap
    (12, [7, 20, 1], [0, 13, 33], 6, 2, 32, 16, 8, 5.0),  # prefill chunks longer than the window
    (13, [17, 40], [0, 30], 4, 2, 32, 16, 100, None),  # a window larger than every context: plain causal
    (14, [33, 5], [16, 47], 4, 4, 16, 16, 1, None),  # window 1: each query sees only itself
    (15, [1, 1, 3], [31, 32, 15], 4, 2, 32, 16, None, 2.0),  # cap alone, small: scores saturate
    (16, [45, 1], [20, 64], 4, 2, 32, 16, 32, 20.0),  # a chunk past the C kernel's length beside a decode
]
WINDOW_BACKENDS = ["torch", "auto", "triton"]  # reference, CPU dispatch (C kernel + reference), Triton


@pytest.mark.parametrize("backend", WINDOW_BACKENDS)
@pytest.mark.parametrize("seed,qlens,clens,heads,kv_heads,dim,bs,window,cap", WINDOW_CASES)
def test_window_and_softcap_match_dense_attention(backend, seed, qlens, clens, heads, kv_heads, dim, bs, window,
                                                  cap):
    query, kc, vc, meta, tables, seq_lens = make_case(seed, qlens, clens, heads, kv_heads, dim, bs, torch.float32)
    expected = dense_attention(query, kc, vc, tables, qlens, seq_lens, dim ** -0.5, window, cap)
    out = attend_with(backend, query, kc, vc, meta, dim ** -0.5, window, cap)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    plain = dense_attention(query, kc, vc, tables, qlens, seq_lens, dim ** -0.5)
    assert (window is not None and window >= max(seq_lens)) or not torch.allclose(expected, plain, atol=1e-3)


@pytest.mark.parametrize("backend", WINDOW_BACKENDS)
@pytest.mark.parametrize("seed,qlens,clens,heads,kv_heads,dim,bs,window,cap", WINDOW_CASES[1:3])
def test_window_and_softcap_in_bfloat16(backend, seed, qlens, clens, heads, kv_heads, dim, bs, window, cap):
    """A bfloat16 model's attention against the dense math on the same bf16 values."""
    query, kc, vc, meta, tables, seq_lens = make_case(seed, qlens, clens, heads, kv_heads, dim, bs, torch.bfloat16)
    expected = dense_attention(query, kc, vc, tables, qlens, seq_lens, dim ** -0.5, window, cap)
    out = attend_with(backend, query, kc, vc, meta, dim ** -0.5, window, cap)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, **TOL[torch.bfloat16])


def attend_with(backend, query, kc, vc, meta, scale, window, cap):
    """The attention a layer with this window and cap runs under `backend` (a `LORAPLEX_KERNELS` setting)."""
    kernel = attention_kernel(configured(backend, DEVICE, query.dtype, kv_dtype=kc.dtype), window, cap)
    return kernel(query.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), meta, scale).cpu()


@pytest.mark.parametrize("backend", WINDOW_BACKENDS)
@pytest.mark.parametrize("seed,qlens,clens,heads,kv_heads,dim,bs,window,cap",
                         [c for c in WINDOW_CASES if c[7] is not None and c[7] < 100])
def test_blocks_before_the_window_are_never_read(backend, seed, qlens, clens, heads, kv_heads, dim, bs, window, cap):
    """Table entries of blocks wholly before a request's window point at a block of NaNs (what the KV
    manager frees): the output stays finite and the same."""
    query, kc, vc, meta, tables, seq_lens = make_case(seed, qlens, clens, heads, kv_heads, dim, bs, torch.float32)
    clean = attend_with(backend, query, kc, vc, meta, dim ** -0.5, window, cap)
    kc, vc, poisoned, count = poison_before_window(kc, vc, meta, tables, qlens, seq_lens, window)
    assert count > 0
    out = attend_with(backend, query, kc, vc, poisoned, dim ** -0.5, window, cap)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, atol=0, rtol=0)


needs_c_kernel = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler here")


@needs_c_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed,qlens,clens,heads,kv_heads,dim,bs,window,cap", WINDOW_CASES)
def test_c_kernel_alone_on_every_chunk(dtype, seed, qlens, clens, heads, kv_heads, dim, bs, window, cap):
    """The C kernel itself on every request, prefill chunks too (the dispatch gives long ones to the
    reference), in float32 and bfloat16 (there against the dense math on the same bf16 values)."""
    query, kc, vc, meta, tables, seq_lens = make_case(seed, qlens, clens, heads, kv_heads, dim, bs, dtype)
    lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    token_request = torch.repeat_interleave(torch.arange(len(qlens)), lens)
    out = cpu_kernels.paged_attention_c(query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                        token_request, dim ** -0.5, window, cap)
    expected = dense_attention(query, kc, vc, tables, qlens, seq_lens, dim ** -0.5, window, cap)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **tol)


def test_paged_attention_binds_window_and_cap_once():
    """Without a window or a cap a layer runs the plain kernel itself; with them the same backend's kernel
    with both bound; refused values are named."""
    native = KernelConfig(backend="native")
    assert PagedAttention(0.125, native).kernel is paged_attention_reference
    query, kc, vc, meta, tables, seq_lens = make_case(12, [7, 20, 1], [0, 13, 33], 6, 2, 32, 16, torch.float32)
    layer = PagedAttention(32 ** -0.5, native, sliding_window=8, softcap=5.0)
    expected = dense_attention(query, kc, vc, tables, [7, 20, 1], seq_lens, 32 ** -0.5, 8, 5.0)
    torch.testing.assert_close(layer(query, kc, vc, meta).double(), expected, atol=2e-5, rtol=2e-5)
    for bad in (dict(sliding_window=0), dict(sliding_window=2.5), dict(softcap=0.0), dict(softcap=float("inf"))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PagedAttention(0.125, native, **bad)


def test_reference_views_are_derived_once_per_window():
    _, _, _, meta, _, _ = make_case(10, [1, 1, 1, 1], [5, 15, 16, 40], 4, 2, 32, 16, torch.float32)
    assert meta.reference_view(16) is meta.reference_view(16)
    assert meta.reference_view() is meta.reference_view() and meta.reference_view(16) is not meta.reference_view()
    assert meta.reference_view(16)[3].shape[1] == 2 < meta.reference_view()[3].shape[1]  # blocks the windows reach


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


def triton_attention(query, kc, vc, meta, scale, window=None, cap=None, table_dtype=torch.int64):
    """The Triton kernel through the dispatch, with the block tables in `table_dtype` (the runner's may be int32)."""
    meta = PagedAttentionMetadata.build(meta.slot_mapping, meta.block_tables.to(table_dtype), meta.seq_lens,
                                        meta.query_start_loc, meta.block_size)
    return attend_with("triton", query, kc, vc, meta, scale, window, cap)


@pytest.mark.parametrize("table_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("bs", [1, 4, 8, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_gqa_groups_and_block_sizes(group, bs, table_dtype):
    """Query heads packed per KV head, KV tiles gathered across blocks of any size (below tl.dot's 16 too),
    int32 or int64 tables: decodes beside prefill chunks, against the dense math."""
    qlens, clens = [1, 1, 9, 3], [0, 37, 12, 70]
    query, kc, vc, meta, tables, seq_lens = make_case(40 + bs + group, qlens, clens, 2 * group, 2, 32, bs,
                                                      torch.float32)
    expected = dense_attention(query, kc, vc, tables, qlens, seq_lens, 32 ** -0.5)
    out = triton_attention(query, kc, vc, meta, 32 ** -0.5, table_dtype=table_dtype)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bs,window,cap", [(4, 40, 10.0), (16, None, None)])
def test_window_and_softcap_with_small_blocks(bs, window, cap):
    """A window off the tile grid over blocks of 4: the walk starts at the window, no block before it read."""
    qlens, clens = [1, 1, 19], [70, 3, 50]
    query, kc, vc, meta, tables, seq_lens = make_case(61, qlens, clens, 8, 2, 32, bs, torch.float32)
    expected = dense_attention(query, kc, vc, tables, qlens, seq_lens, 32 ** -0.5, window, cap)
    torch.testing.assert_close(triton_attention(query, kc, vc, meta, 32 ** -0.5, window, cap).double(), expected,
                               atol=2e-5, rtol=2e-5)
    if window is not None:
        kc, vc, poisoned, count = poison_before_window(kc, vc, meta, tables, qlens, seq_lens, window)
        assert count > 0
        out = triton_attention(query, kc, vc, poisoned, 32 ** -0.5, window, cap, torch.int32)
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_launch_packs_query_heads_per_kv_head_and_splits_long_decodes():
    """Batch 1 decode, 32 query heads on 8 KV heads, 4k context: one program per KV head and split (not per
    query head), more than one split; prefill chunks and batches that fill the SMs are not split."""
    decode = paged_attention_triton.plan(1, 32, 8, 1, 4096)
    assert decode.num_splits > 1 and decode.grid == (1, 1, 8 * decode.num_splits)
    assert decode.programs == 8 * decode.num_splits <= paged_attention_triton.DEFAULT_NUM_SMS
    assert paged_attention_triton.plan(1, 32, 8, 1, 4096, num_sms=8).num_splits == 1
    assert paged_attention_triton.plan(64, 32, 8, 1, 4096).num_splits == 1
    assert paged_attention_triton.plan(1, 32, 8, 1, 4096, sliding_window=512).num_splits == 2  # the window's span
    prefill = paged_attention_triton.plan(1, 32, 8, 100, 4096)
    assert prefill.num_splits == 1 and prefill.grid == (1, triton.cdiv(400, 64), 8)
    assert paged_attention_triton.plan(1, 32, 8, 1, 300).num_splits == 1  # too short to be worth a reduce


def test_launch_grid_of_a_long_decode_at_real_shape(monkeypatch):
    """What a 4k-context batch-1 decode of 32 query heads on 8 KV heads launches (recorded, not run): the
    attention over KV heads x splits, then one reduce program per (token, query head)."""
    grids = []
    for name in ("_paged_attention_kernel", "_reduce_kernel"):
        monkeypatch.setattr(paged_attention_triton, name, RecordGrid(None, grids))
    query, kc, vc, meta, _, _ = make_case(63, [1], [4095], 32, 8, 16, 16, torch.float16)
    triton_attention(query, kc, vc, meta, 0.25)
    splits = paged_attention_triton.plan(1, 32, 8, 1, 4096).num_splits
    assert splits > 1 and grids == [(1, 1, 8 * splits), (32,)]


@pytest.mark.parametrize("window,cap,dtype", [(None, None, torch.float32), (700, 30.0, torch.float32),
                                              (None, None, torch.float16)])
def test_split_kv_decode_of_a_long_context(monkeypatch, window, cap, dtype):
    """Decodes of a 4k and a short context split into shares (grid recorded at launch: KV heads x splits; the
    short request's later shares see nothing) and the reduce of their partial softmaxes matches the dense
    math, under a window and a soft cap too."""
    grids = []
    kernel = paged_attention_triton._paged_attention_kernel
    monkeypatch.setattr(paged_attention_triton, "_paged_attention_kernel", RecordGrid(kernel, grids))
    qlens, clens = [1, 1], [4095, 90]
    query, kc, vc, meta, tables, seq_lens = make_case(62, qlens, clens, 4, 1, 16, 16, dtype)
    out = triton_attention(query, kc, vc, meta, 0.25, window, cap, torch.int32)
    splits = paged_attention_triton.plan(2, 4, 1, 1, 4096, window).num_splits
    assert grids == [(2, 1, splits)] and splits > 1
    expected = dense_attention(query, kc, vc, tables, qlens, seq_lens, 0.25, window, cap)
    torch.testing.assert_close(out.double(), expected, **(TOL[dtype] if dtype != torch.float32 else
                                                           dict(atol=2e-5, rtol=2e-5)))


def test_attention_compiles_for_the_gpu_at_any_block_size():
    """The kernel's constants do not depend on the block size, and with window, cap and split all compiled
    in it builds to a cubin for sm_90 with int32 tables (the one-program-per-block-tile kernel did not for
    blocks below 16: tl.dot needs every dimension >= 16)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from compile_case import compile_for_sm90

    launch = paged_attention_triton.plan(1, 32, 8, 1, 4096, 512)
    constants = paged_attention_triton.attention_constants(torch.float16, 128, launch, 512, 30.0)
    assert launch.num_splits > 1 and all(constants[k] >= 16 for k in ("BLOCK_M", "BLOCK_N", "BLOCK_D"))
    fp32 = {name: "*fp32" for name in ("part_ptr", "m_ptr", "l_ptr")}
    module = "loraplex.kernels.paged_attention_triton"
    stages = compile_for_sm90(module, "_paged_attention_kernel", constants,
                              {**fp32, "tables_ptr": "*i32", "seq_lens_ptr": "*i64", "starts_ptr": "*i64"},
                              ("scale", "softcap"))
    assert stages[-1] == "cubin"
