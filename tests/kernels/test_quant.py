"""Weight-only quantized matmul: the C kernel against dequantize-then-matmul, GGUF blocks read
bit for bit (against the gguf package's own dequantizer), quantizing at load within bounds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from loraplex.kernels import autotune, cpu_kernels, quant
from loraplex.kernels.cpu_kernels import CpuCaps
from loraplex.kernels.quant import (concat, dequantize, from_gguf, quantize, quantized_matmul, reference_matmul,
                                    rows)

pytestmark = pytest.mark.usefixtures("every_core")  # the kernels split work over every thread

FORMATS = [("q4", None), ("q8", None), ("q8", 32)]


CAPS = CpuCaps.detect()
TUNE = dataclasses.replace(autotune.DEFAULT, dense_tokens_f32=1 << 30, dense_tokens_bf16=1 << 30)  # no dense GEMM


def tune(**fields) -> autotune.TuneTable:
    return dataclasses.replace(autotune.DEFAULT, **fields)


@pytest.mark.parametrize("kind,group", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_kernel_matches_dequantize_then_matmul(kind, group, m):
    if cpu_kernels.library() is None:
        pytest.fail("the C kernels did not build (a C compiler is part of the set-up)")
    gen = torch.Generator().manual_seed(m)
    weight = torch.randn(37, 192, generator=gen) * 0.05  # 37 rows: not a multiple of the kernel's 4
    w = quantize(weight, kind, group)
    x = torch.randn(m, 192, generator=gen)
    got = quant.float_matmul(x, w)
    torch.testing.assert_close(got, reference_matmul(x, w), atol=2e-5, rtol=1e-5)
    x3 = torch.randn(2, 5, 192, generator=gen)  # any leading shape
    assert quantized_matmul(x3, w, TUNE).shape == (2, 5, 37)


@pytest.mark.parametrize("kind,group,k", [("q4", None, 1600), ("q8", 40, 1000)])
@pytest.mark.parametrize("m", [7, 64])
def test_float_kernel_over_long_rows(kind, group, k, m):
    """Rows longer than one L1 part of K (1600: three parts; 1000: two, the last ending in a partial
    vector, groups of 40), token blocks of 6 and a tail."""
    gen = torch.Generator().manual_seed(k + m)
    w = quantize(torch.randn(37, k, generator=gen) * 0.05, kind, group)
    x = torch.randn(m, k, generator=gen)
    torch.testing.assert_close(quant.float_matmul(x, w), reference_matmul(x, w),
                               atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("kind,group", FORMATS)
@pytest.mark.parametrize("m,k", [(1, 192), (1, 576), (3, 1536), (2, 288)])
def test_int8_activation_kernel_matches_its_reference(kind, group, m, k):
    """K = 576: two 8-group blocks on the 512-bit path and two groups left over for the 256-bit
    one; 1536: whole blocks; 192 and 288: the 256-bit path alone, or after one block."""
    x8 = cpu_kernels.int8_dot_supported()  # x86 with AVX2 and up; elsewhere: float32 activations
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert x8, "an AVX2 CPU has the integer dot path: the kernel build lost it"
    gen = torch.Generator().manual_seed(k + m)
    weight = torch.randn(37, k, generator=gen) * 0.05
    w = quantize(weight, kind, group)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, k // 32, 1, generator=gen).repeat(1, 1, 32).reshape(m, k)
    x[0, :32] = 0  # an all-zero group: scale 0, no division by it
    got = quant.int8_matmul(x, w) if x8 else quant.float_matmul(x, w)
    torch.testing.assert_close(got, reference_matmul(x, w, int8_activations=x8), atol=2e-5, rtol=1e-5)
    # what rounding x to 8 bits costs: within a few of its steps per output, not a different answer
    float_out = reference_matmul(x, w)
    step = (x.abs().amax() / 127) * dequantize(w).abs().sum(1).amax()
    assert (got - float_out).abs().max() < 0.5 * step


@pytest.mark.parametrize("kind,group", FORMATS)
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, {"atol": 1e-4, "rtol": 1e-5}),
                                             (torch.bfloat16, {"atol": 1e-3, "rtol": 2 ** -7})])
def test_dense_path_is_a_gemm_on_the_dequantized_weight(kind, group, dtype, tolerance):
    """Prefill-sized calls: the weight dequantized in C, then oneDNN; in bfloat16 (emulated where
    the CPU lacks it) within one bf16 rounding of the same product rounded in the reference."""
    nowhere = (1 << 30, 1 << 30)
    table = tune(dense_dtype=str(dtype).removeprefix("torch."), dense_tokens_f32=8, dense_tokens_bf16=8,
                 amx_tokens=nowhere, amx_tile_order_tokens=nowhere, dpbf16_tokens=nowhere)
    gen = torch.Generator().manual_seed(7)
    w = quantize(torch.randn(37, 576, generator=gen) * 0.05, kind, group)
    torch.testing.assert_close(quant.dequantized(w), dequantize(w), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(quant.dequantized(w, torch.bfloat16), dequantize(w).bfloat16(), atol=1e-6, rtol=2 ** -8)
    x = torch.randn(2, 5, 576, generator=gen)  # 10 tokens: dense
    got = quantized_matmul(x, w, table)
    assert got.shape == (2, 5, 37) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference_matmul(x, w, dense_dtype=dtype), **tolerance)
    if dtype == torch.float32:
        torch.testing.assert_close(got, reference_matmul(x, w), atol=1e-4, rtol=1e-5)


def test_decode_sized_calls_take_int8_activations_and_larger_ones_float():
    nowhere = (1 << 30, 1 << 30)
    table = tune(amx_tokens=nowhere, amx_tile_order_tokens=nowhere, dpbf16_tokens=nowhere)
    gen = torch.Generator().manual_seed(5)
    w = quantize(torch.randn(16, 256, generator=gen), "q4")
    n = table.int8_activation_tokens  # decode at batch 1-4: measured faster than the float kernel
    at, above = torch.randn(n, 256, generator=gen), torch.randn(n + 1, 256, generator=gen)
    x8 = cpu_kernels.int8_dot_supported()
    torch.testing.assert_close(quantized_matmul(at, w, table), reference_matmul(at, w, int8_activations=x8),
                               atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(quantized_matmul(above, w, table), reference_matmul(above, w), atol=2e-5, rtol=1e-5)
    many = torch.randn(40, 256, generator=gen)  # raised, the int8 bound wins over the dense GEMM's
    raised = dataclasses.replace(table, int8_activation_tokens=64, dense_tokens_f32=8, dense_tokens_bf16=8)
    torch.testing.assert_close(quantized_matmul(many, w, raised), reference_matmul(many, w, int8_activations=x8),
                               atol=2e-5, rtol=1e-5)
    odd = quantize(torch.randn(16, 240, generator=gen), "q8", 48)  # groups of 48: not whole 32s
    x = torch.randn(1, 240, generator=gen)
    torch.testing.assert_close(quantized_matmul(x, odd, table), reference_matmul(x, odd), atol=2e-5, rtol=1e-5)


BF16_TOLERANCE = {"atol": 1e-3, "rtol": 2 ** -7}  # one bf16 rounding of the output, sums in another order


BF16_KERNELS = {"amx": (cpu_kernels.amx_supported, quant.amx_matmul, "AMX-BF16"),
                "dpbf16": (cpu_kernels.dpbf16_supported, quant.dpbf16_matmul, "AVX512-BF16")}


@pytest.mark.parametrize("kind,group", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 5, 6, 7, 16, 17, 33, 64, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", BF16_KERNELS)
def test_bf16_kernels_are_the_bf16_gemm_on_the_dequantized_weight(kernel, kind, group, m, dtype):
    """Token counts across the AMX kernel's C-tile layouts (up to 16: even/odd groups; 32: 2 x 2; more:
    4 token blocks per pass, 70 = a pass of 4 and one of 2) and the dot-product kernel's blocks of 6
    (7, 17: a block and a tail), 37 rows (a tile past the last row, a 4-row block of 1), K of 6 and 18
    groups (odd counts: the even/odd split's tail)."""
    supported, matmul, needs = BF16_KERNELS[kernel]
    if not supported():
        pytest.skip(f"this CPU has no {needs} (the kernel is built only for one that has)")
    for k in (192, 576):
        gen = torch.Generator().manual_seed(m * k)
        w = quantize(torch.randn(37, k, generator=gen) * 0.05, kind, group)
        x = torch.randn(m, k, generator=gen).to(dtype)
        got = matmul(x, w)
        assert got.dtype == dtype and got.shape == (m, 37)
        want = reference_matmul(x, w, dense_dtype=torch.bfloat16)
        torch.testing.assert_close(got.float(), want, **BF16_TOLERANCE)


FAKE_AMX = CpuCaps(library=True, native_bf16=True, amx=True, dpbf16=True, int8_dot=True)
FAKE_DPBF16 = dataclasses.replace(FAKE_AMX, amx=False)


@pytest.mark.parametrize("caps,wins,want", [
    (FAKE_AMX, True, "int8 1-2, amx 3-191, dense 192-"),
    (FAKE_DPBF16, True, "int8 1-4, dpbf16 5-191, dense 192-"),
    # where the dot products do not win, the float kernel keeps their calls, even past the dense threshold
    (FAKE_DPBF16, False, "int8 1-4, float 5-191, dense 192-"),
    (CpuCaps(library=True, int8_dot=True), True, "int8 1-4, float 5-95, dense 96-"),
    (CpuCaps(library=True), True, "float 1-95, dense 96-"),
    (CpuCaps(), True, "reference 1-")])
def test_each_weight_gets_one_table_of_kernels_by_token_count(caps, wins, want):
    """Decision logic on any CPU (capabilities faked): the plan is built once per weight from the table."""
    w = quantize(torch.randn(16, 256, generator=torch.Generator().manual_seed(9)), "q4")
    assert quant.plan(w, tune(dpbf16_wins=wins), caps).describe() == want
    odd = quantize(torch.randn(16, 240), "q8", 48)  # groups of 48: not whole 32s, so no bf16 or int8 kernel
    assert quant.plan(odd, tune(dpbf16_wins=wins), caps).names[0] in ("float", "reference")


def test_a_call_runs_the_kernel_its_token_count_names(monkeypatch):
    taken = []
    for name in ("amx", "int8", "dense"):
        monkeypatch.setattr(quant, f"{name}_matmul", lambda x, w, *a, name=name: taken.append((name, x.shape[0]))
                            or reference_matmul(x, w))
    gen = torch.Generator().manual_seed(9)
    w = quantize(torch.randn(16, 256, generator=gen), "q4")
    plan = quant.plan(w, tune(), FAKE_AMX)
    for tokens in (2, 3, 191, 192):
        plan(torch.randn(tokens, 256, generator=gen))
    assert taken == [("int8", 2), ("amx", 3), ("amx", 191), ("dense", 192)]


@pytest.mark.parametrize("amx", [True, False])
def test_q4_is_kept_in_tile_order_where_the_amx_kernel_reads_it(amx):
    """The engine's layout is the tile order where our AMX kernel runs, by rows elsewhere; q8 stays by rows. A
    weight in tile order takes the tile kernel from 1 token up to the table's bound, the dense GEMM from there;
    narrowed, the calls outside go to the kernels by rows."""
    gen = torch.Generator().manual_seed(4)
    w = quantize(torch.randn(20, 64, generator=gen), "q4")
    kept = quant.for_this_cpu(w, amx)
    assert kept.tiles == amx and not quant.for_this_cpu(quantize(torch.randn(20, 64, generator=gen), "q8"), amx).tiles
    if not amx:
        return
    assert quant.plan(kept, tune(), FAKE_AMX).describe() == "amx 1-319, dense 320-"
    narrowed = quant.plan(kept, tune(amx_tile_order_tokens=(3, 320)), FAKE_AMX)
    assert narrowed.describe() == "int8 1-2, amx 3-319, dense 320-"


def q4_weight(rows_: int, k: int, scales: torch.dtype, gen: torch.Generator):
    """q4 with float32 scales (quantized at load) or scales float16 holds exactly (a GGUF's)."""
    if scales == torch.float32:
        return quantize(torch.randn(rows_, k, generator=gen) * 0.05, "q4")
    d, m = (torch.randn(rows_, k // 32, generator=gen) * s for s in (0.01, 0.05))
    return quant.q4_from_values(torch.randint(0, 16, (rows_, k), generator=gen), d.half().float(), m.half().float())


@pytest.mark.parametrize("scales", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows_", [16, 37])
def test_tile_order_keeps_the_bits_and_scales(rows_, scales):
    """`pack_tiles` only reorders (scales in float16 only where it holds them exactly): unpacked it is the
    weight again, and the reference, the C dequantizer, `rows` and `concat` read the same values from it
    (the rows past N are zeros, not served)."""
    gen = torch.Generator().manual_seed(rows_)
    w = q4_weight(rows_, 96, scales, gen)
    tiles = quant.pack_tiles(w)
    padded = -(-rows_ // 16)
    assert tiles.tiles and tiles.q.shape == (padded, 3, 16, 16) and tiles.d.shape == (padded, 3, 16)
    assert tiles.d.dtype == tiles.m.dtype == scales
    back = quant.unpack_tiles(tiles)
    assert not back.tiles and all(torch.equal(a, b) for a, b in ((back.q, w.q), (back.d, w.d), (back.m, w.m)))
    assert torch.equal(dequantize(tiles), dequantize(w))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(quant.dequantized(tiles, dtype), quant.dequantized(w, dtype))
    order = torch.randperm(rows_, generator=gen)
    assert torch.equal(dequantize(rows(tiles, order)), dequantize(w)[order])
    assert torch.equal(dequantize(concat([tiles, w])), torch.cat([dequantize(w)] * 2))
    with pytest.raises(ValueError, match="by rows"):
        quant.pack_tiles(tiles)


@pytest.mark.skipif(not cpu_kernels.amx_supported(), reason="the tile kernel needs AMX")
@pytest.mark.parametrize("tokens", [1, 2, 3, 16, 17, 33, 64, 191, 319, 320])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [torch.float32, torch.float16])
def test_tile_order_gives_the_numbers_of_the_kernels_by_rows(tokens, dtype, scales):
    """The tile kernel reading the tile order (one stream; float32 or float16 scales) gives exactly what it
    gives on the rows, from 1 token on (including the last 16-row tile's padding: 37 rows); past
    AMX_TILE_ORDER_TOKENS, the dense GEMM's numbers; an activation format asked for by name, the rows'."""
    gen = torch.Generator().manual_seed(tokens)
    w = q4_weight(37, 576, scales, gen)
    tiles = quant.pack_tiles(w)
    assert tiles.d.dtype == scales
    x = torch.randn(tokens, 576, generator=gen).to(dtype)
    table = autotune.resolve(CAPS.native_bf16, CAPS.dpbf16, CAPS.amx, kernel_seconds=quant.kernel_seconds)
    got = quantized_matmul(x, tiles, table)
    assert got.dtype == dtype
    if tokens < table.amx_tile_order_tokens[1]:
        assert torch.equal(got, quant.amx_matmul(x, w))
    else:
        dense = table.torch_dense_dtype
        assert torch.equal(got, torch.nn.functional.linear(x.to(dense), quant.dequantized(w, dense)).to(dtype))
    torch.testing.assert_close(got.float(), reference_matmul(x, w, dense_dtype=torch.bfloat16), **BF16_TOLERANCE)
    for kernel in (quant.float_matmul, quant.int8_matmul):  # a narrowed table's calls by rows
        assert torch.equal(kernel(x, quant.unpack_tiles(tiles)), kernel(x, w))


@pytest.mark.parametrize("tokens", [1, 8, 40])
def test_bf16_activations_come_back_in_bf16(tokens):
    """A bf16 model's activations: each path (int8 at 1 token, the float kernel or a bf16 one at 8, the
    dense GEMM at 40) returns bf16, within a bf16 rounding of the float32 answer."""
    table = dataclasses.replace(autotune.resolve(CAPS.native_bf16, CAPS.dpbf16, CAPS.amx,
                                                 kernel_seconds=quant.kernel_seconds), dense_tokens_f32=32,
                                dense_tokens_bf16=32)
    gen = torch.Generator().manual_seed(tokens)
    w = quantize(torch.randn(48, 256, generator=gen) * 0.05, "q4")
    x = torch.randn(tokens, 256, generator=gen).bfloat16()
    got = quantized_matmul(x, w, table)
    assert got.dtype == torch.bfloat16
    kernel = quant.route(w, tokens, table, CAPS)
    if kernel in ("amx", "dpbf16") or kernel == "dense" and table.dense_dtype == "bfloat16":  # w rounded too
        want = reference_matmul(x, w, dense_dtype=torch.bfloat16)
    else:
        want = reference_matmul(x.float(), w, int8_activations=kernel == "int8")
    torch.testing.assert_close(got.float(), want, **BF16_TOLERANCE)


@pytest.mark.parametrize("kind,group,bound", [("q4", None, 1 / 30), ("q8", None, 1 / 254), ("q8", 32, 1 / 254)])
def test_quantizing_at_load_stays_within_half_a_step(kind, group, bound):
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    w = quantize(weight, kind, group)
    err = (dequantize(w) - weight).abs()
    span = weight.abs().amax() * 2 if kind == "q4" else weight.abs().amax()
    assert err.max() <= span * bound * 1.01
    assert w.nbytes() / weight.numel() <= (0.75 if kind == "q4" else 1.125)  # bytes per weight (float32: 4)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_gguf_blocks_are_read_bit_for_bit(type_name):
    from gguf import GGMLQuantizationType, quants

    kind = getattr(GGMLQuantizationType, type_name)
    weight = np.random.default_rng(0).standard_normal((24, 128)).astype(np.float32)
    raw = quants.quantize(weight, kind)
    w = from_gguf(raw, type_name, 128)
    expected = torch.from_numpy(quants.dequantize(raw, kind))
    torch.testing.assert_close(dequantize(w), expected, atol=1e-6, rtol=1e-6)
    x = torch.randn(5, 128)
    torch.testing.assert_close(quant.float_matmul(x, w), x @ expected.T, atol=2e-5, rtol=1e-5)


def test_rows_and_concat_keep_each_row_with_its_scales():
    a, b = (quantize(torch.randn(8, 64, generator=torch.Generator().manual_seed(s)), "q4") for s in (1, 2))
    order = torch.tensor([3, 0, 7, 1, 2, 6, 5, 4])
    torch.testing.assert_close(dequantize(rows(a, order)), dequantize(a)[order])
    torch.testing.assert_close(dequantize(concat([a, b])), torch.cat([dequantize(a), dequantize(b)]))
    with pytest.raises(ValueError):
        concat([a, quantize(torch.randn(8, 64), "q8")])


def test_shapes_the_formats_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), "q4")
    with pytest.raises(ValueError, match="groups"):
        quantize(torch.randn(4, 64), "q8", 12)
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize(torch.randn(4, 64), "q3")


def test_a_plan_can_hand_its_larger_calls_to_another_kernel():
    """A tied 8-bit head whose values are also bf16 AMX tiles: the plan below the bound, the tiles from it."""
    w = quantize(torch.randn(16, 256, generator=torch.Generator().manual_seed(2)), "q8", 32)
    taken = []
    plan = quant.plan(w, tune(), FAKE_AMX).taking_from(3, "head tiles", lambda x: taken.append(len(x)) or x[:, :16])
    assert plan.describe() == "int8 1-2, head tiles 3-"
    plan(torch.randn(3, 256))
    assert taken == [3]
