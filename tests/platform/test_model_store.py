"""Default-model materialization: cache dir override, atomic conversion, idempotence."""

import pytest

from loraplex.platform import model_store


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path))
    return tmp_path


def fake_convert(gguf, out):
    for name in model_store.REQUIRED_FILES:
        (out / name).write_text("{}")


def test_cache_dir_override(cache):
    assert model_store.default_model_dir() == cache / "models" / "SmolLM2-135M-Instruct"


def test_interrupted_conversion_leaves_no_half_folder(cache, monkeypatch):
    def crash(gguf, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(model_store, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        model_store.materialize_default_model()
    models = cache / "models"
    assert not (models / "SmolLM2-135M-Instruct").exists()
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


def test_converts_once_then_reuses(cache, monkeypatch):
    calls = []

    def convert(gguf, out):
        calls.append(gguf)
        fake_convert(gguf, out)

    monkeypatch.setattr(model_store, "_convert", convert)
    first = model_store.materialize_default_model()
    assert model_store.is_complete(first) and len(calls) == 1
    assert model_store.materialize_default_model() == first and len(calls) == 1


def test_half_folder_from_elsewhere_is_replaced(cache, monkeypatch):
    target = model_store.default_model_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    monkeypatch.setattr(model_store, "_convert", fake_convert)
    assert model_store.is_complete(model_store.materialize_default_model())
