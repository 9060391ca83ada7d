"""The Ray Serve application's parts that need no Ray: which adapter a request is routed by, the
in-process ASGI call (disconnects reach the app), the catalog's bookkeeping, merged metrics."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.adapters.registry import AdapterInfo
from loraplex.api.ray_serve import AdapterCatalog, ClusterConfig, adapter_named, call_asgi, merge_metrics


BASE = "base-model"


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_the_adapter_a_request_is_routed_by():
    chat = "/v1/chat/completions"
    assert adapter_named("POST", chat, body(model=f"{BASE}:ex"), BASE) == "ex"
    assert adapter_named("POST", chat, body(model="ex"), BASE) == "ex"
    assert adapter_named("POST", "/v1/completions", body(model="ex"), BASE) == "ex"
    assert adapter_named("POST", chat, body(model=BASE), BASE) is None  # the base: spread over replicas
    assert adapter_named("POST", "/v1/load_lora_adapter", body(lora_name="new", lora_path="p"), BASE) == "new"
    assert adapter_named("POST", "/v1/unload_lora_adapter", body(lora_name="new"), BASE) is None
    assert adapter_named("GET", "/v1/models", b"", BASE) is None
    for bad in (b"{", b"[1]", body(model=3), body(model=""), b"\xff"):  # the replica's app answers these
        assert adapter_named("POST", chat, bad, BASE) is None


def _request(path="/", method="GET") -> dict:
    return {"method": method, "path": path, "query_string": b"", "headers": [], "client": ["127.0.0.1", 1]}


def test_call_asgi_streams_and_a_client_that_leaves_is_a_disconnect():
    seen: list[str] = []

    async def app(scope, receive, send):
        message = await receive()
        assert message["body"] == b"payload" and scope["path"] == "/stream"
        await send({"type": "http.response.start", "status": 201, "headers": [(b"a", b"1")]})
        await send({"type": "http.response.body", "body": b"one", "more_body": True})
        seen.append((await receive())["type"])  # blocks until the caller leaves

    async def run():
        replies = call_asgi(app, _request("/stream"), b"payload", [(b"x-replica", b"r1")])
        start = await anext(replies)
        assert start == {"status": 201, "headers": [(b"a", b"1"), (b"x-replica", b"r1")]}
        assert await anext(replies) == b"one"
        await replies.aclose()

    asyncio.run(run())
    assert seen == ["http.disconnect"]


def test_call_asgi_ends_with_the_body():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"whole"})

    async def run():
        return [m async for m in call_asgi(app, _request(), b"", [])]

    assert asyncio.run(run()) == [{"status": 200, "headers": []}, b"whole"]


def _info(name: str) -> AdapterInfo:
    return AdapterInfo(name, f"/adapters/{name}", 8, "hash-" + name, True, ("q_proj",))


def test_the_catalog_registers_once_and_unregister_waits_for_live_replicas():
    async def run():
        catalog = AdapterCatalog([_info("a")])
        assert await catalog.register(_info("b")) and not await catalog.register(_info("b"))
        assert [a.name for a in await catalog.list()] == ["a", "b"]
        version, names = await catalog.report("r1", -1, "")
        assert version == 1 and [a.name for a in names] == ["a", "b"]
        assert await catalog.report("r1", version, "") == (1, None)  # nothing new

        removal = asyncio.ensure_future(catalog.unregister("b"))
        await asyncio.sleep(0.2)
        assert not removal.done()  # r1 has not seen it yet
        version, names = await catalog.report("r1", version, "m1")
        assert [a.name for a in names] == ["a"]
        await catalog.report("r1", version, "m1")
        assert await asyncio.wait_for(removal, 2)
        assert not await catalog.unregister("b")  # already gone
        assert await catalog.metrics() == {"r1": "m1"}

    asyncio.run(run())


def test_merged_metrics_label_each_replica_and_stay_parseable():
    text = ("# HELP loraplex:generation_tokens_total Tokens generated.\n# TYPE loraplex:generation_tokens_total counter\n"
            "loraplex:generation_tokens_total {n}\n"
            "# HELP loraplex:num_requests_running Sequences.\n# TYPE loraplex:num_requests_running gauge\n"
            'loraplex:num_requests_running {n}\n')
    merged = merge_metrics({"r1": text.format(n=3), "r2": text.format(n=5)}).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    tokens = families["loraplex:generation_tokens"]
    assert tokens.type == "counter"
    assert {(s.labels["replica"], s.value) for s in tokens.samples} == {("r1", 3.0), ("r2", 5.0)}
    assert merged.count("# TYPE loraplex:num_requests_running gauge") == 1


def test_cluster_config_refuses_nonsense():
    for bad in (dict(replicas=0), dict(replicas=3, max_replicas=2), dict(routing="random"),
                dict(max_adapters_per_replica=0)):
        with pytest.raises(ValueError):
            ClusterConfig(**bad)


def test_an_evicted_adapter_is_unloaded_once_its_requests_end(tiny_model_dir, tiny_adapters):
    """Ray's multiplexing LRU evicts by calling `__del__` on what the hook returned, from a worker
    thread: the replica unloads the adapter at once if no request holds it, else when the last
    one ends, and not at all if it was held again meanwhile."""
    import threading
    import types

    import torch

    from loraplex.adapters.registry import AdapterRegistry
    from loraplex.api.replica import EngineReplica, _Held
    from loraplex.platform.config import ModelConfig

    registry = AdapterRegistry(ModelConfig.from_folder(tiny_model_dir), 2, 16, None, torch.float32)
    for name, path in zip("abc", tiny_adapters):
        registry.load(name, str(path))

    async def run():
        replica = object.__new__(EngineReplica)  # its state only: no Ray, no engine
        replica.client, replica.replica = types.SimpleNamespace(unload_adapter=registry.unload), "r1"
        replica.held, replica.loop = {"a", "b", "c"}, asyncio.get_running_loop()

        def evict(name: str) -> None:  # as Ray does it: off the event loop
            thread = threading.Thread(target=_Held(replica, name).__del__)
            thread.start()
            thread.join()

        evict("a")
        await asyncio.sleep(0.05)
        assert "a" not in {i.name for i in registry.list()}  # idle: gone at once
        registry.pin("b")
        evict("b")
        await asyncio.sleep(0.6)
        assert "b" in {i.name for i in registry.list()}  # a request still runs on it
        registry.unpin("b")
        await asyncio.sleep(0.6)
        assert "b" not in {i.name for i in registry.list()}
        registry.pin("c")
        evict("c")
        replica.held.add("c")  # a new request brought it back before the old one ended
        registry.unpin("c")
        await asyncio.sleep(0.6)
        assert "c" in {i.name for i in registry.list()}

    asyncio.run(run())
