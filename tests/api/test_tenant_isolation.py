"""Tenant isolation, second round (#49), through real servers with several tenants: the prefix cache keyed by
tenant (another's cached prompt answers no sooner than a fresh one), limits that count sequences and reserve
tokens, every endpoint that costs compute inside a limit, keys matched exactly, and a bill that is what left the
server (a dropped stream included), equal per tenant, per adapter and in the token bucket."""

from __future__ import annotations

import http.client as httpclient
import json
import random
import shutil
import statistics
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from conftest import assert_all_blocks_free, make_tiny_model
from live_server import ADMIN_KEY, assert_error, http, start_server, wait_idle

ACME, GLOBEX, INITECH, HOOLI = "sk-acme-1", "sk-globex-1", "sk-initech-1", "sk-hooli-1"
METERED, BILLED = "sk-metered-1", "sk-billed-1"


def _tenants(roots: dict[str, str] | None = None) -> dict:
    loaders = {f"loader-{n}": {"api_keys": [f"sk-loader-{n}"], "adapters": ["shared-*"], "base_model": False,
                               "can_load_adapters": True, "adapter_root": root, "requests_per_minute": 3}
               for n, root in (roots or {}).items()}
    return {"tenants": {**loaders,
        "acme": {"api_keys": [ACME], "adapters": ["acme-*"]},
        "globex": {"api_keys": [GLOBEX], "adapters": ["globex-*"]},
        "initech": {"api_keys": [INITECH], "prefix_cache": "shared:partners"},
        "hooli": {"api_keys": [HOOLI], "prefix_cache": "shared:partners"},
        "metered": {"api_keys": [METERED], "requests_per_minute": 8, "tokens_per_minute": 400, "max_concurrent": 4},
        "billed": {"api_keys": [BILLED], "adapters": ["billed-*"], "base_model": False,
                   "tokens_per_minute": 100000}}}


def _serve(model_dir, folder, lora_modules=None, roots=None, **engine_args):
    from loraplex.api.server import ServerConfig

    path = folder / "tenants.json"
    path.write_text(json.dumps(_tenants(roots)))
    config = ServerConfig(served_model_name="tiny", model_path=str(model_dir), admin_api_key=ADMIN_KEY,
                          tenants_file=str(path))
    return start_server(model_dir, config, lora_modules, **engine_args)


@pytest.fixture(scope="module")
def tenanted(tiny_model_dir, tiny_adapters, tmp_path_factory):
    folder = tmp_path_factory.mktemp("isolation")
    roots = {n: str(folder / f"root-{n}") for n in ("a", "b")}
    for root in roots.values():
        shutil.copytree(tiny_adapters[2], Path(root) / "x")
    server = _serve(tiny_model_dir, folder, {"billed-a": tiny_adapters[0]}, roots,
                    num_kv_blocks=256, max_num_seqs=8, max_loras=2)
    yield server
    server.stop()


def _complete(server, key: str, prompt, max_tokens: int = 2, **fields):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **fields}
    return http(server, "/v1/completions", body, key=key)


# ---- 1. the prefix cache per tenant ----------------------------------------------------------------------------

PROMPT_LEN = 960


@pytest.fixture(scope="module")
def prefill_bound(tmp_path_factory):
    """A model whose prefill of a long prompt costs far more than the HTTP round trip, so a cache hit shows in
    the time to the first token (as it would on a real model)."""
    folder = tmp_path_factory.mktemp("prefill-bound")
    model = make_tiny_model(folder / "model", hidden_size=384, intermediate_size=1536, num_hidden_layers=4,
                            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048)
    server = _serve(model, folder, num_kv_blocks=1024, max_num_seqs=4, max_num_batched_tokens=1024)
    yield server
    server.stop()


def _fresh_prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 448) for _ in range(PROMPT_LEN)]


def _first_token_s(server, key: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    status, body = _complete(server, key, prompt, max_tokens=1)
    assert status == 200, body
    return time.perf_counter() - start


def _hits(server) -> int:
    return server.engine.stats().prefix_cache_hits


def _first_token_into(seconds: list[float], server, key: str, prompt: list[int]) -> int:
    """Appends the seconds to the first token to `seconds`; back: the prompt tokens the engine computed for it
    (looked up in the prefix cache and not found there: the prefill's work, which a busy machine does not
    change)."""
    before = server.engine.stats()
    seconds.append(_first_token_s(server, key, prompt))
    after = server.engine.stats()
    looked_up = after.prefix_cache_queries - before.prefix_cache_queries
    return looked_up - (after.prefix_cache_hits - before.prefix_cache_hits)


def test_another_tenants_cached_prompt_is_no_sooner_than_a_fresh_one(prefill_bound):
    """acme's prompts are cached for acme: globex sending the same prompt finds no block of it (the hit counter
    stays), so its prefill computes every token, as for a prompt nobody sent, and it waits as long; acme itself
    still gets its hit; initech and hooli share a group and so share their prompts. The work is counted; the
    waits are compared with the fresh prompts' timed alongside (5x margins, one retry), never with seconds."""
    rng = random.Random(0)
    _first_token_s(prefill_bound, ACME, _fresh_prompt(rng))  # warm-up: the first call pays one-off costs
    for _attempt in range(2):
        fresh, crossed, own = [], [], []
        for _ in range(5):
            secret = _fresh_prompt(rng)
            _first_token_s(prefill_bound, ACME, secret)
            hits = _hits(prefill_bound)
            crossed_work = _first_token_into(crossed, prefill_bound, GLOBEX, secret)
            assert _hits(prefill_bound) == hits  # not one block of acme's prompt
            fresh_work = _first_token_into(fresh, prefill_bound, GLOBEX, _fresh_prompt(rng))
            own_work = _first_token_into(own, prefill_bound, ACME, secret)
            assert _hits(prefill_bound) >= hits + PROMPT_LEN - 16  # acme's own repeat hits its cache
            assert crossed_work == fresh_work >= PROMPT_LEN - 16, (crossed_work, fresh_work)  # the whole prefill
            assert own_work <= 16, own_work  # the last partial block at most
        crossed_s, fresh_s, own_s = map(statistics.median, (crossed, fresh, own))
        if crossed_s >= 0.2 * fresh_s and own_s <= 0.5 * fresh_s:
            break
    assert crossed_s >= 0.2 * fresh_s, (crossed, fresh)  # a hit: ~0.1x
    assert own_s <= 0.5 * fresh_s, (own, fresh)  # a hit is visible here
    shared = _fresh_prompt(rng)
    _first_token_s(prefill_bound, INITECH, shared)
    hits = _hits(prefill_bound)
    _first_token_s(prefill_bound, HOOLI, shared)
    assert _hits(prefill_bound) > hits  # "shared:partners": the group's cache
    wait_idle(prefill_bound.engine)
    assert_all_blocks_free(prefill_bound.engine)


def test_cache_salt_is_combined_with_the_tenant_namespace(tenanted):
    """vLLM's per-request `cache_salt`: the same salt under two tenants still shares nothing, another salt
    under one tenant shares nothing, the same salt under the same tenant hits."""
    prompt = list(range(3, 3 + 64))
    hits = lambda: _hits(tenanted)  # noqa: E731
    assert _complete(tenanted, ACME, prompt, cache_salt="s1")[0] == 200
    before = hits()
    assert _complete(tenanted, GLOBEX, prompt, cache_salt="s1")[0] == 200
    assert _complete(tenanted, ACME, prompt, cache_salt="s2")[0] == 200
    assert _complete(tenanted, ACME, prompt)[0] == 200
    assert hits() == before
    assert _complete(tenanted, ACME, prompt, cache_salt="s1")[0] == 200
    assert hits() > before
    assert_error(_complete(tenanted, ACME, prompt, cache_salt=""), 400, "cache_salt")


# ---- 4. limits count the work -------------------------------------------------------------------------------

@pytest.fixture
def frozen(tenanted, monkeypatch):
    """The limits' clock stopped: no refill moves a bucket while a test reads it."""
    now = time.monotonic()
    monkeypatch.setattr(_limits(tenanted), "clock", lambda: now)


def test_limits_count_sequences_reserve_tokens_and_cover_every_costly_endpoint(tenanted, frozen):
    """metered: 8 sequences a minute, 4 at once, 400 tokens a minute. A call of 3 prompts x n 2 is 6 sequences:
    more than 4 at once, refused as larger than the limit; 2 prompts x n 2 fits; tokens are reserved for
    max_tokens at admission, so a call that could overrun the bucket is a 429 before it runs (its sequence
    stays counted: its prompt was read); /tokenize, /detokenize and /v1/validate_schema count too."""
    prompts = [[5, 6, 7, 8]] * 3
    assert_error(_complete(tenanted, METERED, prompts, n=2), 400, "max_concurrent 4")
    assert_error(_complete(tenanted, METERED, [5, 6, 7, 8], max_tokens=500), 400, "tokens_per_minute 400")
    status, body = _complete(tenanted, METERED, prompts[:2], n=2, max_tokens=40)  # 4 sequences, 168 tokens
    assert status == 200 and len(body["choices"]) == 4
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 160, "total_tokens": 168}
    refused = _complete(tenanted, METERED, [5, 6, 7, 8], max_tokens=240)  # 244 > the 232 left
    assert_error(refused, 429, "tokens per minute")  # sequences 1 (the 500-token call), 2-5, now 6 of 8
    assert http(tenanted, "/tokenize", {"prompt": "hello"}, key=METERED)[0] == 200  # 7 of 8
    assert http(tenanted, "/detokenize", {"tokens": [5, 6]}, key=METERED)[0] == 200  # 8 of 8
    assert_error(http(tenanted, "/tokenize", {"prompt": "hello"}, key=METERED), 429, "requests per minute")
    assert_error(http(tenanted, "/v1/validate_schema", {"schema": {"type": "object"}}, key=METERED), 429)
    assert_error(_complete(tenanted, METERED, [5, 6]), 429, "requests per minute")
    usage = http(tenanted, "/v1/usage", key=ADMIN_KEY)[1]["tenants"]["metered"]
    assert (usage["requests"], usage["prompt_tokens"], usage["generation_tokens"]) == (2, 8, 160)
    wait_idle(tenanted.engine)
    assert _limits(tenanted).running("metered") == 0  # every lease given back


def test_unused_reservations_come_back(tenanted, frozen):
    """A call that stops early gives back the tokens it reserved and did not use: billed = reserved - refund."""
    before = _bucket(tenanted, "billed")
    status, body = _complete(tenanted, BILLED, [5, 6, 7, 8], max_tokens=200, model="tiny:billed-a",
                             structured_outputs={"choice": ["a", "b"]}, ignore_eos=False)
    assert status == 200, body
    spent = body["usage"]["total_tokens"]
    assert spent < 20 and before - _bucket(tenanted, "billed") == pytest.approx(spent, abs=1.0)


def _limits(server):
    return server.uvicorn_server.config.app.state.loraplex.limits


def _bucket(server, tenant: str) -> float:
    """The tenant's token bucket (full before its first call)."""
    limits, per_minute = _limits(server), _tenants()["tenants"][tenant]["tokens_per_minute"]
    usage = limits._usage.get(tenant)
    if usage is None or usage.tokens is None:
        return float(per_minute)
    usage.tokens.refill(per_minute, limits.clock())  # as of the (stopped) clock
    return usage.tokens.level


def test_a_tenant_unloads_only_what_it_loaded_and_loads_count_against_its_limits(tenanted):
    """Two tenants whose patterns overlap (`shared-*`) and who may load: one cannot see that the other's adapter
    is in use, nor unload it (the same 404 as a name that does not exist); loads and unloads read folders, so
    they count as sequences against the tenant's requests_per_minute."""
    load = lambda key, name: http(tenanted, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": "x"},  # noqa
                                  key=key)
    unload = lambda key, name: http(tenanted, "/v1/unload_lora_adapter", {"lora_name": name}, key=key)  # noqa
    assert load("sk-loader-a", "shared-a")[0] == 200
    missing = unload("sk-loader-b", "shared-nope")
    assert_error(unload("sk-loader-b", "shared-a"), 404)
    assert json.dumps(unload("sk-loader-b", "shared-a")[1]).replace("shared-a", "X") == \
        json.dumps(missing[1]).replace("shared-nope", "X")
    assert unload("sk-loader-a", "shared-a")[0] == 200  # 2 of 3 this minute
    assert load("sk-loader-a", "shared-a")[0] == 200  # 3 of 3
    assert_error(unload("sk-loader-a", "shared-a"), 429, "requests per minute")


# ---- 5. keys match exactly ----------------------------------------------------------------------------------

def _status_with_header(server, value: str) -> int:
    parts = urlsplit(server.url)
    conn = httpclient.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.putrequest("GET", "/v1/models")
        conn.putheader("Authorization", value)  # sent as latin-1 bytes, as a client could
        conn.endheaders()
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.mark.parametrize("extra", ["\xa0", "\x85", "\x1c", "\x1f", "\x0c", "\x0b"])
def test_a_key_with_anything_but_spaces_or_tabs_around_it_is_401(tenanted, extra):
    """`str.strip` removes these (no-break space, next line, the separators, form feed, vertical tab): a key
    carrying one is another key. Only RFC 9110's optional whitespace is ignored."""
    assert _status_with_header(tenanted, f"Bearer {ACME}") == 200
    for value in (f"Bearer {ACME}{extra}", f"Bearer {extra}{ACME}"):
        assert _status_with_header(tenanted, value) in (400, 401), repr(value)  # h11 itself refuses some bytes


def test_spaces_and_tabs_around_a_key_are_ignored(tenanted):
    for value in (f"Bearer  {ACME}", f"Bearer\t{ACME}", f"bearer {ACME} \t", f"BEARER {ACME}"):
        assert _status_with_header(tenanted, value) == 200, repr(value)
    for value in (f"Bearer{ACME}", f"Basic {ACME}", f"Bearer {ACME[:-1]}", f"Bearer {ACME} x"):
        assert _status_with_header(tenanted, value) == 401, repr(value)


# ---- 7. the bill is what left the server --------------------------------------------------------------------

def _stream_and_drop(server, key: str, model: str, chunks_to_read: int) -> int:
    """Starts a stream of 480 tokens, reads `chunks_to_read` chunks, then closes the connection; the tokens it
    was sent by then."""
    parts = urlsplit(server.url)
    conn = httpclient.HTTPConnection(parts.hostname, parts.port, timeout=60)
    body = json.dumps({"model": model, "prompt": [5, 6, 7, 8, 9], "max_tokens": 480, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {key}",
                                                   "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    received = 0
    while received < chunks_to_read:
        line = resp.fp.readline()
        if line.startswith(b"data: {"):
            received += 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    return received


def _usage(server) -> dict:
    return http(server, "/v1/usage", key=ADMIN_KEY)[1]


def test_a_dropped_stream_bills_its_prompt_and_every_token_it_was_sent(tenanted, frozen):
    """billed uses only its own adapter, so its totals and the adapter's move together; the token bucket holds
    exactly what /v1/usage billed."""
    before, level = _usage(tenanted), _bucket(tenanted, "billed")
    step = tenanted.engine.step

    def slowed():  # the 480 tokens outlast the server's noticing the drop, however fast the machine
        time.sleep(0.01)
        return step()

    tenanted.engine.step = slowed
    try:
        received = _stream_and_drop(tenanted, BILLED, "tiny:billed-a", 5)
        deadline = time.monotonic() + 30
        while _limits(tenanted).running("billed") and time.monotonic() < deadline:  # the server sees the drop
            time.sleep(0.05)
    finally:
        tenanted.engine.step = step
    assert _limits(tenanted).running("billed") == 0
    status, served = _complete(tenanted, BILLED, [5, 6, 7], max_tokens=7, model="tiny:billed-a",
                               stop=["zzzz-never"])
    assert status == 200
    after = _usage(tenanted)
    tenant = {k: after["tenants"]["billed"][k] - before["tenants"].get("billed", {}).get(k, 0)
              for k in ("requests", "prompt_tokens", "generation_tokens")}
    adapter = {k: after["adapters"]["billed-a"][k] - before["adapters"].get("billed-a", {}).get(k, 0)
               for k in ("requests", "prompt_tokens", "generation_tokens")}
    assert tenant == adapter
    assert tenant["requests"] == 2 and tenant["prompt_tokens"] == 5 + 3
    dropped = tenant["generation_tokens"] - served["usage"]["completion_tokens"]
    assert received <= dropped < 480, (received, dropped)  # what it was sent, not what it asked for
    billed = tenant["prompt_tokens"] + tenant["generation_tokens"]
    assert level - _bucket(tenanted, "billed") == pytest.approx(billed, abs=2.0)  # the bucket agrees
    wait_idle(tenanted.engine)
    assert_all_blocks_free(tenanted.engine)


def test_a_whole_answer_cut_short_by_the_timeout_bills_its_prompt_only(tenanted, frozen, monkeypatch):
    """A non-streamed call sends its tokens only with the whole answer: one the request timeout ends (504) sent
    none, so it bills its prompt (computed) and no completion tokens; the bucket agrees."""
    import dataclasses

    state = tenanted.uvicorn_server.config.app.state.loraplex
    monkeypatch.setattr(state, "config", dataclasses.replace(state.config, request_timeout_s=0.2))
    before, level = _usage(tenanted), _bucket(tenanted, "billed")
    status, body = _complete(tenanted, BILLED, [5, 6, 7, 8, 9], max_tokens=480, model="tiny:billed-a")
    assert status == 504, body
    wait_idle(tenanted.engine)
    after = _usage(tenanted)["tenants"]["billed"]
    billed = {k: after[k] - before["tenants"].get("billed", {}).get(k, 0) for k in ("prompt_tokens",
                                                                                   "generation_tokens")}
    assert billed == {"prompt_tokens": 5, "generation_tokens": 0}
    assert level - _bucket(tenanted, "billed") == pytest.approx(5, abs=0.5)
    assert_all_blocks_free(tenanted.engine)
