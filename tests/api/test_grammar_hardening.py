"""Grammar hardening through a real server (issue 43): refusals that no backend weakens, and
compiles that cannot starve the server."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from live_server import assert_error, http, start_server
from loraplex.api.server import ServerConfig

MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
STRING_FIELD = {"type": "object", "additionalProperties": False, "required": ["s"],
                "properties": {"s": {"type": "string"}}}


def body(schema, strict: bool = True, max_tokens: int = 24) -> dict:
    return {"model": "tiny", "messages": MSG, "max_tokens": max_tokens, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                          "strict": strict}}}


def with_field(**keywords) -> dict:
    return {**STRING_FIELD, "properties": {"s": {"type": "string", **keywords}}}


@pytest.fixture(scope="module", params=["auto", "llguidance", "xgrammar", "outlines"])
def server(request, tiny_model_dir):
    # auto through the compile workers (the default); the others in-process, the same chain
    workers = {} if request.param == "auto" else {"grammar_compile_workers": 0}
    live = start_server(tiny_model_dir, ServerConfig(served_model_name="tiny"), num_kv_blocks=64,
                        grammar_backend=request.param, **workers)
    yield live
    live.stop()


def test_refusals_are_400s_naming_the_keyword_under_every_backend(server):
    assert_error(http(server, CHAT, body(with_field(pattern="^a(?=b)$")), key=None), 400,
                 "'pattern' at #/properties/s")
    assert_error(http(server, CHAT, body(with_field(pattern="^a(?=b)$")), key=None), 400, "lookahead")
    assert_error(http(server, CHAT, body(with_field(format="banana")), key=None), 400,  # strict: true, OpenAI's list
                 "'format: banana' at #/properties/s is not one of the formats OpenAI's strict mode supports")
    assert_error(http(server, CHAT, body(with_field(minLength="5")), key=None), 400,
                 "json schema is invalid at #/properties/s/minLength")
    assert_error(http(server, CHAT, {"model": "tiny", "messages": MSG, "max_tokens": 4,
                                     "structured_outputs": {"regex": r"(a)\1"}}, key=None), 400, "backreference")
    status, out = http(server, CHAT, body(with_field(format="banana"), strict=False), key=None)
    assert status == 200 and "format: banana at #/properties/s" in str(out), out
    assert http(server, "/health", key=None)[0] == 200


def chat_latency(live, payload) -> float:
    start = time.perf_counter()
    status, out = http(live, CHAT, payload, key=None)
    assert status == 200, out
    return time.perf_counter() - start


@pytest.fixture(scope="module")
def hostile(tiny_model_dir):
    """xgrammar, whose compile of a long negated-class repeat runs for minutes, with a short
    compile timeout."""
    live = start_server(tiny_model_dir, ServerConfig(served_model_name="tiny"), num_kv_blocks=64,
                        grammar_backend="xgrammar", grammar_compile_timeout_s=2.0)
    yield live
    live.stop()


def test_slow_compiles_are_killed_and_starve_no_one(hostile):
    plain = {"model": "tiny", "messages": MSG, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    ordinary = body({**STRING_FIELD, "properties": {"s": {"type": "string", "maxLength": 4}}})
    chat_latency(hostile, ordinary)  # a warm worker and server
    idle = statistics.median(chat_latency(hostile, plain) for _ in range(5))
    pool = hostile.engine.grammars.pool
    with ThreadPoolExecutor(9) as threads:
        slow = [threads.submit(http, hostile, CHAT, body(with_field(pattern=f"^[^{c}]{{1,3000}}$")), None)
                for c in "abcdefgh"]
        time.sleep(0.5)  # the eight are compiling
        busy = statistics.median(chat_latency(hostile, plain) for _ in range(5))
        other = threads.submit(chat_latency, hostile, body({**STRING_FIELD, "required": []}))
        for result in slow:
            assert_error(result.result(), 400, "took longer than 2s to compile")
        assert other.result() < 30  # an ordinary schema compiles meanwhile (behind the eight: a few timeouts)
    after = statistics.median(chat_latency(hostile, plain) for _ in range(5))  # nothing left burning
    assert busy <= 2 * idle + 0.05 and after <= 2 * idle + 0.05, (busy, after, idle)
    assert pool.num_killed >= 8 and len(pool._slots) <= pool.workers
    assert http(hostile, "/health", key=None)[0] == 200


def test_eight_requests_with_one_new_schema_share_one_compile(hostile):
    pool = hostile.engine.grammars.pool
    schema = {**STRING_FIELD, "properties": {"s": {"type": "string", "maxLength": 3}}, "title": "shared"}
    before = pool.num_compiles
    with ThreadPoolExecutor(8) as threads:
        results = list(threads.map(lambda _: http(hostile, CHAT, body(schema), key=None), range(8)))
    assert [status for status, _ in results] == [200] * 8, results
    assert pool.num_compiles == before + 1
