"""An engine replica of `loraplex serve --ray`, without Ray: `EngineReplica` constructed directly
over a real engine client and the catalog (called as Ray would, through `.remote`), driven with
requests as the ingress forwards them."""

from __future__ import annotations

import asyncio
import json

import pytest

from loraplex.api.cluster.ray_serve import AdapterCatalog
from loraplex.api.cluster.replica import CACHE_HEADER, REPLICA_HEADER, EngineReplica
from loraplex.api.settings import ServerConfig
from loraplex.platform.config import EngineConfig
from loraplex.platform.engine.engine_client import build_engine_client, read_adapter_info


class _Remote:
    def __init__(self, method) -> None:
        self.remote = method  # an async method: `await handle.name.remote(...)` as with an actor


class ActorHandle:
    """A Ray actor handle's shape over the catalog object itself."""

    def __init__(self, actor) -> None:
        for name in ("get", "list", "register", "unregister", "report", "metrics", "tenants", "bill", "usage"):
            setattr(self, name, _Remote(getattr(actor, name)))


def described(path: str, body: dict) -> tuple[dict, bytes]:
    return ({"method": "POST", "path": path, "query_string": b"", "client": ["127.0.0.1", 0],
             "headers": [(b"content-type", b"application/json")]}, json.dumps(body).encode())


async def forward(replica: EngineReplica, path: str, body: dict, adapter: str | None) -> tuple[dict, dict, dict]:
    start, chunks = None, b""
    async for message in replica.forward(*described(path, body), adapter):
        if isinstance(message, dict):
            start = message
        else:
            chunks += message
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start, headers, json.loads(chunks)


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    client = build_engine_client(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
                                              max_loras=2))
    yield client
    client.shutdown()


def test_a_replica_reads_a_shared_adapter_once_and_lets_go_when_the_catalog_does(client, tiny_model_dir,
                                                                                   tiny_adapters):
    catalog = AdapterCatalog([read_adapter_info(str(tiny_model_dir), 64, "a0", str(tiny_adapters[0]))])

    async def drive():
        replica = EngineReplica(client, ServerConfig(served_model_name="tiny"), ActorHandle(catalog), "r1")
        kept = {}  # Ray's multiplexing LRU: keeps what the hook returns until it evicts

        async def multiplexed_hold(name: str):
            kept[name] = await replica.hold(name)
            return kept[name]

        replica.hook = multiplexed_hold
        body = {"model": "tiny:a0", "prompt": [5, 9, 14], "max_tokens": 3}
        first, headers, reply = await forward(replica, "/v1/completions", body, "a0")
        assert first["status"] == 200 and reply["usage"]["completion_tokens"] == 3
        assert headers[REPLICA_HEADER] == "r1" and headers[CACHE_HEADER] == "miss"
        assert "a0" in replica.held  # what Ray's multiplexing LRU now keeps
        _, headers, _ = await forward(replica, "/v1/completions", body, "a0")
        assert headers[CACHE_HEADER] == "hit"
        _, headers, _ = await forward(replica, "/v1/completions", {**body, "model": "tiny"}, None)
        assert CACHE_HEADER not in headers  # the base model
        status, headers, reply = await forward(replica, "/v1/completions", {**body, "model": "nope"}, "nope")
        assert status["status"] == 404 and CACHE_HEADER not in headers
        assert await catalog.unregister("a0", wait_s=0)
        await replica.report()  # the heartbeat brings the catalog's change
        assert "a0" not in {a.name for a in client.list_adapters()}
        assert "r1" in await catalog.metrics()
        view = (await catalog.views())["r1"]  # what the ingress merges, sent before the change came back
        assert view["stats"]["generation_tokens"] == 9
        assert [(a["id"], a["requests"]) for a in view["adapters"]] == [("a0", 2)]
        await replica.report()
        assert (await catalog.views())["r1"]["adapters"] == []  # let go of here
        replica.reporter.cancel()
        kept.clear()

    asyncio.run(drive())


def test_a_replica_follows_a_tenants_reload_made_on_another(client, tmp_path):
    """#42 on Ray: a reload on one replica bumps the catalog's version; at its next heartbeat this one
    re-reads the file (a rotated key in force), and a broken file keeps what it has."""
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {"acme": {"api_keys": ["old-key"]}}}))
    catalog = AdapterCatalog([])

    async def drive():
        config = ServerConfig(served_model_name="tiny", admin_api_key="admin", tenants_file=str(path))
        replica = EngineReplica(client, config, ActorHandle(catalog), "r1")
        await replica.report()  # the first heartbeat learns the version, nothing to reload
        path.write_text(json.dumps({"tenants": {"acme": {"api_keys": ["new-key"]}}}))
        await replica.report()
        assert replica.state.tenants.current.identify("old-key") is not None  # no reload asked for yet
        await catalog.tenants_reloaded()
        await replica.report()
        tenants = replica.state.tenants.current
        assert tenants.identify("new-key") is not None and tenants.identify("old-key") is None
        path.write_text("{broken")
        await catalog.tenants_reloaded()
        await replica.report()
        assert replica.state.tenants.current.identify("new-key") is not None
        if replica.reporter is not None:
            replica.reporter.cancel()

    asyncio.run(drive())


def test_an_adapter_is_read_only_for_a_key_that_may_use_it(client, tiny_model_dir, tiny_adapters, tmp_path):
    """#49 on Ray: the replica read the named adapter before the app checked the key, and said hit / miss on
    the 401 or 404: anyone could learn whether another tenant's adapter exists and is in memory, and make it
    load. Now an unknown key, or a tenant naming another's adapter, reads nothing and is told nothing."""
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {"acme": {"api_keys": ["sk-acme"], "adapters": ["acme-*"]},
                                            "globex": {"api_keys": ["sk-globex"], "adapters": ["globex-*"]},
                                            "initech": {"api_keys": ["sk-initech"]}}}))
    catalog = AdapterCatalog([read_adapter_info(str(tiny_model_dir), 64, "globex-g", str(tiny_adapters[1]))])

    async def drive():
        config = ServerConfig(served_model_name="tiny", admin_api_key="admin", tenants_file=str(path))
        replica = EngineReplica(client, config, ActorHandle(catalog), "r1")
        body = {"model": "tiny:globex-g", "prompt": [5, 9, 14], "max_tokens": 2}
        for key in (None, "sk-wrong", "sk-acme"):
            request, raw = described("/v1/completions", body)
            if key is not None:
                request["headers"].append((b"authorization", f"Bearer {key}".encode()))
            start = None
            async for message in replica.forward(request, raw, "globex-g"):
                start = message if isinstance(message, dict) else start
            headers = {k.decode(): v.decode() for k, v in start["headers"]}
            assert start["status"] in (401, 404) and CACHE_HEADER not in headers, key
            assert "globex-g" not in {a.name for a in client.list_adapters()}, key  # nothing read
        request, raw = described("/v1/completions", body)
        request["headers"].append((b"authorization", b"Bearer sk-globex"))
        statuses = [m["status"] async for m in replica.forward(request, raw, "globex-g") if isinstance(m, dict)]
        assert statuses == [200] and "globex-g" in {a.name for a in client.list_adapters()}
        if replica.reporter is not None:
            replica.reporter.cancel()

    asyncio.run(drive())
