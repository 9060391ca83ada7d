"""`loraplex serve --ray --replicas 2` when things go wrong (issue #68): ready means ready (four admin
loads at once right after `/ready` land on both replicas, and their requests follow them), then an
engine replica and then the ingress are killed (SIGKILL) under traffic. Every request ends complete
or with a clear error in OpenAI's shape, none hangs, the survivor answers what comes after, and within
90 s Ray has the process back and every adapter answers again. One cluster for the module."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import openai
import pytest

from conftest import make_peft_adapter
from test_ray_serve import BASE, ask, get_json, ray_serving, readiness, until, wait_ready

pytestmark = pytest.mark.e2e
STARTED = [f"s{i}" for i in range(4)]  # given at start-up (--lora-modules)
LOADED = [f"l{i}" for i in range(4)]  # loaded through the admin endpoint, all at once
REPLICA = "x-loraplex-replica"
REQUEST_TIMEOUT_S = 60  # per request: a hang is a failure, not a stuck test
BACK_WITHIN_S = 90  # the bound: the killed process replaced and every adapter answering again


@pytest.fixture(scope="module")
def adapter_root(default_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-failure-adapters")
    for i, name in enumerate([*STARTED, *LOADED]):
        make_peft_adapter(default_model_dir, root / name, rank=8, seed=40 + i, scale=0.4,
                          targets=["q_proj", "v_proj"])
    return root


@pytest.fixture(scope="module")
def cluster(default_model_dir, adapter_root, tmp_path_factory):
    """(url, the command's output file), `/ready` 200; the cluster's usage ledger at `LEDGER[0]`."""
    folder = tmp_path_factory.mktemp("ray-failure-log")
    log, LEDGER[:] = folder / "serve.log", [folder / "usage.db"]
    modules = [f"{name}={adapter_root / name}" for name in STARTED]
    with open(log, "w") as out, ray_serving(default_model_dir, "--dtype", "float32", "--replicas", "2",
                                            "--replica-cpus", "1", "--lora-modules", *modules,
                                            "--adapter-root", str(adapter_root), "--usage-db", str(LEDGER[0]),
                                            log=out) as url:
        yield url, log


LEDGER: list = []  # the cluster's usage ledger file


def test_ready_then_concurrent_admin_loads_land_on_both_replicas_and_their_requests_spread(cluster):
    url, log = cluster
    body = wait_ready(url)
    assert body == {"ready": True, "replicas_ready": 2, "replicas_wanted": 2}
    assert until(lambda: "loraplex: ready at http://127.0.0.1:" in log.read_text(), 10), log.read_text()[-2000:]
    assert until(lambda: "(2 replicas)" in log.read_text(), 1)

    with ThreadPoolExecutor(len(LOADED)) as pool:  # all at once, the first requests after /ready
        loads = list(pool.map(load, [url] * len(LOADED), LOADED))
    assert all(status == 200 for status, _ in loads), loads
    assert len({replica for _, replica in loads}) == 2, loads

    holders = until(lambda: held_by(url, LOADED), 10)  # a heartbeat or two: the replicas' views
    assert holders, get_json(url, "/v1/adapters")
    assert set().union(*holders.values()) == {replica for _, replica in loads}, holders
    answers = [ask(url, name, "Name a color.", stream, 4) for name in LOADED for stream in (False, True)]
    assert len({replica for _, replica, _ in answers}) == 2, answers  # their requests spread too
    for (name, _), (_, replica, cache) in zip([(n, s) for n in LOADED for s in (0, 1)], answers):
        assert replica in holders[name] and cache == "hit", (name, replica, cache, holders)


def test_an_engine_replica_killed_under_traffic_fails_its_requests_cleanly_and_comes_back(cluster):
    url, _ = cluster
    before = serving_replicas(url)
    outcomes, killed_at = traffic_with_a_kill(url, "ServeReplica:loraplex:Engine")
    assert_clean(outcomes)
    assert_billed(outcomes)
    after_kill = [o for o in outcomes if o.after_kill]
    assert after_kill and all(o.kind == "ok" for o in after_kill), after_kill
    survivors = {o.replica for o in after_kill} & before
    assert len(survivors) == 1, (before, after_kill)  # the killed one answered nothing after its death

    replacement = wait_for_a_new_replica(url, before, killed_at + BACK_WITHIN_S)
    answered = every_adapter_answers(url, killed_at + BACK_WITHIN_S)
    assert answered | {replacement} == {replacement, *survivors}, (answered, replacement, survivors)
    assert serving_replicas(url) == {replacement, *survivors}


def test_the_ingress_killed_under_traffic_fails_its_requests_cleanly_and_comes_back(cluster):
    url, _ = cluster
    before = serving_replicas(url)
    outcomes, killed_at = traffic_with_a_kill(url, "ServeReplica:loraplex:Ingress")
    assert_clean(outcomes, cut_streams=True)  # Ray's proxy ends a started stream's connection
    assert_billed(outcomes)
    after_kill = [o for o in outcomes if o.after_kill]
    assert after_kill and all(o.kind in ("ok", "error") for o in after_kill), after_kill

    assert until(lambda: readiness(url)[0] == 200, killed_at + BACK_WITHIN_S - time.monotonic()), readiness(url)
    assert every_adapter_answers(url, killed_at + BACK_WITHIN_S).issubset(before)  # the engines never went away
    assert serving_replicas(url) == before


# ---- traffic, a kill in the middle ------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # ok (complete), error (a 5xx in OpenAI's shape), cut (a started stream's connection ended)
    replica: str | None = None
    stream: bool = False
    after_kill: bool = False
    detail: list = field(default_factory=list)
    id: str | None = None  # an answered request's: its ledger row is `{id}-0`
    usage: tuple[int, int] | None = None  # (prompt, completion) tokens it was told


def traffic_with_a_kill(url: str, title: str) -> tuple[list[Outcome], float]:
    """32 adapter requests, 8 at a time, half streamed; after the 8th answer, one process whose title
    has `title` gets SIGKILL. Each request says whether it started after the process was gone. Back:
    the outcomes, and when the process was gone (monotonic)."""
    names = [*STARTED, *LOADED]
    requests = [(names[i % len(names)], (i + i // len(names)) % 2 == 1) for i in range(32)]
    answered, killed, lock = threading.Event(), threading.Event(), threading.Lock()
    count, gone = Counter(), []

    def one(request) -> Outcome:
        after_kill = killed.is_set()
        outcome = call(url, *request)
        outcome.after_kill = after_kill
        with lock:
            count["answered"] += 1
            if count["answered"] == 8:
                answered.set()
        return outcome

    killer = threading.Thread(target=kill_when, args=(answered, killed, title, gone))
    killer.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(one, requests))
    finally:
        answered.set()
        killer.join(30)
    assert killed.is_set(), f"no process titled {title} was killed"
    return outcomes, gone[0]


def kill_when(answered: threading.Event, killed: threading.Event, title: str, gone: list) -> None:
    answered.wait(REQUEST_TIMEOUT_S * 2)
    pids = [pid for pid, args in processes() if title in args]
    if not pids:
        return
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(pid == pids[0] for pid, _ in processes()):
        time.sleep(0.05)
    gone.append(time.monotonic())
    killed.set()


def processes() -> list[tuple[int, str]]:
    """(pid, command line) of this machine's processes: Ray titles a Serve replica
    `ray::ServeReplica:<app>:<deployment>`."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, timeout=10).stdout
    return [(int(pid), args) for pid, _, args in (line.strip().partition(" ") for line in out.splitlines())]


def call(url: str, adapter: str, stream: bool, deadline: float | None = None) -> Outcome:
    """One chat request through the official client (no retries, a bounded wait: REQUEST_TIMEOUT_S, or
    until `deadline`), classified; an answered one with its id and usage (what the ledger must hold)."""
    wait = REQUEST_TIMEOUT_S if deadline is None else max(0.1, min(REQUEST_TIMEOUT_S, deadline - time.monotonic()))
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=wait)
    kwargs = dict(model=f"{BASE}:{adapter}", messages=[{"role": "user", "content": "Tell me about cats."}],
                  max_tokens=16, temperature=0)
    try:
        if not stream:
            raw = client.chat.completions.with_raw_response.create(**kwargs)
            answer = raw.parse()
            complete = answer.choices[0].finish_reason is not None
            return Outcome("ok" if complete else "incomplete", raw.headers.get(REPLICA), id=answer.id,
                           usage=(answer.usage.prompt_tokens, answer.usage.completion_tokens))
        with client.chat.completions.with_streaming_response.create(
                stream=True, stream_options={"include_usage": True}, **kwargs) as reply:
            return streamed(reply)
    except openai.APIStatusError as exc:
        return Outcome("error" if openai_error(exc.status_code, exc.body) else "unclear", stream=stream,
                       detail=[exc.status_code, exc.body])
    except openai.APIError as exc:  # no status: a timeout, a refused connection
        return Outcome(type(exc).__name__, stream=stream, detail=[str(exc)])


def streamed(reply) -> Outcome:
    """A stream is ok with a finish_reason and `[DONE]` last; an error event (OpenAI's shape, a 5xx)
    and no `[DONE]` is an error; a connection that ends mid-way is cut."""
    replica, events = reply.headers.get(REPLICA), []
    try:
        events = [line[len("data: "):] for line in reply.iter_lines() if line.startswith("data: ")]
    except Exception as exc:  # the transport's: the connection ended without the rest
        return Outcome("cut", replica, True, detail=[repr(exc)])
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    if events and events[-1] == "[DONE]" and any(c.get("choices") and c["choices"][0]["finish_reason"]
                                                 for c in chunks):
        usage = chunks[-1]["usage"]
        return Outcome("ok", replica, True, id=chunks[0]["id"], usage=(usage["prompt_tokens"],
                                                                      usage["completion_tokens"]))
    errors = [c["error"] for c in chunks if "error" in c]
    if errors and "[DONE]" not in events and openai_error(errors[-1]["code"], errors[-1]):
        return Outcome("error", replica, True, detail=errors)
    return Outcome("incomplete", replica, True, detail=events[-3:])


def openai_error(status: int, body) -> bool:
    """A server-side failure in OpenAI's error shape (the `error` object's fields)."""
    return (status >= 500 and isinstance(body, dict) and isinstance(body.get("message"), str)
            and body.get("code") == status and "type" in body)


def assert_clean(outcomes: list[Outcome], cut_streams: bool = False) -> None:
    allowed = {"ok", "error", *(["cut"] if cut_streams else [])}
    bad = [o for o in outcomes if o.kind not in allowed or (o.kind == "cut" and not o.stream)]
    assert not bad, bad
    assert sum(o.kind == "ok" for o in outcomes) >= len(outcomes) // 2, outcomes


def assert_billed(outcomes: list[Outcome]) -> None:
    """Every answered request is in the cluster's ledger once, with the tokens its client was told
    (committed before its answer ended: no wait needed here)."""
    rows = {row[0]: (row[1], row[2]) for row in sqlite3.connect(LEDGER[0]).execute(
        "SELECT id, prompt_tokens, generation_tokens FROM usage")}
    answered = [o for o in outcomes if o.kind == "ok"]
    assert answered and all(rows.get(f"{o.id}-0") == o.usage for o in answered), \
        [(o.id, o.usage, rows.get(f"{o.id}-0")) for o in answered if rows.get(f"{o.id}-0") != o.usage]


# ---- coming back ------------------------------------------------------------------------------


def wait_for_a_new_replica(url: str, before: set[str], deadline: float) -> str:
    """A replica not in `before` answers (a base request goes to the least-loaded replica: the newcomer
    once the router knows it) and `/ready` counts two, by `deadline` (monotonic)."""
    while time.monotonic() < deadline:
        status, body = readiness(url)
        if status == 200 and body["replicas_ready"] == 2:
            replica = ask(url, None, "Hi", False, 2)[1]
            if replica not in before:
                return replica
        time.sleep(1)
    raise AssertionError(f"no new replica within {BACK_WITHIN_S}s of the kill: {readiness(url)}")


def every_adapter_answers(url: str, deadline: float) -> set[str]:
    """Each adapter, streamed and not: 200 and complete, each call's wait bounded by `deadline` (monotonic:
    the issue's bound on coming back). The replicas that answered."""
    outcomes = [call(url, name, stream, deadline) for name in [*STARTED, *LOADED] for stream in (False, True)]
    assert all(o.kind == "ok" for o in outcomes), outcomes
    return {o.replica for o in outcomes}


def serving_replicas(url: str) -> set[str]:
    """The two replicas whose heartbeats the catalog has (a killed one is dropped once it is silent)."""
    replicas = until(lambda: (lambda seen: seen if len(seen) == 2 else None)(
        set(get_json(url, "/v1/stats")["replicas"])), 30)
    assert replicas, get_json(url, "/v1/stats")
    return replicas


def load(url: str, name: str) -> tuple[int, str | None]:
    """An admin load: (status, the replica that answered)."""
    request = urllib.request.Request(url + "/v1/load_lora_adapter",
                                     json.dumps({"lora_name": name, "lora_path": name}).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S * 2) as resp:
            return resp.status, resp.headers.get(REPLICA)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def held_by(url: str, names: list[str]) -> dict[str, set[str]] | None:
    """Each adapter's holders as `/v1/adapters` says; None while one has none."""
    rows = {row["id"]: set(row["replicas"]) for row in get_json(url, "/v1/adapters")["data"]}
    found = {name: rows.get(name, set()) for name in names}
    return found if all(found.values()) else None

