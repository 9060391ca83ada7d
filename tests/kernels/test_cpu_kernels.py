"""The C paged-attention kernel (CPU, short query chunks) against the PyTorch reference, the
CPU dispatch that splits a batch between them, and the fallback when no compiler is there."""

import pytest
import torch

from loraplex.kernels import cpu_kernels
from loraplex.kernels.paged_attention import CPU_KERNEL_MAX_QUERY_LEN, attention_kernel
from loraplex.kernels.sgmv import lora_kernel
from conftest import tuned
from kernel_case import configured
from paged_case import make_case

pytestmark = pytest.mark.usefixtures("every_core")  # the kernels split work over every thread

needs_kernel = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler here")

CASES = [
    # seed, query lens, cached lens, heads, kv heads, head dim, block size
    (0, [1, 1, 1], [5, 16, 40], 4, 4, 64, 16),  # decode, MHA
    (1, [1, 1], [31, 70], 8, 1, 64, 32),  # decode, GQA 8
    (2, [7, 20, 1], [0, 13, 33], 6, 2, 32, 16),  # short chunks over context + decode
    (3, [1] * 40, list(range(0, 400, 10)), 9, 3, 64, 16),  # SmolLM2's heads, a decode batch
    (4, [1, 100, 1, 40, 3], [50, 0, 300, 7, 0], 9, 3, 64, 16),  # long prefill chunks beside decodes: split
    (5, [CPU_KERNEL_MAX_QUERY_LEN + 1], [5], 4, 2, 16, 16),  # only a long chunk: all reference
]


def paged_attention(query, kc, vc, meta, scale, setting="auto"):
    """The attention a model here runs for these dtypes (`setting`: a `LORAPLEX_KERNELS` value)."""
    return attention_kernel(configured(setting, "cpu", query.dtype, kv_dtype=kc.dtype))(query, kc, vc, meta, scale)


def reference(query, kc, vc, meta, scale):
    return paged_attention(query, kc, vc, meta, scale, "torch")


def sgmv_lora_table(x, table, batch, y):
    """The multi-LoRA delta a model here runs for x's dtype and the table's."""
    return lora_kernel(configured("auto", "cpu", x.dtype, lora_dtype=table.dtype))(x, table, batch, y)


@needs_kernel
@pytest.mark.parametrize("seed,qlens,clens,heads,kv_heads,dim,bs", CASES)
def test_cpu_dispatch_matches_reference(seed, qlens, clens, heads, kv_heads, dim, bs, monkeypatch):
    query, kc, vc, meta, _, _ = make_case(seed, qlens, clens, heads, kv_heads, dim, bs, torch.float32)
    calls = []
    kernel = cpu_kernels.paged_attention_c
    monkeypatch.setattr(cpu_kernels, "paged_attention_c", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    out = paged_attention(query, kc, vc, meta, dim ** -0.5)
    torch.testing.assert_close(out, reference(query, kc, vc, meta, dim ** -0.5), atol=1e-5, rtol=1e-5)
    assert len(calls) == int(min(qlens) <= CPU_KERNEL_MAX_QUERY_LEN)  # the kernel ran where it should


@needs_kernel
def test_kernel_alone_on_every_request():
    """The C kernel itself, also on chunks longer than the dispatch would give it."""
    query, kc, vc, meta, _, _ = make_case(6, [1, 45, 3], [70, 0, 18], 9, 3, 64, 16, torch.float32)
    lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    token_request = torch.repeat_interleave(torch.arange(3), lens)
    out = cpu_kernels.paged_attention_c(query, kc, vc, meta.block_tables, meta.seq_lens,
                                                  meta.query_start_loc, token_request, 0.125)
    torch.testing.assert_close(out, reference(query, kc, vc, meta, 0.125), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("seed,qlens,clens,heads,kv_heads,dim,bs", CASES[:4])
def test_bf16_kv_is_read_in_place_with_fp32_math(seed, qlens, clens, heads, kv_heads, dim, bs, monkeypatch):
    """A bfloat16 model's attention: bf16 query and K/V through the C kernel (no gathered copy),
    the math in float32. Against the reference in float32 on the same bf16 values, the only error
    is the output's rounding to bf16; against the bf16 reference, SDPA's bf16 rounding too."""
    query, kc, vc, meta, _, _ = make_case(seed, qlens, clens, heads, kv_heads, dim, bs, torch.bfloat16)
    calls = []
    kernel = cpu_kernels.paged_attention_c
    monkeypatch.setattr(cpu_kernels, "paged_attention_c", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    out = paged_attention(query, kc, vc, meta, dim ** -0.5)
    assert out.dtype == torch.bfloat16 and calls == [1]
    exact = reference(query.float(), kc.float(), vc.float(), meta, dim ** -0.5)
    torch.testing.assert_close(out.float(), exact, atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(out, reference(query, kc, vc, meta, dim ** -0.5), atol=3e-2, rtol=3e-2)


@needs_kernel
@pytest.mark.parametrize("seed,qlens,clens,heads,kv_heads,dim,bs", CASES[:4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kv_is_read_in_place(seed, qlens, clens, heads, kv_heads, dim, bs, dtype, monkeypatch):
    """A float8 e4m3 cache (`--kv-cache-dtype fp8`) read by the C kernel, converted exactly to
    float32 (normal and subnormal values): the reference on the same values widened."""
    query, kc, vc, meta, _, _ = make_case(seed, qlens, clens, heads, kv_heads, dim, bs, dtype)
    kc, vc = (c * torch.logspace(-3, 1, dim) for c in (kc.float(), vc.float()))  # subnormals to large values
    kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    calls = []
    kernel = cpu_kernels.paged_attention_c
    monkeypatch.setattr(cpu_kernels, "paged_attention_c", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    out = paged_attention(query, kc, vc, meta, dim ** -0.5)
    assert out.dtype == dtype and calls == [1]
    exact = reference(query.float(), kc.float(), vc.float(), meta, dim ** -0.5)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(out.float(), exact, **tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_attends_the_same_in_any_batch(dtype):
    """Many tokens run one task per token over all kv heads, a few one task per (token, kv head):
    each head's arithmetic is the same either way, so a request's output does not depend on
    the batch around it (bit for bit)."""
    tokens = 4 * torch.get_num_threads() + 8  # enough for a task per token on this machine's threads
    query, kc, vc, meta, _, _ = make_case(7, [1] * tokens, [3 + 10 * i for i in range(tokens)], 9, 3, 64, 16, dtype)
    rows = torch.arange(tokens)
    batch = cpu_kernels.paged_attention_c(query, kc, vc, meta.block_tables, meta.seq_lens,
                                          meta.query_start_loc, rows, 0.125)
    for b in (0, tokens // 2, tokens - 1):
        alone = cpu_kernels.paged_attention_c(query[b:b + 1], kc, vc, meta.block_tables[b:b + 1],
                                              meta.seq_lens[b:b + 1], torch.tensor([0, 1]), torch.tensor([0]), 0.125)
        assert torch.equal(alone[0], batch[b])


@needs_kernel
def test_split_metadata_is_derived_once_per_step():
    _, _, _, meta, _, _ = make_case(4, [1, 100, 1], [50, 0, 300], 9, 3, 64, 16, torch.float32)
    short, long = meta.cpu_parts()
    assert short.rows.tolist() == [0, 101] and long.rows.tolist() == list(range(1, 101))
    assert meta.cpu_parts() is meta.cpu_parts()


def test_no_compiler_falls_back_to_pytorch(monkeypatch, tmp_path):
    monkeypatch.setenv("LORAPLEX_CC", "no-such-compiler")
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_library", None)
    assert cpu_kernels.library() is None
    query, kc, vc, meta, _, _ = make_case(0, [1, 1], [5, 16], 4, 2, 16, 16, torch.float32)
    out = paged_attention(query, kc, vc, meta, 0.25)  # the dispatch keeps working
    torch.testing.assert_close(out, reference(query, kc, vc, meta, 0.25))


def test_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path))
    first = cpu_kernels._build()
    assert first.parent == tmp_path / "kernels" and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels._build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed,tokens,slots,max_rank,widths", [
    (0, 16, 16, 16, [96, 32, 32]),  # a decode batch: one token per adapter, q/k/v slices
    (1, 40, 64, 8, [64, 64]),  # gate/up, most slots unused
    (2, 5, 3, 1, [48]),  # rank 1
    (3, 48, 1, 16, [64]),  # one adapter, one 48-token segment
    (4, 24, 8, 16, [64]),  # ranks 0..16: empty slots mixed in
])
def test_c_sgmv_matches_reference(seed, tokens, slots, max_rank, widths, dtype, monkeypatch):
    """The C kernel reads each adapter in place, in its own rank, in float32 and bfloat16."""
    from lora_case import lora_case, reference, table_from_stacked

    from loraplex.kernels.lora_batch import LoRABatch

    s, ranks, x, a, b, scales, offsets = lora_case(seed, tokens, slots, max_rank, 64, widths, dtype,
                                                   min_rank=0 if seed == 4 else 1)
    y0 = torch.randn(tokens, sum(widths)).to(dtype)
    expected = reference(x, a, b, ranks, scales, offsets, s, y0)
    calls = []
    kernel = cpu_kernels.sgmv_lora_table_c
    monkeypatch.setattr(cpu_kernels, "sgmv_lora_table_c", lambda *args: calls.append(1) or kernel(*args))
    got = sgmv_lora_table(x, table_from_stacked(a, b, ranks, scales, offsets), LoRABatch.build(s), y0.clone())
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:  # float32 accumulation both ways; y rounded once to bfloat16 (one ulp apart at most)
        torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=8e-3)
    assert calls == [1]  # these batches are decode-like: the C kernel ran


@needs_kernel
@pytest.mark.parametrize("c_kernel", [True, False])
def test_bf16_adapters_under_float32_activations(c_kernel, monkeypatch):
    """16-bit adapters on a float32 model (a quantized base's default): the C kernel and the
    PyTorch path widen the weights, so the result is the float32 one on the same (bf16) values."""
    from lora_case import lora_case, reference, table_from_stacked

    from loraplex.kernels.lora_batch import LoRABatch

    s, ranks, x, a, b, scales, offsets = lora_case(0, 16, 16, 16, 64, [96, 32, 32], torch.float32)
    a, b = a.bfloat16().float(), b.bfloat16().float()  # the values bf16 holds exactly
    y0 = torch.randn(16, 160)
    expected = reference(x, a, b, ranks, scales, offsets, s, y0)
    table = table_from_stacked(a.bfloat16(), b.bfloat16(), ranks, scales, offsets)
    assert table.dtype == torch.bfloat16
    calls = []
    kernel = cpu_kernels.sgmv_lora_table_c
    monkeypatch.setattr(cpu_kernels, "sgmv_lora_table_c", lambda *args: calls.append(1) or kernel(*args))
    if not c_kernel:
        tuned(monkeypatch, lora_kernel_mean_segment_f32=0, lora_kernel_mean_segment_bf16=0)
    got = sgmv_lora_table(x, table, LoRABatch.build(s), y0.clone())
    assert got.dtype == torch.float32 and calls == ([1] if c_kernel else [])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype,weights", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("in_features,widths", [(40, [24, 8]), (77, [45, 3, 19]), (96, [64, 33])])
def test_c_sgmv_takes_an_adapters_tokens_together_in_any_group_size(dtype, weights, in_features, widths):
    """Tokens of one adapter go through the kernel up to four at a time (its weights read once
    for them): groups of 1 to 5 tokens, shuffled in the batch, ranks 1-5 (partial groups of rows);
    sizes that are not whole vectors (the AVX-512 loops take 32 values at a time, masked at the end),
    slices starting at odd offsets."""
    from lora_case import lora_case, reference, table_from_stacked

    from loraplex.kernels.lora_batch import LoRABatch

    _, ranks, x, a, b, scales, offsets = lora_case(5, 15, 5, 5, in_features, widths, dtype,
                                                   rank_choices=[5, 3, 1, 4, 5])
    a, b = a.to(weights).to(dtype), b.to(weights).to(dtype)  # the values the weights' dtype holds
    slots = [i for i in range(5) for _ in range(i + 1)]  # 1, 2, 3, 4 and 5 tokens
    slots = [slots[j] for j in torch.randperm(15, generator=torch.Generator().manual_seed(0)).tolist()]
    y0 = torch.randn(15, sum(widths)).to(dtype)
    expected = reference(x, a, b, ranks, scales, offsets, slots, y0)
    batch = LoRABatch.build(slots)
    table = table_from_stacked(a.to(weights), b.to(weights), ranks, scales, offsets)
    got = cpu_kernels.sgmv_lora_table_c(x, table, batch.token_order, batch.order_slots, y0.clone())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(got.float(), expected.float(), **tol)


@needs_kernel
def test_c_sgmv_bf16_rounds_to_nearest_even_like_torch():
    """One token, one rank-1 adapter with unit weights: the kernel's only error is the final rounding."""
    from loraplex.kernels.lora_batch import LoRABatch
    from loraplex.kernels.sgmv import LoRATable

    y0 = torch.tensor([[1.0, 1.0, -3.0, 256.0]], dtype=torch.bfloat16)
    deltas = torch.tensor([2 ** -8, 3 * 2 ** -8, 2 ** -20, 1.0])  # ties, above a tie, tiny, exact
    table = LoRATable.empty(1, [0, 4], torch.bfloat16)
    table.set(0, torch.ones(1, 1, dtype=torch.bfloat16), deltas[None, :].to(torch.bfloat16), 1.0)
    x = torch.ones(1, 1, dtype=torch.bfloat16)
    got = sgmv_lora_table(x, table, LoRABatch.build([0]), y0.clone())
    expected = (y0.float() + deltas.to(torch.bfloat16).float()).to(torch.bfloat16)
    assert torch.equal(got, expected)


@needs_kernel
@pytest.mark.parametrize("dtype,short,long", [(torch.float32, 60, 150), (torch.bfloat16, 250, 300)])
def test_c_sgmv_is_skipped_for_long_segments_and_non_contiguous_outputs(dtype, short, long, monkeypatch):
    """Prefill-shaped segments take the GEMM path from a length that depends on the adapters' dtype
    (bf16: the AVX-512 loops beat small bf16 GEMMs for longer); a strided output is misuse the binding
    refuses (the kernel would write wrong rows), never a silent fallback."""
    from lora_case import lora_case, table_from_stacked

    from loraplex.kernels.lora_batch import LoRABatch

    calls = []
    kernel = cpu_kernels.sgmv_lora_table_c
    monkeypatch.setattr(cpu_kernels, "sgmv_lora_table_c", lambda *args: calls.append(1))
    for length in (short, long):
        s, ranks, x, a, b, scales, offsets = lora_case(3, 2 * length, 2, 8, 64, [64], dtype)
        s = [0] * length + [1] * length  # two requests' prefill chunks
        table = table_from_stacked(a, b, ranks, scales, offsets)
        sgmv_lora_table(x, table, LoRABatch.build(s), torch.zeros(2 * length, 64, dtype=dtype))
    assert calls == [1]  # the short segments only
    monkeypatch.setattr(cpu_kernels, "sgmv_lora_table_c", kernel)
    s, ranks, x, a, b, scales, offsets = lora_case(4, 8, 8, 8, 64, [64])
    wide = torch.zeros(8, 64, 2)[..., 0]  # a strided output
    with pytest.raises(ValueError, match="contiguous"):
        sgmv_lora_table(x, table_from_stacked(a, b, ranks, scales, offsets), LoRABatch.build(s), wide)


@needs_kernel
@pytest.mark.parametrize("seed,qlens,clens,heads,kv_heads,dim,bs", [CASES[2], CASES[4]])
def test_float16_kv_cache_matches_the_reference_on_the_same_values(seed, qlens, clens, heads, kv_heads, dim, bs):
    if not cpu_kernels._f16c():
        pytest.skip("this CPU has no F16C: a float16 cache takes the PyTorch path")
    query, kc, vc, meta, _, _ = make_case(seed, qlens, clens, heads, kv_heads, dim, bs, torch.float32)
    kc16, vc16 = kc.half(), vc.half()
    out = paged_attention(query, kc16, vc16, meta, dim ** -0.5)
    torch.testing.assert_close(out, reference(query, kc16, vc16, meta, dim ** -0.5), atol=1e-5, rtol=1e-5)
    # and close to float32 K/V: only the rounding of the cached values differs
    torch.testing.assert_close(out, reference(query, kc, vc, meta, dim ** -0.5), atol=5e-3, rtol=5e-3)


def test_amx_packing_round_trips():
    """The tile layout holds the weight as it is (rows padded to 32, then dropped again): pure PyTorch, any CPU."""
    w = torch.randn(70, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    packed = cpu_kernels.pack_bf16_amx(w)
    assert packed.shape == (6, 3, 16, 16, 2)
    assert torch.equal(cpu_kernels.unpack_bf16_amx(packed, 70), w)
    assert packed[4, :, :, :6].abs().sum() > 0  # rows 64-69
    assert packed[5].abs().sum() == 0 and packed[4, :, :, 6:].abs().sum() == 0  # rows 70-95: zeros
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_kernels.pack_bf16_amx(torch.zeros(8, 40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_kernels.bf16_matmul_amx_c(torch.zeros(2, 96, dtype=torch.float16), packed, 70)


@pytest.mark.parametrize("m", [1, 5, 15, 16, 17, 32, 33, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_bf16_amx_kernel_is_the_bf16_gemm(m, dtype):
    """Token counts across one block of 16 (even/odd groups), whole 2 x 16 blocks and a block past them; 37 and 70
    rows (a strip of 32 with its second tile past the last row); K of 1, 3 and 18 groups; float32 x (rounded to
    bf16 in the copy) and bf16 x (read in place when its tokens are whole 16s)."""
    if not cpu_kernels.amx_supported():
        pytest.skip("this CPU has no AMX-BF16 (the kernel is built only for one that has)")
    for n, k in ((37, 32), (70, 96), (37, 576)):
        gen = torch.Generator().manual_seed(m * k + n)
        w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
        x = torch.randn(m, k, generator=gen).to(dtype)
        got = cpu_kernels.bf16_matmul_amx_c(x, cpu_kernels.pack_bf16_amx(w), n)
        assert got.dtype == dtype and got.shape == (m, n)
        want = (x.to(torch.bfloat16).float() @ w.float().T).to(dtype)
        rtol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5  # bf16: one rounding of the output
        torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=rtol)


@pytest.mark.parametrize("m", [1, 2, 3, 6, 7, 23, 24, 25])
def test_float32_kernel_on_plain_rows_is_f_linear(m):
    """Token counts across the register blocks and the 24-token chunks, 1 token (no prefetch) and 2+ (on AVX2 the
    next tile's rows fetched while the first tokens are multiplied, none past the last row; on AVX-512 the next
    tile from 3); row counts that end in a partial 4-row block and a partial 8-row tile; K across the 16-lane tail
    and several of the AVX-512 kernel's K parts."""
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler")
    for n, k in ((5, 8), (37, 72), (70, 1544), (13, 40)):
        gen = torch.Generator().manual_seed(m * k + n)
        w, x = torch.randn(n, k, generator=gen) * k ** -0.5, torch.randn(m, k, generator=gen)  # outputs ~1
        got = cpu_kernels.f32_matmul_c(x, w)
        assert got.shape == (m, n)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="refused"):
        cpu_kernels.f32_matmul_c(torch.zeros(2, 12), torch.zeros(4, 12))  # K not a multiple of 8


# ---- the checked bindings (cpu_ops.py): misuse raises, naming the function and the argument ----

def _f32_args(m=2, k=16, n=3):
    return [torch.randn(m, k), m, k, torch.randn(n, k), n, torch.empty(m, n)]


@needs_kernel
@pytest.mark.parametrize("index,bad,error,match", [
    (0, torch.randn(2, 16, dtype=torch.float64), TypeError, "f32_matmul: x must be torch.float32"),
    (3, torch.randn(16, 3).T, ValueError, "f32_matmul: w must be contiguous"),
    (3, torch.randn(2, 16), ValueError, "f32_matmul: w holds 32 elements, the sizes passed need N \\* K = 48"),
    (5, torch.empty(5), ValueError, "f32_matmul: out holds 5 elements"),
    (5, None, TypeError, "f32_matmul: out must be a torch.Tensor, not NoneType"),
    (0, [1.0] * 32, TypeError, "f32_matmul: x must be a torch.Tensor, not list"),
    (0, torch.empty(2, 16, device="meta"), ValueError, "f32_matmul: x must be on the CPU"),
    (1, "2", TypeError, "f32_matmul: M must be an int"),
])
def test_checked_call_refuses_misuse(index, bad, error, match):
    args = _f32_args()
    args[index] = bad
    with pytest.raises(error, match=match):
        cpu_kernels.ops.f32_matmul(*args)


@needs_kernel
def test_checked_call_runs_and_maps_statuses():
    args = _f32_args()
    assert cpu_kernels.ops.f32_matmul(*args) == 0
    torch.testing.assert_close(args[5], args[0] @ args[3].T, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="f32_matmul"):  # an argument missing
        cpu_kernels.ops.f32_matmul(*args[:5])
    with pytest.raises(RuntimeError, match="f32_matmul refused its arguments \\(status -2\\)"):  # K % 8
        cpu_kernels.ops.f32_matmul(torch.zeros(2, 12), 2, 12, torch.zeros(4, 12), 4, torch.empty(2, 4))


@needs_kernel
def test_nullable_arguments_take_none_and_the_others_do_not():
    x, w = torch.randn(3, 16), torch.randn(16)
    out = torch.empty(3, 16)
    cpu_kernels.ops.add_rms_norm(x, None, w, 3, 16, 1e-5, cpu_kernels.KV_KINDS[torch.float32], out)  # no residual
    with pytest.raises(TypeError, match="add_rms_norm: w must be a torch.Tensor, not NoneType"):
        cpu_kernels.ops.add_rms_norm(x, None, None, 3, 16, 1e-5, 0, out)
    with pytest.raises(TypeError, match="add_rms_norm: residual must be torch.float32 or torch.bfloat16"):
        cpu_kernels.ops.add_rms_norm(x, x.half(), w, 3, 16, 1e-5, 0, out)
    index = [torch.zeros(n, dtype=torch.int64) for n in (1, 1, 2, 1)]  # tables, seq_lens, starts, token_request
    with pytest.raises(ValueError, match="paged_attention_f32: token_request holds 1 elements"):  # 2 tokens
        cpu_kernels.ops.paged_attention_f32(torch.zeros(2, 1, 8), torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8),
                                            index[0], 1, *index[1:], 2, 1, 1, 8, 4, 1.0, 0, 0.0, 0, 0,
                                            torch.empty(2, 1, 8))


def test_returned_statuses_are_handed_back_and_the_others_raise():
    """The int8-activation kernels' -3 (not built for this CPU) is read by the caller; elsewhere -3 raises and
    -1 is a MemoryError. A stand-in C function: any CPU, no library needed."""
    from loraplex.kernels import cpu_ops

    decl = {fn.name: fn for fn in cpu_ops.DECLARATIONS}
    x, q, dm, out = torch.zeros(1, 32), torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1), torch.zeros(1, 2)
    args = (x, 1, 32, q, dm, dm, 2, out)
    assert cpu_ops.checked(decl["q4_matmul_x8"], lambda *a: -3)(*args) == -3
    with pytest.raises(RuntimeError, match="q4_matmul refused its arguments \\(status -3\\)"):
        cpu_ops.checked(decl["q4_matmul"], lambda *a: -3)(*args)
    with pytest.raises(MemoryError, match="q4_matmul_x8 could not allocate"):
        cpu_ops.checked(decl["q4_matmul_x8"], lambda *a: -1)(*args)


def test_ops_without_a_library_raises_clearly():
    from loraplex.kernels import cpu_ops

    with pytest.raises(RuntimeError, match="ops.q4_matmul: the C kernels are not available here"):
        cpu_ops.Ops(lambda: None).q4_matmul


@needs_kernel
def test_the_declaration_covers_every_exported_function():
    import shutil
    import subprocess

    from loraplex.kernels import cpu_ops

    if shutil.which("nm") is None:
        pytest.skip("no nm here to list the library's symbols")
    listing = subprocess.run(["nm", "-D", "--defined-only", cpu_kernels.library()._name], capture_output=True,
                             text=True, check=True).stdout
    exported = {line.split()[-1] for line in listing.splitlines() if line.split()[1:2] == ["T"]}
    assert exported == {fn.name for fn in cpu_ops.DECLARATIONS}


@needs_kernel
def test_the_library_was_built_with_pythons_kind_codes():
    from loraplex.kernels import cpu_ops

    codes = torch.full((len(cpu_ops.KIND_NAMES),), -1, dtype=torch.int64)
    assert cpu_kernels.ops.kind_codes(codes) == len(cpu_ops.KIND_NAMES)
    assert dict(zip(cpu_ops.KIND_NAMES, codes.tolist())) == {**cpu_ops.ELEMENT_KINDS, **cpu_ops.WEIGHT_KINDS}
    assert cpu_kernels.KV_KINDS == {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}
    assert cpu_kernels.WEIGHT_KINDS == {"q4": 4, "q4_tiles": 5, "q4_tiles_f16": 6, "q8": 8}


def test_changing_any_one_source_file_changes_the_cache_key(monkeypatch, tmp_path):
    import shutil

    files = [*cpu_kernels.SOURCES, *cpu_kernels.HEADERS]
    assert {p.name for p in files} == {p.name for p in cpu_kernels.CSRC.iterdir() if p.suffix in (".c", ".h")}
    for path in files:
        shutil.copy(path, tmp_path / path.name)
    monkeypatch.setattr(cpu_kernels, "SOURCES", tuple(tmp_path / p.name for p in cpu_kernels.SOURCES))
    monkeypatch.setattr(cpu_kernels, "HEADERS", tuple(tmp_path / p.name for p in cpu_kernels.HEADERS))
    keys = {cpu_kernels._cache_key("cc", cpu_kernels.FLAGS)}
    for path in files:
        copy = tmp_path / path.name
        original = copy.read_bytes()
        copy.write_bytes(original + b"\n")
        keys.add(cpu_kernels._cache_key("cc", cpu_kernels.FLAGS))
        copy.write_bytes(original)
    assert len(keys) == len(files) + 1
    assert cpu_kernels._cache_key("cc", cpu_kernels.FLAGS) in keys  # the same sources: the same key again
