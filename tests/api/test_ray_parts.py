"""The Ray Serve application's parts that need no Ray: which adapter a request is routed by, the
in-process ASGI call (disconnects reach the app), the catalog's bookkeeping, merged metrics,
stats and adapter lists."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.adapters.registry import AdapterInfo
from loraplex.api.cluster.in_process import call_asgi
from loraplex.api.cluster.ray_catalog import AdapterCatalog
from loraplex.api.cluster.ray_ingress import adapter_named
from loraplex.api.cluster.ray_merge import (merge_adapters, merge_metrics, merge_stats, merge_usage, scoped_stats,
                                    tenant_adapters)
from loraplex.api.settings import ClusterConfig


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


def test_a_mix_is_routed_by_its_heaviest_adapter_and_a_malformed_one_as_the_base():
    chat = "/v1/chat/completions"
    mix = [{"name": "a", "weight": 0.7}, {"name": "b", "weight": -0.9}, {"name": "c", "weight": 0.9}]
    assert adapter_named("POST", chat, body(model=BASE, adapters=mix), BASE) == "b"  # |weight|, first of equals
    assert adapter_named("POST", "/v1/completions", body(model=BASE, adapters=[{"name": "a"}]), BASE) == "a"
    assert adapter_named("POST", chat, body(model=BASE, adapters=[{"name": f"{BASE}:a", "weight": 1}]), BASE) == "a"
    for bad in ([], "a", [{"weight": 1}], [{"name": "a", "weight": "x"}], [{"name": "a", "weight": True}],
                [{"name": "a"}, 3], [{"name": 5, "weight": 1}]):
        assert adapter_named("POST", chat, body(model="ex", adapters=bad), BASE) is None, bad


def test_stats_merge_over_replicas():
    one = {"time": 1.0, "num_requests_running": 2, "kv_cache_usage_perc": 0.2, "max_loras": 4,
           "running_adapters": ["a"], "requests": 5, "ttft_ms": {"p50": 10.0, "p99": 30.0, "count": 4}}
    two = {"time": 2.0, "num_requests_running": 1, "kv_cache_usage_perc": 0.4, "max_loras": 4,
           "running_adapters": ["b", "a"], "requests": 7, "ttft_ms": {"p50": 20.0, "p99": None, "count": 0}}
    merged = merge_stats({"r2": two, "r1": one})
    assert merged["num_requests_running"] == 3 and merged["requests"] == 12 and merged["max_loras"] == 8
    assert merged["kv_cache_usage_perc"] == pytest.approx(0.3) and merged["time"] == 2.0
    assert merged["running_adapters"] == ["a", "b"]
    assert merged["ttft_ms"] == {"p50": 20.0, "p99": 30.0, "count": 4}  # the worst replica's
    assert list(merged["replicas"]) == ["r1", "r2"] and merged["replicas"]["r1"] == one
    assert merge_stats({}) == {"replicas": {}}


def test_the_adapter_list_names_the_replicas_holding_each_adapter():
    def row(name, requests=0, in_memory=False):
        return {"id": name, "rank": 8, "resident": False, "in_memory": in_memory, "pinned": 0,
                "requests": requests, "generation_tokens": 2 * requests}

    reply = {"object": "list", "data": [row("a"), row("b"), row("cold")], "base": {"requests": 1}}
    merged = merge_adapters(reply, {"r2": [row("a", 3, True), row("b", 1, True)], "r1": [row("a", 2, True)]})
    by_id = {r["id"]: r for r in merged["data"]}
    assert by_id["a"]["replicas"] == ["r1", "r2"] and by_id["a"]["requests"] == 5
    assert by_id["a"]["generation_tokens"] == 10 and by_id["a"]["in_memory"]
    assert by_id["b"]["replicas"] == ["r2"] and by_id["cold"]["replicas"] == []
    assert not by_id["cold"]["in_memory"] and by_id["cold"]["rank"] == 8
    assert merged["base"] == {"requests": 1}


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
        assert await catalog.views() == {}
        await catalog.report("r1", version, "m1", {"stats": {}, "adapters": []})
        assert await catalog.views() == {"r1": {"stats": {}, "adapters": []}}

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
    from loraplex.api.cluster.replica import EngineReplica, _Held
    from loraplex.platform.models.registry import read_model_config

    registry = AdapterRegistry(read_model_config(tiny_model_dir), 2, 16, None, torch.float32)
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


def test_tenants_across_replicas_usage_adds_up_stats_keep_the_scope_and_reloads_spread():
    """#42 on Ray: `/v1/usage` sums the replicas'; a tenant's merged stats name only its adapters (and no
    per-replica detail); a reload bumps the catalog's version, which the other replicas follow."""
    one = {"tenants": {"acme": {"requests": 2, "generation_tokens": 10}}, "adapters": {"acme-a": {"requests": 2}},
           "totals": {"requests": 2}}
    two = {"tenants": {"acme": {"requests": 1, "generation_tokens": 4}, "globex": {"requests": 3}},
           "adapters": {"acme-a": {"requests": 1}}, "totals": {"requests": 4}}
    assert merge_usage([one, two]) == {
        "tenants": {"acme": {"requests": 3, "generation_tokens": 14}, "globex": {"requests": 3}},
        "adapters": {"acme-a": {"requests": 3}}, "totals": {"requests": 6}}
    def acme(running, requests, served):  # acme's own numbers in a replica's stats
        return {"num_requests_running": running, "running_adapters": ["acme-a"] if running else [],
                "requests": requests, "ttft_ms": {"p50": 5.0, "p99": 9.0, "count": requests},
                "served": {"acme-a": {"requests": requests, "generation_tokens": 3 * requests}}}

    merged = merge_stats({"r1": {"running_adapters": ["acme-a", "globex-b"], "waiting_adapters": ["globex-c"],
                                 "num_requests_running": 5, "kv_cache_usage_perc": 0.5,
                                 "tenants": {"acme": acme(1, 2, 2)}},
                          "r2": {"running_adapters": [], "waiting_adapters": [], "num_requests_running": 0,
                                 "kv_cache_usage_perc": 0.1,
                                 "tenants": {"acme": acme(0, 1, 1), "globex": acme(3, 3, 3)}}})
    admin = scoped_stats(merged, {})
    assert admin["num_requests_running"] == 5 and "tenants" not in admin and "tenants" not in admin["replicas"]["r2"]
    # a tenant reads its own numbers added up over the replicas, nothing of the engines' (#49)
    scoped = scoped_stats(merged, {"adapter_scope": ["acme-*"], "tenant": "acme"})
    assert scoped["running_adapters"] == ["acme-a"] and scoped["num_requests_running"] == 1
    assert scoped["requests"] == 3 and scoped["ttft_ms"]["count"] == 3
    assert "replicas" not in scoped and "kv_cache_usage_perc" not in scoped and "served" not in scoped
    assert scoped_stats(merged, {"tenant": "initech", "requests": 0}) == {"tenant": "initech", "requests": 0}
    reply = {"object": "list", "data": [{"id": "acme-a", "rank": 8, "requests": 2}], "base": {}, "tenant": "acme"}
    rows = tenant_adapters(reply, [acme(1, 2, 2)["served"], {}, acme(0, 1, 1)["served"]])
    assert rows["data"] == [{"id": "acme-a", "rank": 8, "requests": 3, "generation_tokens": 9}]
    assert rows["base"] == {"requests": 0, "generation_tokens": 0}

    async def run():
        catalog = AdapterCatalog([])
        assert await catalog.tenants() == 0
        assert await catalog.tenants_reloaded() == 1 and await catalog.tenants() == 1

    asyncio.run(run())
