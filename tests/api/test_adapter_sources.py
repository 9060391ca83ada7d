"""Adapters in object storage through a real server (`--adapter-source`, tenants' `adapter_source`) against a real
S3-compatible server (moto's, on 127.0.0.1): first use, single flight under 64 concurrent requests (GETs counted by
the store), tenants confined to their prefixes, a stopped store, a corrupted object, a changed object, a restart
with a warm cache, eviction at the size bound."""

import json
import threading

import pytest

from live_server import ADMIN_KEY, http, start_server
from s3_server import S3Server

BUCKET = "adapters"
SHARED, ACME, GLOBEX = (f"s3://{BUCKET}/{p}" for p in ("shared", "acme", "globex"))
ACME_KEY, GLOBEX_KEY = "sk-acme-1", "sk-globex-1"


@pytest.fixture(scope="module")
def s3(tiny_adapters):
    server = S3Server()
    for name, i in (("s1", 0), ("s2", 1), ("s3", 2), ("c1", 3), ("e1", 4), ("e2", 5), ("w1", 6)):
        server.put_adapter(BUCKET, "shared", name, tiny_adapters[i])
    server.put_adapter(BUCKET, "acme", "acme-only", tiny_adapters[0])
    server.put_adapter(BUCKET, "globex", "globex-only", tiny_adapters[1])
    server.put_adapter(BUCKET, "acme", "dup", tiny_adapters[2])  # one name, two tenants' different adapters
    server.put_adapter(BUCKET, "globex", "dup", tiny_adapters[3])
    yield server
    server.stop()


def serve(tiny_model_dir, s3, folder, tenants: dict | None = None, **settings):
    from loraplex.api.server import ServerConfig

    path = None
    if tenants is not None:
        path = folder / "tenants.json"
        path.write_text(json.dumps({"tenants": tenants}))
    config = ServerConfig(served_model_name="tiny", model_path=str(tiny_model_dir), admin_api_key=ADMIN_KEY,
                          tenants_file=str(path) if path else None, adapter_sources=(SHARED,),
                          s3_endpoint_url=s3.url, adapter_cache_dir=str(folder / "cache"),
                          adapter_fetch_attempts=1, adapter_fetch_timeout=10, **settings)
    return start_server(tiny_model_dir, config, num_kv_blocks=256, max_num_seqs=8, max_loras=4)


@pytest.fixture(scope="module")
def stored(tiny_model_dir, s3, tmp_path_factory):
    tenants = {"acme": {"api_keys": [ACME_KEY], "adapters": ["*"], "adapter_source": ACME},
               "globex": {"api_keys": [GLOBEX_KEY], "adapters": ["*"], "adapter_source": GLOBEX},
               "plain": {"api_keys": ["sk-plain-1"], "adapters": ["*"]}}
    server = serve(tiny_model_dir, s3, tmp_path_factory.mktemp("stored"), tenants)
    yield server
    server.stop()


def complete(server, model: str, key: str = ADMIN_KEY):
    body = {"model": f"tiny:{model}" if model else "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    return http(server, "/v1/completions", body, key=key)


def stored_endpoint(s3) -> str:
    return s3.url


def loaded(server) -> dict:
    return {a.name: a for a in server.front.list_adapters()}


def test_first_use_fetches_once_for_64_concurrent_requests(stored, s3):
    statuses = []
    barrier = threading.Barrier(64)

    def ask():
        barrier.wait()
        statuses.append(complete(stored, "s1", "sk-plain-1")[0])

    threads = [threading.Thread(target=ask) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert statuses == [200] * 64
    assert s3.gets("shared/s1/") == 2  # one GET per object, counted by the store
    listing = http(stored, "/v1/adapters", key=ADMIN_KEY)
    assert listing[0] == 200, listing
    rows = {r["id"]: r for r in listing[1]["data"]}
    assert rows["s1"]["source"] == SHARED  # the admin's table says where it came from
    metrics = http(stored, "/metrics", key=ADMIN_KEY)[1]
    assert "loraplex:adapter_store_downloads_total 1.0" in metrics
    assert "loraplex:adapter_store_cache_misses_total 1.0" in metrics


def test_a_tenant_resolves_only_inside_its_own_prefix(stored):
    unknown = complete(stored, "no-such-adapter", GLOBEX_KEY)
    assert unknown[0] == 404
    assert complete(stored, "acme-only", ACME_KEY)[0] == 200
    other = complete(stored, "acme-only", GLOBEX_KEY)  # loaded now, from acme's prefix: not globex's to name
    assert other[0] == 404 and other[1]["error"]["message"] == unknown[1]["error"]["message"].replace(
        "no-such-adapter", "acme-only")
    assert complete(stored, "globex-only", GLOBEX_KEY)[0] == 200
    assert complete(stored, "globex-only", ACME_KEY)[0] == 404
    assert complete(stored, "s2", ACME_KEY)[0] == 404  # the server's source is not acme's
    names = [r["id"] for r in http(stored, "/v1/adapters", key=ACME_KEY)[1]["data"]]
    assert "acme-only" in names and "globex-only" not in names


def test_waiting_on_another_tenants_first_use_of_a_name_never_serves_its_adapter(stored, s3):
    """globex asks for `dup` while acme's `dup` (another adapter, from acme's prefix) is being fetched: it waited
    for that load and, before the fix, was served acme's adapter. Names are one namespace per server: globex's own
    `dup` is a 404 while acme's is loaded (docs/tenants.md)."""
    results = {}
    s3.delay_s = 0.4
    try:
        first = threading.Thread(target=lambda: results.update(acme=complete(stored, "dup", ACME_KEY)[0]))
        first.start()
        while "dup" not in stored.uvicorn_server.config.app.state.loraplex.adapters._loading:
            threading.Event().wait(0.01)
        results["globex"] = complete(stored, "dup", GLOBEX_KEY)[0]
        first.join(60)
    finally:
        s3.delay_s = 0.0
    assert results == {"acme": 200, "globex": 404}


def test_a_stopped_store_is_a_503_naming_the_adapter_and_the_server_stays_healthy(stored, s3):
    assert complete(stored, "s1")[0] == 200  # loaded earlier, or now
    s3.stop()
    try:
        status, body = complete(stored, "s3")
        assert status == 503 and "`s3`" in body["error"]["message"]
        assert "127.0.0.1" not in json.dumps(body) and BUCKET not in json.dumps(body)
        assert complete(stored, "s1")[0] == 200  # what is loaded keeps serving
        assert http(stored, "/health")[0] == 200
    finally:
        s3.start()
    assert complete(stored, "s3")[0] == 200
    assert "s3" in loaded(stored)


def test_a_broken_download_is_a_503_then_a_later_success(stored, s3):
    s3.cut.add("shared/s2/adapter_model.safetensors")
    try:
        status, body = complete(stored, "s2")
        assert status == 503 and "`s2`" in body["error"]["message"] and "s2" not in loaded(stored)
    finally:
        s3.cut.clear()
    assert complete(stored, "s2")[0] == 200


def test_a_corrupted_object_is_refused_and_not_kept(stored, s3, tmp_path, tiny_adapters):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_bytes((tiny_adapters[0] / "adapter_config.json").read_bytes())
    (bad / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    s3.put_adapter(BUCKET, "shared", "corrupt", bad)
    status, body = complete(stored, "corrupt")
    assert status == 400 and "could not be loaded" in body["error"]["message"]
    assert "corrupt" not in loaded(stored)
    cache = stored.uvicorn_server.config.app.state.loraplex.adapters.objects.store.cache
    assert not list(cache.source_root(f"{stored_endpoint(s3)}|{SHARED}").glob("corrupt/*"))


def test_a_changed_object_is_picked_up_after_the_ttl(tiny_model_dir, s3, tmp_path, tiny_adapters):
    server = serve(tiny_model_dir, s3, tmp_path, adapter_source_ttl=0.0)
    try:
        assert complete(server, "c1")[0] == 200
        before = loaded(server)["c1"].content_hash
        assert complete(server, "c1")[0] == 200 and loaded(server)["c1"].content_hash == before
        s3.put_adapter(BUCKET, "shared", "c1", tiny_adapters[7])
        assert complete(server, "c1")[0] == 200
        assert loaded(server)["c1"].content_hash != before
    finally:
        server.stop()


def test_a_restart_serves_from_the_warm_cache(tiny_model_dir, s3, tmp_path):
    first = serve(tiny_model_dir, s3, tmp_path)
    try:
        assert complete(first, "w1")[0] == 200
    finally:
        first.stop()
    gets = s3.gets()
    second = serve(tiny_model_dir, s3, tmp_path)
    try:
        assert complete(second, "w1")[0] == 200 and s3.gets() == gets  # listed, not downloaded
    finally:
        second.stop()


def test_the_size_bound_evicts_an_idle_adapter_which_is_fetched_again(tiny_model_dir, s3, tmp_path, tiny_adapters):
    size = sum((tiny_adapters[4] / f).stat().st_size for f in ("adapter_config.json", "adapter_model.safetensors"))
    server = serve(tiny_model_dir, s3, tmp_path, adapter_cache_size=int(1.5 * size))
    try:
        assert complete(server, "e1")[0] == 200
        assert complete(server, "e2")[0] == 200  # e1 out of the cache, and unloaded (no request holds it)
        assert "e1" not in loaded(server) and "e2" in loaded(server)
        gets = s3.gets("shared/e1/")
        assert complete(server, "e1")[0] == 200 and s3.gets("shared/e1/") == gets + 2
    finally:
        server.stop()


def test_a_request_during_a_ttl_swap_is_served_not_a_404(tiny_model_dir, s3, tmp_path, tiny_adapters):
    """The swap unloads the old version, then loads the new one: a request in between waited on the swap's task
    (which returns nothing) and was answered 404 before the fix."""
    import asyncio

    s3.put_adapter(BUCKET, "shared", "t1", tiny_adapters[0])
    server = serve(tiny_model_dir, s3, tmp_path, adapter_source_ttl=0.0)
    try:
        assert complete(server, "t1")[0] == 200
        load, swapping = server.front.load_adapter, threading.Event()

        async def slow_load(*args, **kwargs):
            swapping.set()
            await asyncio.sleep(0.5)
            return await load(*args, **kwargs)

        server.front.load_adapter = slow_load
        s3.put_adapter(BUCKET, "shared", "t1", tiny_adapters[1])
        results = []
        first = threading.Thread(target=lambda: results.append(complete(server, "t1")[0]))
        first.start()
        assert swapping.wait(30)
        results.append(complete(server, "t1")[0])  # the old version is unloaded, the new one not yet loaded
        first.join(60)
        assert results == [200, 200]
    finally:
        server.stop()
