"""`dtype="auto"`: float32 without native bf16 (no probe), else whichever dtype the probe
measures faster; the probe is real, cached per machine and model shape, and the engine logs
the choice."""

from __future__ import annotations

import pytest
import torch

from loraplex.platform import dtype_probe
from loraplex.platform.config import EngineConfig, ModelConfig


@pytest.fixture
def model(tiny_model_dir) -> ModelConfig:
    return ModelConfig.from_folder(tiny_model_dir)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("times,expected", [({"float32": 2e-3, "bfloat16": 1e-3}, "bfloat16"),
                                            ({"float32": 1e-3, "bfloat16": 3e-3}, "float32")])
def test_the_faster_measured_dtype_wins_whatever_the_flags(model, monkeypatch, times, expected, native):
    monkeypatch.setattr(dtype_probe, "native_bf16", lambda: native)
    chosen, why = dtype_probe.resolve_dtype(model, probe=lambda m: times)
    assert chosen == expected and "float32 " in why and "bfloat16 " in why
    assert ("bf16 native" in why) == native


def test_the_probe_measures_both_and_is_cached(model, monkeypatch, tmp_path):
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path))
    first = dtype_probe.cached_probe(model)
    assert set(first) == {"float32", "bfloat16"} and all(t > 0 for t in first.values())
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
    monkeypatch.setattr(dtype_probe, "probe_matmuls", lambda m: {"float32": 2.0, "bfloat16": 1.0})
    assert dtype_probe.cached_probe(model)["bfloat16"] == 1.0
    source.write_bytes(source.read_bytes() + b"\n/* changed */\n")
    monkeypatch.setattr(dtype_probe, "probe_matmuls", lambda m: {"float32": 1.0, "bfloat16": 2.0})
    assert dtype_probe.cached_probe(model)["bfloat16"] == 2.0


def test_the_engine_resolves_auto_once_and_logs_why(tiny_model_dir, monkeypatch, capsys):
    from loraplex.platform.engine import Engine

    monkeypatch.setattr(dtype_probe, "cached_probe", lambda m: {"float32": 2.0, "bfloat16": 1.0})
    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16))
    assert engine.config.dtype == "bfloat16" and engine.runner.kv_cache.dtype == torch.bfloat16
    assert "dtype auto -> bfloat16 (probe of the decode step's matmuls" in capsys.readouterr().err
    explicit = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16))
    assert explicit.config.dtype == "float32"
