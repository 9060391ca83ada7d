"""A server that is one of several replicas (`SharedAdapters`, what `loraplex serve --ray` gives
each replica): the shared set decides which names exist, a shared name is read on its first
request, and the admin endpoints change the shared set."""

from __future__ import annotations

import shutil

import pytest

from live_server import http, start_server
from loraplex.adapters.registry import AdapterInfo
from loraplex.api.server import ServerConfig

PROMPT = [5, 9, 14, 3, 22, 7]


class InMemoryShared:
    def __init__(self, adapters: list[AdapterInfo]) -> None:
        self.adapters = {a.name: a for a in adapters}

    async def get(self, name):
        return self.adapters.get(name)

    async def list(self):
        return list(self.adapters.values())

    async def register(self, info):
        return self.adapters.setdefault(info.name, info) is info

    async def unregister(self, name):
        return self.adapters.pop(name, None) is not None


@pytest.fixture(scope="module")
def replica(tiny_model_dir, tiny_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-root")
    for src in tiny_adapters[:3]:
        shutil.copytree(src, root / src.name)
    shared = InMemoryShared([AdapterInfo("a0", str(tiny_adapters[0]), 16, "h0", False, ("q_proj",)),
                             AdapterInfo("a1", str(root / "a1"), 8, "h1", True, ("q_proj",))])
    config = ServerConfig(served_model_name="tiny", adapter_roots=(str(root),))
    server = start_server(tiny_model_dir, config, shared=shared, num_kv_blocks=64, max_num_seqs=8, max_loras=2)
    yield server, shared
    server.stop()


def complete(server, model):
    return http(server, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 4}, key=None)


def local(server) -> set[str]:
    return {a.name for a in server.engine.adapters.list()}


def test_shared_names_are_listed_and_read_on_first_use(replica):
    server, _ = replica
    assert [m["id"] for m in http(server, "/v1/models", key=None)[1]["data"]] == ["tiny", "a0", "a1"]
    assert local(server) == set()
    for model in ("tiny:a0", "a1"):
        status, body = complete(server, model)
        assert status == 200, body
    assert local(server) == {"a0", "a1"}
    assert complete(server, "a9")[0] == 404


def test_a_name_unloaded_elsewhere_is_gone_here_too(replica):
    server, shared = replica
    assert complete(server, "a0")[0] == 200 and "a0" in local(server)
    shared.adapters.pop("a0")  # another replica's unload
    status, body = complete(server, "a0")
    assert status == 404, body  # even though this replica still holds a copy


def test_admin_load_and_unload_change_the_shared_set(replica):
    server, shared = replica
    status, body = http(server, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": "a2"}, key=None)
    assert status == 200, body
    assert shared.adapters["a2"].confined and "a2" in local(server)
    assert http(server, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": "a2"}, key=None)[0] == 400
    assert http(server, "/v1/unload_lora_adapter", {"lora_name": "a2"}, key=None)[0] == 200
    assert "a2" not in shared.adapters
    assert http(server, "/v1/unload_lora_adapter", {"lora_name": "a2"}, key=None)[0] == 404
