"""The JSON the web console reads: adapters with shape, residency and traffic; a live stats
snapshot; schemas checked without generating. Also what any client may use."""

from __future__ import annotations

from live_server import ADMIN_KEY, SCHEMA, assert_error, client, http, live, wait_idle  # noqa: F401

MSG = [{"role": "user", "content": "Hello world"}]


def test_adapters_show_shape_residency_and_traffic(client, live):
    before = {a["id"]: a for a in http(live, "/v1/adapters")[1]["data"]}
    assert set(before) >= {"a0", "a1"}
    a0 = before["a0"]
    cards = {c["id"]: c for c in http(live, "/v1/models")[1]["data"]}
    assert a0["rank"] > 0 and set(a0["target_modules"]) <= {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"} and a0["target_modules"]
    assert a0["path"] is None  # a user key sees no folder; the admin key sees the one of the model card
    admin_a0 = next(a for a in http(live, "/v1/adapters", key=ADMIN_KEY)[1]["data"] if a["id"] == "a0")
    assert admin_a0["path"] == http(live, "/v1/models/a0", key=ADMIN_KEY)[1]["root"] and admin_a0["path"]
    reply = client.chat.completions.create(model="a0", messages=MSG, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    wait_idle(live.engine)
    status, after = http(live, "/v1/adapters")
    row = next(a for a in after["data"] if a["id"] == "a0")
    assert row["requests"] == a0["requests"] + 1
    assert row["generation_tokens"] == a0["generation_tokens"] + reply.usage.completion_tokens == \
        a0["generation_tokens"] + 5
    assert row["resident"] and row["in_memory"] and row["pinned"] == 0  # it ran, so it took a slot; done, unpinned
    assert row["tier"] == "slot" and row["hits"] + row["misses"] > a0["hits"] + a0["misses"]
    assert set(after["base"]) == {"requests", "generation_tokens"}
    assert_error(http(live, "/v1/adapters", key=None), 401)


def test_adapters_page_and_search_for_a_console_of_thousands(live):
    every = [a["id"] for a in http(live, "/v1/adapters")[1]["data"]]
    status, first = http(live, "/v1/adapters?limit=1")
    assert [a["id"] for a in first["data"]] == every[:1] and first["total"] == len(every)
    assert first["has_more"] == (len(every) > 1)
    last = http(live, f"/v1/adapters?limit=1&offset={len(every) - 1}")[1]
    assert [a["id"] for a in last["data"]] == every[-1:] and not last["has_more"]
    found = http(live, "/v1/adapters?search=A1")[1]  # any case, a part of the name
    assert [a["id"] for a in found["data"]] == [n for n in every if "a1" in n.lower()] and found["total"] >= 1
    for bad in ("limit=0", "limit=x", "offset=-1", "limit=100000"):
        assert_error(http(live, f"/v1/adapters?{bad}"), 400)
    metrics = http(live, "/metrics")[1]
    assert 'loraplex:adapters{tier="slot"}' in metrics and "loraplex:adapter_misses_total" in metrics
    assert 'loraplex:adapter_slot_fills_total{by="prefetch"}' in metrics


def test_stats_move_with_traffic(client, live):
    first = http(live, "/v1/stats")[1]
    assert {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "generation_tokens",
            "prompt_tokens", "requests", "ttft_ms", "itl_ms"} <= set(first)
    client.completions.create(model="tiny", prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True})
    second = http(live, "/v1/stats")[1]
    assert second["generation_tokens"] == first["generation_tokens"] + 4
    assert second["requests"] == first["requests"] + 1 and second["time"] >= first["time"]
    assert second["ttft_ms"]["count"] >= 1 and second["ttft_ms"]["p50"] > 0


def test_schemas_are_checked_without_generating(live):
    status, out = http(live, "/v1/validate_schema", {"schema": SCHEMA})
    assert status == 200 and out["valid"] and out["backend"] in ("llguidance", "xgrammar", "outlines")
    loose = {"type": "object", "properties": {"xs": {"type": "array", "contains": {"type": "integer"}}}}
    assert_error(http(live, "/v1/validate_schema", {"schema": loose}), 400, "'contains'")
    status, out = http(live, "/v1/validate_schema", {"schema": loose, "strict": False})
    assert status == 200 and out["unenforced_keywords"] == ["contains at #/properties/xs"]
    assert_error(http(live, "/v1/validate_schema", {"schema": [1]}), 400, "schema")
