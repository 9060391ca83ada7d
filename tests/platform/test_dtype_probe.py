"""`dtype="auto"`: whichever of bfloat16, float32 packed and float32 on plain rows the probe measures
fastest (at batch 1, 16 and 64 together: the product of the times), whatever the CPU flags say; the
probe is real, cached per machine and model shape, and the engine logs the choice."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.platform import dtype_probe
from loraplex.platform.config import EngineConfig, ModelConfig


@pytest.fixture
def model(tiny_model_dir) -> ModelConfig:
    return ModelConfig.from_folder(tiny_model_dir)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("times,expected", [
    ({"float32": [2e-3, 9e-3, 20e-3], "float32 plain": [2e-3, 9e-3, 20e-3], "bfloat16": [1e-3, 5e-3, 30e-3]},
     ("bfloat16", True)),
    ({"float32": [1e-3, 4e-3, 9e-3], "float32 plain": [2e-3, 4e-3, 9e-3], "bfloat16": [3e-3, 9e-3, 9e-3]},
     ("float32", True)),
    # plain rows 1.2x faster at batch 1, 1.1x slower at 64: each batch size counts alike, so they win; a sum of
    # the times would have let batch 64 decide
    ({"float32": [12e-3, 40e-3, 100e-3], "float32 plain": [10e-3, 40e-3, 110e-3], "bfloat16": [50e-3, 90e-3, 1.0]},
     ("float32", False))])
def test_the_fastest_measured_candidate_wins_whatever_the_flags(model, monkeypatch, times, expected, native):
    monkeypatch.setattr(dtype_probe, "native_bf16", lambda: native)
    chosen, packed, why = dtype_probe.resolve_dtype(model, probe=lambda m: times)
    assert (chosen, packed) == expected
    assert "float32 " in why and "float32 plain " in why and "bfloat16 " in why and "batch 1 + 16 + 64" in why
    assert ("bf16 native" in why) == native


def test_the_probe_measures_both_and_is_cached(model, monkeypatch, tmp_path):
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path))
    first = dtype_probe.cached_probe(model)
    assert set(first) == {"float32", "float32 plain", "bfloat16"}
    assert all(len(times) == 3 and all(t > 0 for t in times) for times in first.values())
    monkeypatch.setattr(dtype_probe, "probe_matmuls", lambda m: pytest.fail("measured again"))
    assert dtype_probe.cached_probe(model) == first
    assert (tmp_path / "dtype-probe.json").is_file()


def test_a_changed_kernel_source_is_measured_again(model, monkeypatch, tmp_path):
    """The bf16 matmul may be our own C kernel (AMX): a new build of it must not reuse the old timing."""
    from loraplex.kernels import cpu_kernels

    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path))
    source = tmp_path / "cpu_kernels.c"
    source.write_bytes(cpu_kernels.SOURCE.read_bytes())
    monkeypatch.setattr(cpu_kernels, "SOURCE", source)
    monkeypatch.setattr(dtype_probe, "probe_matmuls", lambda m: FAST_BF16)
    assert dtype_probe.cached_probe(model) == FAST_BF16
    source.write_bytes(source.read_bytes() + b"\n/* changed */\n")
    monkeypatch.setattr(dtype_probe, "probe_matmuls", lambda m: FAST_PLAIN)
    assert dtype_probe.cached_probe(model) == FAST_PLAIN


def test_an_older_probes_entry_is_measured_again(model, monkeypatch, tmp_path):
    """A cache written before plain rows were a candidate has no timing for them."""
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path))
    (tmp_path / "dtype-probe.json").write_text(json.dumps({dtype_probe._key(model): {"float32": 2.0, "bfloat16": 1.0}}))
    monkeypatch.setattr(dtype_probe, "probe_matmuls", lambda m: FAST_PLAIN)
    assert dtype_probe.cached_probe(model) == FAST_PLAIN


def test_the_engine_resolves_auto_once_and_logs_why(tiny_model_dir, monkeypatch, capsys):
    from loraplex.platform.engine import Engine

    monkeypatch.setattr(dtype_probe, "cached_probe", lambda m: FAST_BF16)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16))
    assert engine.config.dtype == "bfloat16" and engine.runner.kv_cache.dtype == torch.bfloat16
    assert "dtype auto -> bfloat16 (probe of the decode step's matmuls" in capsys.readouterr().err
    explicit = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16))
    assert explicit.config.dtype == "float32"


@pytest.mark.parametrize("pack_weights", [True, False])
def test_plain_rows_measured_faster_leave_float32_weights_unpacked(tiny_model_dir, monkeypatch, capsys,
                                                                   pack_weights):
    from loraplex.platform.engine import Engine
    from loraplex.platform.models.linear import PackedLinear, can_pack

    if not can_pack(torch.float32):
        pytest.skip("no oneDNN in this torch build: float32 weights are never packed")
    for times, packed in ((FAST_PLAIN, False), (FAST_PACKED, pack_weights)):
        monkeypatch.setattr(dtype_probe, "cached_probe", lambda m: times)
        engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, pack_weights=pack_weights))
        assert engine.config.dtype == "float32" and engine.config.pack_weights == packed
        linears = [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
        assert linears and all((m.packed is not None) == packed for m in linears)
        layout = "packed" if packed else "plain"
        assert f"dtype auto -> float32, weights {layout} (probe" in capsys.readouterr().err


FAST_BF16 = {"float32": [2.0, 2.0, 2.0], "float32 plain": [2.0, 3.0, 2.0], "bfloat16": [1.0, 1.0, 1.0]}
FAST_PLAIN = {"float32": [2.0, 2.0, 2.0], "float32 plain": [1.0, 2.0, 2.0], "bfloat16": [3.0, 3.0, 3.0]}
FAST_PACKED = {"float32": [1.0, 1.0, 1.0], "float32 plain": [1.0, 2.0, 1.0], "bfloat16": [3.0, 3.0, 3.0]}
