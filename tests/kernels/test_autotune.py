"""One autotune table: thresholds from the benchmarks plus the probes' choices, measured once per machine
(CPU flags, torch build, kernel source), cached in one file; `dtype=auto` is the candidate whose times at
batch 1, 16 and 64 multiply to the least, whatever the CPU flags say."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.kernels import autotune, cpu_kernels, quant

SHAPE = autotune.ModelShape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256, layers=2)
FAST_BF16 = {"float32": [2.0, 2.0, 2.0], "float32 plain": [2.0, 3.0, 2.0], "bfloat16": [1.0, 1.0, 1.0]}
FAST_PLAIN = {"float32": [2.0, 2.0, 2.0], "float32 plain": [1.0, 2.0, 2.0], "bfloat16": [3.0, 3.0, 3.0]}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("times,expected", [
    (FAST_BF16, ("bfloat16", True)),
    ({"float32": [1e-3, 4e-3, 9e-3], "float32 plain": [2e-3, 4e-3, 9e-3], "bfloat16": [3e-3, 9e-3, 9e-3]},
     ("float32", True)),
    # plain rows 1.2x faster at batch 1, 1.1x slower at 64: each batch size counts alike, so they win; a sum of
    # the times would have let batch 64 decide
    ({"float32": [12e-3, 40e-3, 100e-3], "float32 plain": [10e-3, 40e-3, 110e-3], "bfloat16": [50e-3, 90e-3, 1.0]},
     ("float32", False))])
def test_the_fastest_measured_candidate_wins(times, expected):
    dtype, packed, why = autotune.choose_dtype(times)
    assert (dtype, packed) == expected
    assert "float32 " in why and "float32 plain " in why and "bfloat16 " in why and "batch 1 + 16 + 64" in why


def test_the_dtype_probe_is_real_and_cached(cache, monkeypatch):
    from loraplex.platform.resolve import probe_linear

    first = autotune.resolve_dtype(SHAPE, probe_linear, native_bf16=False)
    times = json.loads((cache / "autotune.json").read_text())
    entry = next(v for k, v in times.items() if "/dtype/" in k)
    assert set(entry) == set(autotune.DTYPE_CANDIDATES) and all(len(t) == 3 and min(t) > 0 for t in entry.values())
    monkeypatch.setattr(autotune, "probe_matmuls", lambda *a: pytest.fail("measured again"))
    assert autotune.resolve_dtype(SHAPE, probe_linear, native_bf16=False) == first


def test_a_changed_kernel_source_is_measured_again(monkeypatch):
    """The bf16 matmul may be our own C kernel: a new build of it must not reuse the old timing."""
    monkeypatch.setattr(autotune, "probe_matmuls", lambda *a: FAST_BF16)
    assert autotune.resolve_dtype(SHAPE, None, False)[0] == "bfloat16"
    monkeypatch.setattr(autotune, "probe_matmuls", lambda *a: FAST_PLAIN)
    assert autotune.resolve_dtype(SHAPE, None, False)[0] == "bfloat16"  # cached
    monkeypatch.setattr(cpu_kernels, "source_digest", lambda: b"another build")
    assert autotune.resolve_dtype(SHAPE, None, False)[:2] == ("float32", False)


@pytest.mark.parametrize("native,bf16_ms,want", [(False, 1.0, "float32"), (True, 1.0, "bfloat16"),
                                                  (True, 9.0, "float32")])
def test_dense_dtype_is_the_faster_gemm_where_bf16_is_native(native, bf16_ms, want):
    seconds = lambda dtypes: {torch.float32: 2e-3, torch.bfloat16: bf16_ms * 1e-3}  # noqa: E731
    assert autotune.measure_dense_dtype(native, seconds)[0] == want


@pytest.mark.parametrize("dp_ms,wins", [(1.0, True), (1.9, False)])
def test_bf16_dot_products_must_win_by_the_margin(dp_ms, wins):
    seconds = lambda: {"bf16 dot-product": dp_ms * 1e-3, "float": 2e-3}  # noqa: E731
    assert autotune.measure_dpbf16(True, False, 1.15, seconds)[0] == wins
    assert autotune.measure_dpbf16(True, True, 1.15, seconds)[0] is False  # AMX takes those calls
    assert autotune.measure_dpbf16(False, False, 1.15, seconds)[0] is False


def test_the_table_is_measured_once_and_printed_whole(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(autotune, "gemm_seconds", lambda d: calls.append(d) or {torch.float32: 1.0,
                                                                                torch.bfloat16: 2.0})
    unasked = lambda: pytest.fail("no AVX512-BF16 kernel: the dot products are not timed")  # noqa: E731
    table = autotune.resolve(native_bf16=True, dpbf16=False, amx=False, kernel_seconds=unasked)
    assert table.dense_dtype == "float32" and len(calls) == 1
    assert autotune.resolve(native_bf16=True, dpbf16=False, amx=False, kernel_seconds=unasked) == table
    assert len(calls) == 1
    lines = table.lines()
    assert "f32_kernel_tokens=24" in lines[0] and "dense_dtype=" in lines[0]
    assert any(line.startswith("dense_dtype: ") for line in lines)


def test_the_probes_time_real_kernels():
    times = autotune.gemm_seconds((torch.float32, torch.bfloat16), tokens=8, size=64, rounds=1)
    assert set(times) == {torch.float32, torch.bfloat16} and min(times.values()) > 0
    if cpu_kernels.dpbf16_supported():
        kernels = quant.kernel_seconds(tokens=8, size=64, rounds=1)
        assert set(kernels) == {"bf16 dot-product", "float"}
