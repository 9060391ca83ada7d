"""Tenants through a real server (#42): keys scoped to adapters (plain and hashed), the same 404 for
another tenant's adapter as for a missing one, admin endpoints, paths and /metrics closed to tenants,
rate limits with Retry-After, a fair share under a flood, tenants' own adapters, reload with a rotated
key, usage totals that match what was served."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest

from conftest import assert_all_blocks_free
from live_server import ADMIN_KEY, StepCounter, assert_error, http, start_server, wait_idle

ACME, GLOBEX, INITECH, LIMITED = "sk-acme-1", "sk-globex-1", "sk-initech-1", "sk-limited-1"


def _tenants(root, acme_key: str = ACME) -> dict:
    return {"tenants": {
        "acme": {"api_keys": [acme_key], "adapters": ["acme-*"], "base_model": True, "max_concurrent": 64},
        "globex": {"api_keys": ["sha256:" + hashlib.sha256(GLOBEX.encode()).hexdigest()], "adapters": ["globex-*"],
                   "base_model": False, "can_load_adapters": True, "adapter_root": str(root)},
        "initech": {"api_keys": [INITECH], "adapters": ["initech-*"], "weight": 1},
        "limited": {"api_keys": [LIMITED], "adapters": [], "requests_per_minute": 2, "tokens_per_minute": 1000}}}


@pytest.fixture(scope="module")
def tenanted(tiny_model_dir, tiny_adapters, tmp_path_factory):
    from loraplex.api.server import ServerConfig

    folder = tmp_path_factory.mktemp("tenants")
    root = folder / "globex-root"
    root.mkdir()
    shutil.copytree(tiny_adapters[3], root / "extra")
    path = folder / "tenants.json"
    path.write_text(json.dumps(_tenants(root)))
    config = ServerConfig(served_model_name="tiny", model_path=str(tiny_model_dir), admin_api_key=ADMIN_KEY,
                          tenants_file=str(path), audit_log=str(folder / "audit.jsonl"))
    server = start_server(tiny_model_dir, config, {"acme-a": tiny_adapters[0], "globex-b": tiny_adapters[1],
                                                   "initech-c": tiny_adapters[2]},
                          num_kv_blocks=256, max_num_seqs=8, max_loras=4)
    server.tenants_path, server.globex_root, server.audit = path, root, folder / "audit.jsonl"
    yield server
    server.stop()


def _complete(server, key: str, model: str = "tiny", max_tokens: int = 3, **fields):
    body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **fields}
    return http(server, "/v1/completions", body, key=key)


def test_each_tenant_sees_only_its_own_models(tenanted):
    seen = {key: {m["id"] for m in http(tenanted, "/v1/models", key=key)[1]["data"]}
            for key in (ACME, GLOBEX, INITECH)}
    assert seen[ACME] == {"tiny", "acme-a"}
    assert seen[GLOBEX] == {"globex-b"}  # a hashed key; no base model
    assert seen[INITECH] == {"tiny", "initech-c"}
    status, listed = http(tenanted, "/v1/adapters", key=ACME)
    assert status == 200 and [a["id"] for a in listed["data"]] == ["acme-a"]
    assert "/" not in json.dumps(listed)  # no folder paths
    assert http(tenanted, "/v1/models/globex-b", key=ACME)[0] == 404
    admin = {m["id"] for m in http(tenanted, "/v1/models", key=ADMIN_KEY)[1]["data"]}
    assert admin == {"tiny", "acme-a", "globex-b", "initech-c"}


def test_another_tenants_adapter_is_the_same_404_as_a_missing_one(tenanted):
    other = _complete(tenanted, ACME, "tiny:globex-b")
    missing = _complete(tenanted, ACME, "tiny:acme-nope")
    assert_error(other, 404)
    assert json.dumps(other[1]).replace("globex-b", "X") == json.dumps(missing[1]).replace("acme-nope", "X")
    mixed = [_complete(tenanted, ACME, adapters=[{"name": "acme-a", "weight": 0.5}, {"name": n, "weight": 0.5}])
             for n in ("globex-b", "acme-zzz")]
    assert json.dumps(mixed[0][1]).replace("globex-b", "X") == json.dumps(mixed[1][1]).replace("acme-zzz", "X")
    assert_error(_complete(tenanted, GLOBEX, "tiny"), 404, "does not exist")  # no base model for globex
    assert _complete(tenanted, GLOBEX, "tiny:globex-b")[0] == 200
    tokenized = http(tenanted, "/tokenize", {"model": "tiny:globex-b", "prompt": "hi"}, key=ACME)
    assert_error(tokenized, 404)


def test_keys_admin_endpoints_and_metrics(tenanted):
    assert_error(http(tenanted, "/v1/models", key="sk-unknown"), 401)
    assert_error(http(tenanted, "/v1/models", key=None), 401)
    assert_error(http(tenanted, "/v1/load_lora_adapter", {"lora_name": "acme-x", "lora_path": "x"}, key=ACME), 403)
    assert_error(http(tenanted, "/v1/usage", key=INITECH), 403)
    assert_error(http(tenanted, "/v1/reload_tenants", {}, key=INITECH), 403)
    assert http(tenanted, "/metrics", key=ACME)[0] in (401, 403)
    assert http(tenanted, "/metrics", key=None)[0] == 401
    status, text = http(tenanted, "/metrics", key=ADMIN_KEY)
    assert status == 200 and "loraplex:tenant_requests" in text


def test_a_tenant_loads_its_own_adapters_from_its_root(tenanted):
    refused = http(tenanted, "/v1/load_lora_adapter", {"lora_name": "acme-stolen", "lora_path": "extra"}, key=GLOBEX)
    assert_error(refused, 403)
    outside = http(tenanted, "/v1/load_lora_adapter", {"lora_name": "globex-x", "lora_path": "/etc"}, key=GLOBEX)
    assert_error(outside, 400, "adapter root")
    status, text = http(tenanted, "/v1/load_lora_adapter", {"lora_name": "globex-extra", "lora_path": "extra"},
                        key=GLOBEX)
    assert status == 200, text
    assert "globex-extra" in {m["id"] for m in http(tenanted, "/v1/models", key=GLOBEX)[1]["data"]}
    assert "globex-extra" not in {m["id"] for m in http(tenanted, "/v1/models", key=ACME)[1]["data"]}
    assert_error(http(tenanted, "/v1/unload_lora_adapter", {"lora_name": "acme-a"}, key=GLOBEX), 404)
    assert http(tenanted, "/v1/unload_lora_adapter", {"lora_name": "globex-extra"}, key=GLOBEX)[0] == 200
    events = [json.loads(line) for line in tenanted.audit.read_text().splitlines()]
    loads = [(e["event"], e["name"], e["ok"]) for e in events if e.get("by") == "globex"]
    assert loads == [("load_adapter", "acme-stolen", False), ("load_adapter", "globex-x", False),
                     ("load_adapter", "globex-extra", True), ("unload_adapter", "acme-a", False),
                     ("unload_adapter", "globex-extra", True)]


def test_rate_limits_are_429_with_retry_after(tenanted):
    import urllib.error
    import urllib.request

    for _ in range(2):
        assert _complete(tenanted, LIMITED)[0] == 200
    req = urllib.request.Request(tenanted.url + "/v1/completions", data=json.dumps(
        {"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode(), headers={
        "Authorization": f"Bearer {LIMITED}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=30)
    assert refused.value.code == 429 and int(refused.value.headers["Retry-After"]) >= 1
    body = json.loads(refused.value.read())
    assert body["error"]["code"] == 429 and "requests per minute" in body["error"]["message"]
    usage = http(tenanted, "/v1/usage", key=ADMIN_KEY)[1]
    assert usage["tenants"]["limited"]["rate_limited"] == 1
    events = [json.loads(line) for line in tenanted.audit.read_text().splitlines()]
    assert any(e["event"] == "rate_limited" and e["tenant"] == "limited" for e in events)


def _steps_each(server, counter: StepCounter, key: str, count: int) -> list[int]:
    """Engine steps each of `count` short requests takes, one after another: a measure of waiting that a busy
    machine does not stretch, as it stretches seconds."""
    out = []
    for _ in range(count):
        before = counter.count
        assert _complete(server, key, max_tokens=4)[0] == 200
        out.append(counter.count - before)
    return out


def test_a_flood_cannot_hold_another_tenant_back(tenanted):
    """acme floods with 48 long requests (more than the batch's 8 seats, 128 tokens each); initech's short
    requests, one after another while the flood still queues, take about as many engine steps as alone: a seat is
    theirs at once. Without the fair share the first waits for the flood's seats (hundreds of steps). Counted in
    steps, not seconds: a step of 8 sequences is slower than a step of one, and wall-clock bounds failed on a
    loaded CI machine."""
    counter = StepCounter(tenanted.engine)
    try:
        alone = max(_steps_each(tenanted, counter, INITECH, 8))
        results, arrived = [], threading.Event()

        def slowed():  # until the flood has arrived, its first seats cannot end, however slow HTTP is
            if not arrived.is_set():
                time.sleep(0.05)
            return counter()

        tenanted.engine.step = slowed
        flood = [threading.Thread(target=lambda: results.append(_complete(tenanted, ACME, max_tokens=128)[0]))
                 for _ in range(48)]
        for t in flood:
            t.start()
        deadline = time.monotonic() + 60
        scheduler = tenanted.engine.core.scheduler
        while time.monotonic() < deadline:  # the whole flood in the engine: every seat held, the rest waiting
            running, waiting = len(scheduler.running), len(scheduler.waiting)
            if running == 8 and running + waiting >= 40:
                break
            time.sleep(0.01)
        arrived.set()
        assert (running, running + waiting >= 40) == (8, True), (running, waiting)
        during = _steps_each(tenanted, counter, INITECH, 8)
        still_flooding = len(tenanted.engine.core.scheduler.waiting) > 0
        for t in flood:
            t.join(300)
    finally:
        counter.remove()
    assert results == [200] * 48
    # a few more steps than alone: the flood's steps while the request crosses HTTP; never a seat's 128
    assert statistics.median(during) <= alone + 8 and max(during) <= alone + 40, (alone, during)
    assert still_flooding  # the short requests were measured while the flood still queued
    wait_idle(tenanted.engine)
    assert_all_blocks_free(tenanted.engine)


def test_usage_totals_match_the_tokens_served(tenanted):
    before = http(tenanted, "/v1/usage", key=ADMIN_KEY)[1]["tenants"].get("initech", {})
    served = [_complete(tenanted, INITECH, "tiny:initech-c", max_tokens=5)[1] for _ in range(3)]
    after = http(tenanted, "/v1/usage", key=ADMIN_KEY)[1]
    tenant = after["tenants"]["initech"]
    assert tenant["requests"] - before.get("requests", 0) == 3
    assert tenant["generation_tokens"] - before.get("generation_tokens", 0) == \
        sum(s["usage"]["completion_tokens"] for s in served)
    assert tenant["prompt_tokens"] - before.get("prompt_tokens", 0) == sum(s["usage"]["prompt_tokens"] for s in served)
    assert after["adapters"]["initech-c"]["generation_tokens"] >= 15


def test_a_rotated_key_works_after_reload_and_the_old_one_is_401(tenanted):
    assert _complete(tenanted, ACME)[0] == 200
    broken = tenanted.tenants_path.read_text()
    tenanted.tenants_path.write_text("{broken")
    assert_error(http(tenanted, "/v1/reload_tenants", {}, key=ADMIN_KEY), 400, "unchanged")
    assert _complete(tenanted, ACME)[0] == 200  # the old tenants stay
    tenanted.tenants_path.write_text(broken.replace(ACME, "sk-acme-2"))
    status, body = http(tenanted, "/v1/reload_tenants", {}, key=ADMIN_KEY)
    assert status == 200 and body["tenants"] == ["acme", "globex", "initech", "limited"]
    assert_error(_complete(tenanted, ACME), 401)
    assert _complete(tenanted, "sk-acme-2")[0] == 200
    tenanted.tenants_path.write_text(broken)
    assert http(tenanted, "/v1/reload_tenants", {}, key=ADMIN_KEY)[0] == 200


def test_a_bad_file_fails_start_up_naming_the_entry(tiny_model_dir, tmp_path):
    bad = _tenants(tmp_path)
    bad["tenants"]["initech"]["weight"] = 0
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(bad))
    done = subprocess.run([sys.executable, "-m", "loraplex.api.cli", "serve", str(tiny_model_dir), "--tenants",
                           str(path), "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "tenants.initech.weight: a positive number" in done.stderr


def test_sighup_reloads_the_file(tiny_model_dir, tmp_path):
    """`loraplex serve --tenants`: SIGHUP puts a rotated key in force; a broken file then keeps it."""
    from test_serve_e2e import serving

    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(_tenants(tmp_path)))
    with serving(tiny_model_dir, "--tenants", str(path), "--max-model-len", "256",
                 env={"LORAPLEX_ADMIN_API_KEY": ADMIN_KEY}) as (url, proc):
        server = type("Server", (), {"url": url})()
        assert http(server, "/v1/models", key=ACME)[0] == 200
        path.write_text(json.dumps(_tenants(tmp_path, acme_key="sk-acme-rotated")))
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while http(server, "/v1/models", key=ACME)[0] != 401 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert_error(http(server, "/v1/models", key=ACME), 401)
        assert http(server, "/v1/models", key="sk-acme-rotated")[0] == 200
        path.write_text("{broken")
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert proc.poll() is None and http(server, "/v1/models", key="sk-acme-rotated")[0] == 200
