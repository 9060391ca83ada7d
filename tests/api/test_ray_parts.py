"""The Ray Serve application's parts that need no Ray: which adapter a request is routed by, the
in-process ASGI call (disconnects reach the app), the catalog's bookkeeping, merged metrics,
stats and adapter lists; readiness, and what the ingress answers when a replica dies mid-answer."""

from __future__ import annotations

import asyncio
import json
import types

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.adapters.registry import AdapterInfo
from loraplex.api.cluster.in_process import call_asgi
from loraplex.api.cluster.ray_catalog import AdapterCatalog, Readiness, cluster_readiness
from loraplex.api.cluster.ray_ingress import adapter_named
from loraplex.api.cluster.ray_merge import (merge_adapters, merge_metrics, merge_stats, scoped_stats,
                                    tenant_adapters)
from loraplex.api.openai import openai_format as fmt
from loraplex.api.settings import ClusterConfig


BASE = "base-model"


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_the_adapter_a_request_is_routed_by():
    chat = "/v1/chat/completions"
    assert adapter_named("POST", chat, body(model=f"{BASE}:ex"), BASE) == "ex"
    assert adapter_named("POST", chat, body(model="ex"), BASE) == "ex"
    assert adapter_named("POST", "/v1/completions", body(model="ex"), BASE) == "ex"
    assert adapter_named("POST", "/v1/responses", body(model="ex"), BASE) == "ex"
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


def test_tenants_across_replicas_stats_keep_the_scope_and_reloads_spread():
    """#42 on Ray: a tenant's merged stats name only its adapters (and no per-replica detail); a reload
    bumps the catalog's version, which the other replicas follow."""
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


# ---- readiness, and what a client sees when a replica dies (#68) ------------------------------


def test_the_cluster_is_ready_once_every_replica_wanted_is_reached_and_reports_ready():
    views = {"r1": {"ready": True}, "r2": {"ready": False}, "r3": {"ready": True}}
    assert cluster_readiness(views, ["r1", "r2"], 2, False) == Readiness(False, 1, 2)
    assert cluster_readiness(views, ["r1", "r3"], 2, False) == Readiness(True, 2, 2)
    assert cluster_readiness(views, ["r1"], 2, False).message == "1 of 2 engine replicas ready"
    assert cluster_readiness(views, ["r3", "gone"], 2, False).replicas_ready == 1  # reported, not reached: no
    assert cluster_readiness({"r1": {"ready": True}}, ["r1", "r1"], 2, False).replicas_ready == 1
    # once ready, a replica being replaced leaves the cluster ready while one is (it says how many)
    assert cluster_readiness(views, ["r1"], 2, True) == Readiness(True, 1, 2)
    assert cluster_readiness(views, ["r2"], 2, True) == Readiness(False, 0, 2)

    async def run():
        catalog = AdapterCatalog([])
        await catalog.report("r1", 0, "", {"ready": True})
        await catalog.report("r2", 0, "", {"ready": False})
        assert not (await catalog.readiness(["r1", "r2"], 2)).ready
        assert not (await catalog.readiness(["r1"], 2)).ready  # not yet ready once: one is not enough
        await catalog.report("r2", 0, "", {"ready": True})
        assert (await catalog.readiness(["r1", "r2"], 2)).ready
        assert await catalog.readiness(["r1"], 2) == Readiness(True, 1, 2)

    asyncio.run(run())


def test_a_replica_is_ready_when_its_engine_is_healthy_and_nothing_is_still_starting():
    from loraplex.api.cluster.replica import EngineReplica
    from loraplex.platform.engine.engine_client import Health

    replica = object.__new__(EngineReplica)  # its readiness only: no Ray, no engine
    for health, ready in ((Health(True), True), (Health(True, warming="grammar workers starting"), False),
                          (Health(False), False), (Health(True, closing="shutting down"), False)):
        replica.client = types.SimpleNamespace(health=lambda health=health: health)
        assert replica.ready() is ready, health


class _Remote:
    """A plain object as a Ray actor handle: `handle.method.remote(...)` awaits the method."""

    def __init__(self, target) -> None:
        self.target = target

    def __getattr__(self, name: str):
        return types.SimpleNamespace(remote=getattr(self.target, name))


class _Replies:
    """A replica's replies as Ray streams them: the start, the chunks, then `died` raised (a replica
    killed mid-answer) or the end."""

    def __init__(self, start: dict, chunks: list[bytes], died: bool = False) -> None:
        self.items, self.died, self.cancelled = [start, *chunks], died, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.died:
            raise RuntimeError("ActorDiedError: the replica's process died")
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class _Engines:
    """The engine deployment's handle: every request gets `replies`; `reached` answer the probe."""

    def __init__(self, replies: _Replies | None = None, reached=("r1", "r2")) -> None:
        self.replies, self.reached = replies, list(reached)
        self.forward = types.SimpleNamespace(remote=lambda *args: self.replies)

    def options(self, **_):
        return self

    def broadcast(self, method: str):
        assert method == "reached"

        async def results_async(timeout_s: float, return_exceptions: bool):
            return [*self.reached, RuntimeError("a replica that died")]

        return types.SimpleNamespace(results_async=results_async)


def _http(method: str, path: str, body: bytes = b""):
    from starlette.requests import Request

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000), "scheme": "http", "root_path": ""}

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(scope, receive)


async def _body(response) -> bytes:
    if hasattr(response, "body_iterator"):
        return b"".join([chunk if isinstance(chunk, bytes) else chunk.encode()
                         async for chunk in response.body_iterator])
    return response.body


def _ingress(replies: _Replies | None = None, reached=("r1", "r2"), catalog: AdapterCatalog | None = None):
    from loraplex.api.cluster.ray_ingress import Ingress

    return Ingress(_Engines(replies, reached), _Remote(catalog or AdapterCatalog([])), BASE, "adapter", 1 << 20, 2)


def test_the_ingress_answers_health_and_ready_itself_from_its_router_and_the_catalog():
    async def run():
        catalog = AdapterCatalog([])
        ingress = _ingress(None, ["r1", "r2"], catalog)
        assert (await ingress(_http("GET", "/health"))).status_code == 200  # no replica asked
        await catalog.report("r1", 0, "", {"ready": True})
        await catalog.report("r2", 0, "", {"ready": False})  # grammar workers starting
        response = await ingress(_http("GET", "/ready"))
        assert response.status_code == 503
        assert json.loads(response.body) == fmt.error_body(503, "1 of 2 engine replicas ready")
        await catalog.report("r2", 0, "", {"ready": True})
        response = await ingress(_http("GET", "/ready"))
        assert response.status_code == 200
        assert json.loads(response.body) == {"ready": True, "replicas_ready": 2, "replicas_wanted": 2}
        ingress.engines.reached = ["r1"]  # r2 killed: Ray starts another; r1 serves meanwhile
        assert json.loads((await ingress(_http("GET", "/ready"))).body)["replicas_ready"] == 1
        restarted = _ingress(None, ["r1"], catalog)  # an ingress started again: the catalog remembers
        assert (await restarted(_http("GET", "/ready"))).status_code == 200

    asyncio.run(run())


def test_a_replica_dying_mid_answer_is_a_503_or_for_a_stream_an_error_event_never_a_complete_answer():
    json_start = {"status": 200, "headers": [(b"content-type", b"application/json"), (b"content-length", b"9"),
                                             (b"x-loraplex-replica", b"r1")]}
    sse_start = {"status": 200, "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]}
    chat = ("POST", "/v1/chat/completions", json.dumps({"model": "a"}).encode())

    async def run():
        whole = await _ingress(_Replies(json_start, [b'{"ok": ', b"1}"]))(_http(*chat))
        assert (whole.status_code, whole.body) == (200, b'{"ok": 1}')
        assert (b"x-loraplex-replica", b"r1") in whole.raw_headers

        cut = await _ingress(_Replies(json_start, [b'{"ok": '], died=True))(_http(*chat))
        assert cut.status_code == 503  # read whole before its status is sent: never a 200 with half a body
        assert json.loads(cut.body)["error"]["code"] == 503

        replies = _Replies(sse_start, [b'data: {"choices": []}\n\n'], died=True)
        stream = await _ingress(replies)(_http(*chat))
        assert stream.status_code == 200  # its status line went out with the first chunk
        events = (await _body(stream)).decode().split("\n\n")
        assert events[0] == 'data: {"choices": []}' and events[-1] == ""
        error = json.loads(events[1].removeprefix("data: "))
        assert error["error"]["code"] == 503 and "failed" in error["error"]["message"]
        assert "[DONE]" not in events[-2] and replies.cancelled

        finished = await _ingress(_Replies(sse_start, [b"data: x\n\n", b"data: [DONE]\n\n"]))(_http(*chat))
        assert await _body(finished) == b"data: x\n\ndata: [DONE]\n\n"

        unanswered = _Replies(json_start, [], died=True)
        unanswered.items = []  # died before its app said anything
        assert (await _ingress(unanswered)(_http(*chat))).status_code == 503

    asyncio.run(run())


def test_an_admin_load_before_the_cluster_is_ready_waits_for_it_and_not_forever(monkeypatch):
    from loraplex.api.cluster import ray_ingress

    monkeypatch.setattr(ray_ingress, "LOAD_POLL_S", 0.01)
    start = {"status": 200, "headers": [(b"content-type", b"application/json")]}
    load = ("POST", "/v1/load_lora_adapter", json.dumps({"lora_name": "a", "lora_path": "a"}).encode())

    async def run():
        catalog = AdapterCatalog([])
        ingress = _ingress(_Replies(start, [b"{}"]), ["r1", "r2"], catalog)
        await catalog.report("r1", 0, "", {"ready": True})
        waiting = asyncio.ensure_future(ingress(_http(*load)))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # r2 is still starting: placed now, the load would stay on r1
        await catalog.report("r2", 0, "", {"ready": True})
        assert (await asyncio.wait_for(waiting, 5)).status_code == 200

        monkeypatch.setattr(ray_ingress, "LOAD_WAIT_S", 0.1)
        never = _ingress(_Replies(start, [b"{}"]), ["r1"], AdapterCatalog([]))  # no replica ever ready
        assert (await asyncio.wait_for(never(_http(*load)), 5)).status_code == 200  # after the wait
        monkeypatch.setattr(ray_ingress, "LOAD_WAIT_S", 60.0)
        never.engines.replies = _Replies(start, [b"{}"])
        assert (await asyncio.wait_for(never(_http(*load)), 1)).status_code == 200  # the next: at once

    asyncio.run(run())


def test_the_proxy_answers_a_request_its_ingress_never_did_with_an_openai_503():
    pytest.importorskip("ray.serve")
    from loraplex.api.cluster.ray_router import UNANSWERED, AnswerTheUnanswered, proxy_middlewares

    assert [m.cls for m in proxy_middlewares()] == [AnswerTheUnanswered]
    body = json.loads(UNANSWERED)
    assert body == fmt.error_body(503, body["error"]["message"])  # the shape fmt writes, spelled out

    async def silent(scope, receive, send):  # Ray's proxy when the ingress died under the request
        return None

    async def answers(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def run(app) -> list[dict]:
        sent = []

        async def send(message):
            sent.append(message)

        await AnswerTheUnanswered(app)({"type": "http"}, None, send)
        return sent

    sent = asyncio.run(run(silent))
    assert sent[0]["status"] == 503 and sent[1]["body"] == UNANSWERED
    assert [m.get("status", m.get("body")) for m in asyncio.run(run(answers))] == [200, b"ok"]


def test_the_command_asks_its_own_ready_on_loopback_when_it_listens_everywhere():
    from loraplex.api.cluster.ray_serve import _local_url

    def url(host: str) -> str:
        return _local_url(types.SimpleNamespace(host=host, port=8000))

    assert url("0.0.0.0") == "http://127.0.0.1:8000" and url("127.0.0.1") == "http://127.0.0.1:8000"
    assert url("::") == "http://[::1]:8000" and url("10.0.0.5") == "http://10.0.0.5:8000"
