"""The engine's config is resolved once before anything is built (`platform/resolve.py`): `dtype=auto` from
the autotune probe, the float32 layout it measured, quantization read from a checkpoint, every choice logged."""

from __future__ import annotations

import logging

import pytest
import torch

from loraplex.kernels import autotune
from loraplex.kernels.linear_methods import can_pack
from loraplex.platform.config import EngineConfig
from loraplex.platform.engine.llm_engine import Engine
from loraplex.platform.models.linear import Linear
from loraplex.platform.resolve import resolve

FAST_BF16 = {"float32": [2.0, 2.0, 2.0], "float32 plain": [2.0, 3.0, 2.0], "bfloat16": [1.0, 1.0, 1.0]}
FAST_PLAIN = {"float32": [2.0, 2.0, 2.0], "float32 plain": [1.0, 2.0, 2.0], "bfloat16": [3.0, 3.0, 3.0]}
FAST_PACKED = {"float32": [1.0, 1.0, 1.0], "float32 plain": [1.0, 2.0, 1.0], "bfloat16": [3.0, 3.0, 3.0]}


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """Sets what the dtype probe measures (each engine a fresh cache)."""
    def set_times(times):
        monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path / str(id(times))))
        monkeypatch.setattr(autotune, "probe_matmuls", lambda *a: times)
    return set_times


def test_the_engine_resolves_auto_once_and_logs_why(tiny_model_dir, probe, caplog):
    probe(FAST_BF16)
    with caplog.at_level(logging.INFO, logger="loraplex"):
        engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16))
    assert engine.config.dtype == "bfloat16" and engine.core.executor.worker.runner.kv_cache.dtype == torch.bfloat16
    assert "dtype auto -> bfloat16 (probe of the decode step's matmuls" in caplog.text
    assert "autotune: f32_kernel_tokens=" in caplog.text and "kernels: " in caplog.text
    explicit = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16))
    assert explicit.config.dtype == "float32"


@pytest.mark.parametrize("pack_weights", [True, False])
def test_plain_rows_measured_faster_leave_float32_weights_unpacked(tiny_model_dir, probe, caplog, pack_weights):
    if not can_pack(torch.float32, False):
        pytest.skip("no oneDNN in this torch build: float32 weights are never packed")
    for times, packed in ((FAST_PLAIN, False), (FAST_PACKED, pack_weights)):
        probe(times)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="loraplex"):
            engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, pack_weights=pack_weights))
        assert engine.config.dtype == "float32" and engine.config.pack_weights == packed
        linears = [m for m in engine.core.executor.worker.model.modules() if isinstance(m, Linear)]
        assert linears and all((getattr(m, "packed", None) is not None) == packed for m in linears)
        layout = "packed" if packed else "plain"
        assert f"dtype auto -> float32, weights {layout} (probe" in caplog.text


def test_the_resolved_config_is_frozen_and_complete(tiny_model_dir, probe):
    probe(FAST_PLAIN)
    resolved = resolve(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=1 << 20))
    assert resolved.engine.dtype == "float32" and resolved.kernels.dtype == torch.float32
    assert resolved.device == torch.device("cpu") and resolved.max_model_len > 0 and resolved.max_loras >= 1
    assert resolved.num_kv_blocks >= 1  # from kv_cache_memory: known before the model loads on CPU
    with pytest.raises(AttributeError):
        resolved.max_loras = 3
