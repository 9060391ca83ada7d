"""Worker processes that die under traffic (issue 68), through a real server on 127.0.0.1 over the tiny model.

A grammar compile worker killed from outside (SIGKILL, as an OOM killer sends it) while it holds a request's spec:
that request gets a clear error in OpenAI's shape, the others are answered, the pool forks a fresh worker and the
next structured requests compile and obey their schemas. One killed while idle, or with its zygote, is replaced
before it costs a request anything.

A tensor-parallel worker killed under 8-way traffic (streams and not): every request in flight ends with a 503
(a stream with its error event), none hangs, `/health` turns 503 and new requests are refused at once.

Which process is killed is read off the server's own objects (the pool, the executor), never off `ps`; a compile
is caught in a worker deterministically by stopping the worker (SIGSTOP) before the spec is handed to it and
killing it while the spec waits in its pipe: to the server that is a worker dying mid-compile."""

from __future__ import annotations

import array
import fcntl
import json
import os
import signal
import termios
import threading
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest

from conftest import assert_all_blocks_free
from live_server import SCHEMA, HeldSteps, assert_error, http, start_server, wait_idle
from loraplex.api.server import ServerConfig

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hello world"}]
SAFETY_S = 60.0  # a bounded wait that only a hang reaches; nothing asserts how long anything took
PLAIN_TOKENS = 24


def schema(title: str) -> dict:
    """SCHEMA under another title: a spec of its own (its own compile), the same values."""
    return {**SCHEMA, "title": title}


def chat(spec: dict | None = None, stream: bool = False, max_tokens: int = PLAIN_TOKENS, model: str = "tiny") -> dict:
    body = {"model": model, "messages": MSG, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if spec is None:
        body["ignore_eos"] = True  # a plain request runs its whole length: in flight while the others are
    else:
        body["max_tokens"] = 60  # room for the object; the grammar ends it
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": spec}}
    return body


class Stream:
    """One streamed call read event by event; the status line and the first event are in once it is built."""

    def __init__(self, live, body: dict, path: str = CHAT) -> None:
        req = urllib.request.Request(live.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        self.response = urllib.request.urlopen(req, timeout=SAFETY_S)
        self.status = self.response.status
        self.events = [self._next()]

    def _next(self):
        """The next `data:` payload (JSON, or the string "[DONE]"); None when the body ends."""
        for line in self.response:
            line = line.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: "):]
                return payload if payload == "[DONE]" else json.loads(payload)
        return None

    def finish(self) -> list:
        """Every event, the rest read to the end of the body."""
        while self.events[-1] is not None:
            self.events.append(self._next())
        self.response.close()
        return self.events[:-1]


def assert_answered(status: int, body: dict, spec: dict | None) -> None:
    """A whole answer: a plain one its every token, a structured one an object its schema accepts."""
    assert status == 200, body
    choice = body["choices"][0]
    if spec is None:
        assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == PLAIN_TOKENS, body
    else:
        assert choice["finish_reason"] == "stop", body
        jsonschema.validate(json.loads(choice["message"]["content"]), spec)


def assert_streamed_whole(events: list) -> None:
    """No error event, the last chunk's finish reason, then [DONE]."""
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
    assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2]


def assert_streamed_503(events: list) -> None:
    """Cut by the engine's death: an error event in OpenAI's shape (503), then [DONE]; never a finish reason."""
    assert events[-1] == "[DONE]", events[-3:]
    error = events[-2]["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 503, error
    assert not any(e["choices"][0].get("finish_reason") for e in events[:-2] if "choices" in e)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + SAFETY_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def alive(pid: int) -> bool:
    """Running, not a zombie: a worker orphaned with its zygote is reaped by whoever adopts it, maybe late."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def signal_all(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def assert_clean(live) -> None:
    wait_idle(live.engine)
    assert_all_blocks_free(live.engine)
    assert live.engine.adapters.num_pins() == 0


# ---- a grammar compile worker ------------------------------------------------------------------


def workers(pool) -> dict[int, object]:
    """slot -> its worker (pid, pipes), as the pool holds them."""
    return {slot: w for slot, w in pool._procs.items() if w is not None}


def unread(conn) -> int:
    """Bytes in a pipe its reader has not read: a spec handed to a worker that is stopped."""
    count = array.array("i", [0])
    fcntl.ioctl(conn.fileno(), termios.FIONREAD, count)
    return count[0]


@pytest.fixture
def grammar_server(tiny_model_dir):
    """The default backend (auto) through two compile workers, both up; one server per test (each leaves its pool
    with a dead worker or zygote that only a job makes the pool notice)."""
    live = start_server(tiny_model_dir, ServerConfig(served_model_name="tiny"), num_kv_blocks=64, max_num_seqs=8,
                        grammar_compile_workers=2)
    assert_answered(*http(live, CHAT, chat(schema("warm-up")), key=None), schema("warm-up"))  # both workers up
    yield live
    live.stop()


def test_a_compile_worker_killed_mid_compile_fails_only_its_request(grammar_server):
    """8 requests at once: the one whose spec the killed worker held gets a 400 saying the worker died (the pool's
    error for a compile that cannot finish); three plain streams, two plain calls and two structured calls of
    other schemas (one waiting in the other, stopped worker's pipe, one in the pool's queue) are answered whole.
    Then the pool has a fresh worker, and the same schema and a new one compile and are obeyed."""
    live = grammar_server
    grammars, pool = live.engine.grammars, live.engine.grammars.pool
    before = workers(pool)
    victim_spec, others = schema("victim"), [schema("other-1"), schema("other-2")]
    signal_all([w.pid for w in before.values()], signal.SIGSTOP)  # no spec gets compiled until we say
    try:
        with ThreadPoolExecutor(8) as threads:
            victim = threads.submit(http, live, CHAT, chat(victim_spec), None)
            wait_for(lambda: any(unread(w.outbox) for w in before.values()), "the victim's spec reached a worker")
            held = next(w for w in before.values() if unread(w.outbox))
            structured = [threads.submit(http, live, CHAT, chat(spec), None) for spec in others]
            plain = [threads.submit(http, live, CHAT, chat(), None) for _ in range(2)]
            streams = [Stream(live, chat(stream=True)) for _ in range(3)]  # each in flight: its first chunk came
            wait_for(lambda: len(grammars._inflight) == 3, "the other schemas are waiting for a worker")
            os.kill(held.pid, signal.SIGKILL)
            signal_all([w.pid for w in before.values() if w is not held], signal.SIGCONT)
            assert_error(victim.result(SAFETY_S), 503, "grammar compile worker died while compiling")
            for future, spec in zip(structured, others):
                assert_answered(*future.result(SAFETY_S), spec)
            for future in plain:
                assert_answered(*future.result(SAFETY_S), None)
            for stream in streams:
                assert stream.status == 200
                assert_streamed_whole(stream.finish())
    finally:
        signal_all([w.pid for w in before.values()], signal.SIGCONT)
    after = workers(pool)
    assert not alive(held.pid) and held.pid not in {w.pid for w in after.values()}
    assert len(after) == pool.workers and all(alive(w.pid) for w in after.values())  # the replacement
    for spec in (victim_spec, schema("new")):  # the schema whose compile died, and another
        assert_answered(*http(live, CHAT, chat(spec), key=None), spec)
    assert http(live, "/health", key=None)[0] == 200
    assert_clean(live)


def test_idle_compile_workers_killed_are_replaced_before_a_request_needs_them(grammar_server):
    """Every worker killed between requests: the next structured requests compile on fresh workers and are
    obeyed, none is failed for a worker that was already gone. A slot finds its worker dead as it hands it a job
    (whichever slot takes one: two at once may go to one slot, so only one fresh worker is certain)."""
    live = grammar_server
    pool = live.engine.grammars.pool
    before = {w.pid for w in workers(pool).values()}
    signal_all(before, signal.SIGKILL)
    wait_for(lambda: not any(alive(pid) for pid in before), "the killed workers are gone")
    specs = [schema("after-idle-1"), schema("after-idle-2")]
    with ThreadPoolExecutor(2) as threads:
        answers = list(threads.map(lambda spec: http(live, CHAT, chat(spec), key=None), specs))
    for answer, spec in zip(answers, specs):
        assert_answered(*answer, spec)
    fresh = {w.pid for w in workers(pool).values()} - before
    assert fresh and all(alive(pid) for pid in fresh)
    assert_clean(live)


def test_a_killed_zygote_is_started_again_with_its_workers(grammar_server):
    """The zygote killed takes its workers with it (their parent-death signal): the pool starts a new one, and
    the next structured request compiles on its workers."""
    live = grammar_server
    pool = live.engine.grammars.pool
    zygote, before = pool._zygote.proc, {w.pid for w in workers(pool).values()}
    zygote.kill()
    wait_for(lambda: not any(alive(pid) for pid in before), "the zygote's workers ended with it")
    spec = schema("after-zygote")
    assert_answered(*http(live, CHAT, chat(spec), key=None), spec)
    assert pool._zygote.proc is not zygote and pool._zygote.proc.poll() is None
    assert zygote.poll() is not None  # the dead one reaped, not left a zombie
    assert_clean(live)


# ---- a tensor-parallel worker ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp_death(tiny_model_dir, tiny_adapters):
    """TP=2 over gloo with an adapter; 8 requests running (4 streams, 4 not, half of each on the adapter) and one
    more whose compile is held in a stopped compile worker; rank 1 killed. What came back, for the tests below."""
    live = start_server(tiny_model_dir, ServerConfig(served_model_name="tiny"), {"a0": tiny_adapters[0]},
                        tensor_parallel_size=2, num_kv_blocks=128, max_num_seqs=8, grammar_compile_workers=1)
    seen: dict = {}
    try:
        _kill_a_rank_under_traffic(live, seen)
        yield live, seen
    finally:
        live.stop()


def _kill_a_rank_under_traffic(live, seen: dict) -> None:
    executor, pool = live.engine.core.executor, live.engine.grammars.pool
    assert_answered(*http(live, CHAT, chat(schema("tp-warm-up")), key=None), schema("tp-warm-up"))
    compiler = next(iter(workers(pool).values()))
    os.kill(compiler.pid, signal.SIGSTOP)
    late = Future()  # a request past admission, its compile held, when the engine dies
    threading.Thread(target=lambda: late.set_result(http(live, CHAT, chat(schema("late")), key=None)),
                     daemon=True).start()
    held = HeldSteps(live.engine, 8)
    try:
        wait_for(lambda: unread(compiler.outbox), "the late request's spec reached the compile worker")
        with ThreadPoolExecutor(8) as threads:
            models = ("tiny", "a0") * 2
            calls = [threads.submit(http, live, CHAT, chat(model=m, max_tokens=400), None) for m in models]
            streams = [threads.submit(Stream, live, chat(stream=True, model=m, max_tokens=400)) for m in models]
            wait_for(held.holding.is_set, "the 8 requests run, each with a token out")
            streams = [stream.result(SAFETY_S) for stream in streams]  # each had its first chunk
            os.kill(executor.procs[1].pid, signal.SIGKILL)
            held.release.set()
            seen["calls"] = [call.result(SAFETY_S) for call in calls]
            seen["streams"] = [(stream.status, stream.finish()) for stream in streams]
        seen["health"] = http(live, "/health", key=None)
        seen["after"] = [http(live, CHAT, chat(), key=None), http(live, CHAT, chat(stream=True), key=None),
                         http(live, CHAT, chat(schema("after")), key=None),  # its compile worker is stopped
                         http(live, "/v1/completions", {"model": "a0", "prompt": "Hi", "max_tokens": 4}, key=None)]
        seen["ranks_alive"] = [proc.is_alive() for proc in executor.procs]
        seen["streams_left"] = live.front.num_unfinished
    finally:
        held.release.set()
        os.kill(compiler.pid, signal.SIGCONT)
    wait_for(lambda: not live.engine.grammars._inflight, "the late request's compile finished")
    try:  # its answer comes at once once compiled (10 s: only a hang reaches it)
        seen["late"] = late.result(10)
    except TimeoutError:
        seen["late"] = "no answer: a hang"


def test_a_killed_tp_worker_ends_every_request_with_a_503_and_refuses_new_ones_at_once(tp_death):
    live, seen = tp_death
    for answer in seen["calls"]:
        assert_error(answer, 503, "engine failed")
    for status, events in seen["streams"]:
        assert status == 200  # its first chunk had gone out: the error ends the stream
        assert_streamed_503(events)
    assert_error(seen["health"], 503, "engine failed")
    for answer in seen["after"]:  # refused at admission: nothing queued for the dead engine to (never) answer
        assert_error(answer, 503, "engine failed")
    assert seen["streams_left"] == 0
    assert seen["ranks_alive"] == [False, False]  # the other rank stopped too, never left in a collective


def test_a_request_compiling_when_the_engine_died_gets_a_503_not_a_hang(tp_death):
    _, seen = tp_death
    assert seen["late"] != "no answer: a hang"
    assert_error(seen["late"], 503, "engine failed")


def test_a_dead_engine_holds_no_kv_blocks_or_adapter_pins(tp_death):
    live, _ = tp_death
    assert live.engine.core.kv.req_blocks == {}
    assert live.engine.adapters.num_pins() == 0
