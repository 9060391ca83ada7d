"""Hostile specs and adapter folders through a real server on 127.0.0.1: each is a 4xx naming
the problem, fast, and nothing outside the adapter root is ever loaded."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import assert_refused_at_its_first_deadline, spy_on_matches, swapping_in_a_link
from live_server import assert_error, http, start_server
from loraplex.adapters.peft_format import read_peft_adapter
from loraplex.api.server import ServerConfig
from loraplex.platform.models.registry import read_model_config

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    live = start_server(tiny_model_dir, ServerConfig(served_model_name="tiny", adapter_roots=(str(root),)),
                        num_kv_blocks=64, max_loras=2)
    yield live
    live.stop()


def load(server, name, path):
    return http(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, key=None)


def test_hostile_structured_specs(server):
    chat = "/v1/chat/completions"
    for extra, fragment in [({"guided_json": "[" * 50000 + "]" * 50000}, "nests deeper"),
                            ({"guided_json": "null"}, "got null"),
                            ({"structured_outputs": {"regex": "a" * 20000}}, "longer than"),
                            ({"structured_outputs": {"choice": ["x"] * 2000}}, "at most 1024")]:
        assert_error(http(server, chat, {"model": "tiny", "messages": MSG, **extra}, key=None), 400, fragment)
    status, body = http(server, chat, {"model": "tiny", "messages": MSG, "max_tokens": 8,
                                       "structured_outputs": {"choice": ["\U0001F600", "no"]}}, key=None)
    assert status == 200 and body["choices"][0]["message"]["content"] in ("\U0001F600", "no")


def test_hostile_adapter_folders(server, tiny_adapters, monkeypatch):
    root = server.root
    redos = root / "redos"
    shutil.copytree(tiny_adapters[1], redos)
    cfg = json.loads((redos / "adapter_config.json").read_text())
    catastrophic = r"(.|\.|[a-z])*\d\d\d$"
    (redos / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": catastrophic}))
    matches = spy_on_matches(monkeypatch, catastrophic)  # the server's matches (it runs in this process)
    assert_error(load(server, "redos", "redos"), 400, "too long to match")
    assert_refused_at_its_first_deadline(matches)  # fast: at most one short deadline, counted not timed
    linked = root / "hard"
    shutil.copytree(tiny_adapters[1], linked)
    (linked / "adapter_model.safetensors").unlink()
    os.link(tiny_adapters[3] / "adapter_model.safetensors", linked / "adapter_model.safetensors")
    assert_error(load(server, "hard", "hard"), 400, "hard-linked")
    for name, change in [("alpha", {"lora_alpha": [1]}), ("targets", {"target_modules": 5})]:
        shutil.copytree(tiny_adapters[1], root / name)
        (root / name / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
        assert_error(load(server, name, name), 400, list(change)[0])
    (root / "loop").symlink_to(root / "loop")
    assert 400 <= load(server, "loop", "loop")[0] < 500
    assert_error(load(server, "long", "n" * 300), 400, "lora_path")
    assert {a.name for a in server.engine.adapters.list()} == set()
    assert http(server, "/health", key=None)[0] == 200


def test_a_link_swapped_in_during_admin_loads_never_loads_outside(server, tiny_model_dir, tiny_adapters):
    config = read_model_config(tiny_model_dir)
    inside = server.root / "inner"
    shutil.copytree(tiny_adapters[0], inside)
    outside_hash = read_peft_adapter("o", tiny_adapters[2], config, 16).content_hash
    loaded = 0
    with swapping_in_a_link(inside / "adapter_model.safetensors", tiny_adapters[2] / "adapter_model.safetensors"):
        for i in range(400):  # at least 80 loads, then until one succeeded (bounded)
            status, _ = load(server, f"t{i}", "inner")
            assert status in (200, 400, 404)
            loaded += status == 200
            if i >= 80 and loaded:
                break
    hashes = {a.content_hash for a in server.engine.adapters.list()}
    assert loaded and outside_hash not in hashes
