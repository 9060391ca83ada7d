"""`loraplex serve --ray`: two replicas of the default model on a local Ray, 40 requests over 8
adapters through the official client, streamed and not, against one plain `loraplex serve`; then
4 admin-loaded adapters placed over both replicas, their requests following them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import make_peft_adapter
from test_serve_e2e import free_port, serving, wait_healthy

pytestmark = pytest.mark.e2e
BASE = "SmolLM2-135M-Instruct"
ADAPTERS = [f"a{i}" for i in range(8)]
LOADED = [f"b{i}" for i in range(4)]  # loaded through the admin endpoint, one after another
PROMPTS = ["Name a color.", "What is 2 + 2?", "Say hello in French.", "Name a fruit.", "What is the sky?"]


@pytest.fixture(scope="module")
def adapter_root(default_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-adapters")
    for i, name in enumerate([*ADAPTERS, "late", *LOADED]):
        make_peft_adapter(default_model_dir, root / name, rank=8, seed=10 + i, scale=0.4,
                          targets=["q_proj", "v_proj", "down_proj"])
    return root


@pytest.fixture(scope="module")
def expected(default_model_dir, adapter_root):
    """What one server says to every request of this module, one request at a time."""
    modules = [f"{name}={adapter_root / name}" for name in [*ADAPTERS, *LOADED]]
    # float32: oneDNN's bf16 matmul (the dtype `auto` picks on bf16 CPUs) rounds a row differently
    # with the batch's row count, so greedy text is only batch-independent in float32
    with serving(default_model_dir, "--dtype", "float32", "--lora-modules", *modules) as (url, _):
        return {r: ask(url, *r)[0] for r in [*workload(), *loaded_workload()]}


@pytest.fixture(scope="module")
def cluster(default_model_dir, adapter_root, expected):
    """One Ray cluster for the module (after the single server is gone): 2 replicas, 8 adapters
    given at start-up, admin loads from the adapter root. Load epsilon 1: with two replicas a
    holder's bound, ceil(2 x (running + 1) / 2), is never below its own load plus one, so no
    request leaves its adapter's holder for load and the test can ask affinity of every request
    (bounded loads spilling: tests/api/test_placement.py)."""
    modules = [f"{name}={adapter_root / name}" for name in ADAPTERS]
    with ray_serving(default_model_dir, "--dtype", "float32", "--replicas", "2", "--replica-cpus", "1",
                     "--load-epsilon", "1", "--lora-modules", *modules, "--adapter-root", str(adapter_root)) as url:
        wait_ready(url)
        yield url


@contextlib.contextmanager
def ray_serving(model_dir, *flags: str, log=subprocess.DEVNULL):
    """`loraplex serve --ray` in a subprocess, live (its ingress answers `/health`); SIGTERM on exit so
    it takes its local Ray down with it (a kill would leave Ray's processes behind). `log`: where its
    output goes (an open file)."""
    port = free_port()
    cmd = [sys.executable, "-m", "loraplex.api.cli", "serve", str(model_dir), "--ray", "--port", str(port),
           "--usage-db", "memory", *flags]  # no ledger file left in the cache (a --usage-db in flags wins)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=300)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def readiness(url: str) -> tuple[int, dict]:
    """`/ready`: (status, body); (0, {}) while nothing answers."""
    try:
        with urllib.request.urlopen(url + "/ready", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


def wait_ready(url: str, timeout: float = 300) -> dict:
    """Until `/ready` is 200: every replica ready and known to the ingress's router. Its body."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = readiness(url)
        if status == 200:
            return body
        assert status in (0, 503), (status, body)
        if status == 503:
            assert re.fullmatch(r"\d+ of \d+ engine replicas ready", body["error"]["message"]), body
        time.sleep(0.5)
    raise AssertionError(f"not ready after {timeout}s: {readiness(url)}")


def workload() -> list[tuple[str, str, bool]]:
    """40 (adapter, prompt, stream) requests, the adapters interleaved."""
    return [(ADAPTERS[i % 8], PROMPTS[i // 8], i % 2 == 1) for i in range(40)]


def loaded_workload() -> list[tuple[str, str, bool, int]]:
    """24 short requests over the admin-loaded adapters, interleaved."""
    return [(LOADED[i % 4], PROMPTS[i // 4 % 5], i % 3 == 1, 4) for i in range(24)]


def ask(url: str, adapter: str | None, prompt: str, stream: bool, max_tokens: int = 12) -> tuple[str, str, str]:
    """(text, replica, adapter cache hit/miss) through the official client; adapter None: the base."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    kwargs = dict(model=f"{BASE}:{adapter}" if adapter else BASE, messages=[{"role": "user", "content": prompt}],
                  max_tokens=max_tokens, temperature=0, stream=stream)
    raw = client.chat.completions.with_raw_response.create(**kwargs)
    reply = raw.parse()
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
    else:
        text = reply.choices[0].message.content
    return text, raw.headers.get("x-loraplex-replica", ""), raw.headers.get("x-loraplex-adapter-cache", "")


def metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return resp.read().decode()


def get_json(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as resp:
        return json.loads(resp.read())


def post(url: str, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def until(check, seconds: float):
    """`check()` until it is truthy (its value) or `seconds` pass (None)."""
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value or time.monotonic() >= deadline:
            return value or None
        time.sleep(0.25)


def test_two_replicas_route_by_adapter(cluster, expected):
    url, requests = cluster, workload()
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda r: ask(url, *r), requests))
    texts, replicas, cache = zip(*got)
    assert list(texts) == [expected[r] for r in requests]  # greedy: what one server says, whichever replica
    assert all(replicas) and len(set(replicas)) == 2, replicas  # both replicas served

    # affinity: after each adapter's first request, its requests go where it was read. Ray offers a
    # request to the holder alone three times (probe deadlines 0.1 + 0.2 + 0.4 s) before any
    # replica: a holder that answers none of them, on a loaded machine, may lose one
    later = cache[len(ADAPTERS):]  # the first 8 are each adapter's first
    assert later.count("miss") <= 1 and set(later) <= {"hit", "miss"}, list(zip(requests, replicas, cache))
    served_by = defaultdict(set)
    for (adapter, _, _), replica in zip(requests, replicas):
        served_by[adapter].add(replica)
    assert sum(len(s) for s in served_by.values()) <= len(ADAPTERS) + later.count("miss"), dict(served_by)

    # the cluster's view: models, metrics per replica
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == [BASE, *ADAPTERS]
    text = metrics(url)
    for replica in set(replicas):
        assert re.search(rf'loraplex:request_success_total{{.*replica="{replica}".*}} [1-9]', text), replica

    # admin load registers a name for every replica; unload reaches every replica holding it
    status, body = post(url, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": "late"})
    assert status == 200, body
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": "late"})[0] == 400
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"})[0] == 400
    time.sleep(2)  # Ray's routers learn which replica holds it (its 0.1 s push, then a long poll)
    late = [ask(url, "late", "Name a color.", s) for s in (False, True, False)]
    assert all(c == "hit" for _, _, c in late), late  # read where it was loaded, and routed there
    with ThreadPoolExecutor(4) as pool:  # base requests: no adapter to follow, so Ray spreads them
        base = list(pool.map(lambda _: ask(url, None, "Hi", False), range(8)))
    assert len({replica for _, replica, _ in base}) == 2 and not any(c for _, _, c in base), base
    assert "loraplex:adapter_loaded{lora_name=\"late\"" in metrics(url)
    status, body = post(url, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert status == 200, body
    assert "loraplex:adapter_loaded{lora_name=\"late\"" not in metrics(url)  # gone from every replica
    with pytest.raises(openai.NotFoundError):
        ask(url, "late", "Name a color.", False)
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "late"})[0] == 404
    assert post(url, "/v1/completions", {"model": BASE, "prompt": "x" * (5 << 20)})[0] == 413
    assert post(url, "/v1/completions", {"model": BASE, "prompt": "Hi", "max_tokens": -1})[0] == 400
    running = re.findall(r'^loraplex:num_requests_running{replica="\w+"} (\S+)$', metrics(url), re.M)
    assert running == ["0.0", "0.0"]


def test_admin_loads_spread_over_replicas_and_their_requests_follow(cluster, expected):
    url, requests = cluster, loaded_workload()
    for name in LOADED:  # one after another: each on the replica with the least adapter load then
        status, body = post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": name})
        assert status == 200, body
    got = [ask(url, *r) for r in requests]
    texts, replicas, cache = zip(*got)
    assert list(texts) == [expected[r] for r in requests]
    assert len(set(replicas)) == 2, replicas  # both replicas serve
    later = cache[len(LOADED):]  # after each adapter's first request: read already (loaded there)
    assert sum(c == "hit" for c in later) >= 0.9 * len(later), list(zip(requests, replicas, cache))

    served_by = defaultdict(set)
    for (adapter, *_), replica in zip(requests, replicas):
        served_by[adapter].add(replica)

    def reported() -> dict | None:  # the replicas' heartbeats (twice a second) reach the catalog
        rows = {row["id"]: row for row in get_json(url, "/v1/adapters")["data"]}
        return rows if all(rows.get(name, {}).get("requests") == 6 for name in LOADED) else None

    holders = until(reported, 30) or {row["id"]: row for row in get_json(url, "/v1/adapters")["data"]}
    for name in LOADED:
        assert served_by[name] <= set(holders[name]["replicas"]), (name, holders[name])
        assert holders[name]["requests"] == 6
    stats = get_json(url, "/v1/stats")
    assert set(stats["replicas"]) == set(replicas)
    assert stats["requests"] == sum(s["requests"] for s in stats["replicas"].values()) >= 24
