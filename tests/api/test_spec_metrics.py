"""Speculative decoding's numbers as the API shows them, from an `EngineStats` built by hand (no model):
the Prometheus series with vLLM's names, `/v1/stats`' `spec_decode` for the operator and for a tenant (only
the adapters no other tenant may use, no engine-wide totals), and the replicas' counters added up under Ray."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.api.tenancy.callers import Caller
from loraplex.api.admin.metrics import ServerMetrics
from loraplex.api.cluster.ray_merge import merge_spec_decode, merge_stats, scoped_stats
from loraplex.api.admin.routes_console import stats as stats_route
from loraplex.api.tenancy.tenants import parse_tenants
from loraplex.platform.engine.llm_engine import EngineStats
from loraplex.platform.spec_decode.speculative import SpecCounters

TENANTS = parse_tenants({"tenants": {
    "acme": {"api_keys": ["sk-acme"], "adapters": ["acme-*", "shared-*"]},
    "globex": {"api_keys": ["sk-globex"], "adapters": ["globex-*", "shared-*"]}}})


def _stats(spec: bool = True) -> EngineStats:
    if not spec:
        return EngineStats(num_running=0, num_waiting=0, kv_usage=0.0)
    return EngineStats(num_running=1, num_waiting=0, kv_usage=0.5,
                       spec_decode=SpecCounters(10, 40, 25, [9, 8, 5, 3]),
                       spec_decode_by_adapter={"acme-a": SpecCounters(4, 16, 12, [4, 4, 3, 1]),
                                               "shared-s": SpecCounters(3, 12, 3, [2, 1, 0, 0]),
                                               "globex-g": SpecCounters(3, 12, 10, [3, 3, 2, 2])})


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_prometheus_has_vllms_spec_decode_counters_engine_wide_per_position_and_per_adapter():
    samples = _samples(ServerMetrics(_stats).render().decode())
    assert samples[("loraplex:spec_decode_num_drafts_total", ())] == 10
    assert samples[("loraplex:spec_decode_num_draft_tokens_total", ())] == 40
    assert samples[("loraplex:spec_decode_num_accepted_tokens_total", ())] == 25
    per_pos = {dict(labels)["position"]: v for (name, labels), v in samples.items()
               if name == "loraplex:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 9, "1": 8, "2": 5, "3": 3}
    for name, expected in (("num_drafts", {"acme-a": 4, "shared-s": 3, "globex-g": 3}),
                           ("num_draft_tokens", {"acme-a": 16, "shared-s": 12, "globex-g": 12}),
                           ("num_accepted_tokens", {"acme-a": 12, "shared-s": 3, "globex-g": 10})):
        got = {dict(labels)["lora_name"]: v for (sample, labels), v in samples.items()
               if sample == f"loraplex:spec_decode_adapter_{name}_total"}
        assert got == expected


def test_prometheus_has_no_spec_decode_series_without_speculation():
    assert "spec_decode" not in ServerMetrics(lambda: _stats(spec=False)).render().decode()


def test_operator_stats_carry_totals_rates_positions_and_every_adapter():
    spec = ServerMetrics(_stats).server_snapshot()["spec_decode"]
    assert spec["drafts"] == 10 and spec["draft_tokens"] == 40 and spec["accepted_tokens"] == 25
    assert spec["acceptance_rate"] == pytest.approx(25 / 40)
    assert spec["mean_acceptance_length"] == pytest.approx(1 + 25 / 10)  # vLLM's: the verify step's own token too
    assert spec["accepted_per_position"] == [9, 8, 5, 3]
    assert spec["by_adapter"]["acme-a"] == {"drafts": 4, "draft_tokens": 16, "accepted_tokens": 12,
                                            "acceptance_rate": pytest.approx(0.75)}
    assert set(spec["by_adapter"]) == {"acme-a", "shared-s", "globex-g"}


def test_stats_spec_decode_is_null_without_speculation_and_rates_null_before_any_draft():
    assert ServerMetrics(lambda: _stats(spec=False)).server_snapshot()["spec_decode"] is None
    idle = EngineStats(num_running=0, num_waiting=0, kv_usage=0.0, spec_decode=SpecCounters())
    spec = ServerMetrics(lambda: idle).server_snapshot()["spec_decode"]
    assert spec["acceptance_rate"] is None and spec["mean_acceptance_length"] is None
    assert spec["by_adapter"] == {} and spec["accepted_per_position"] == []


def _route(caller: Caller, stats=_stats) -> dict:
    request = SimpleNamespace(state=SimpleNamespace(caller=caller))
    state = SimpleNamespace(metrics=ServerMetrics(stats), tenants=SimpleNamespace(current=TENANTS))
    return asyncio.run(stats_route(request, state))


def test_a_tenant_reads_only_adapters_no_other_tenant_may_use_and_no_engine_totals():
    acme = _route(Caller("tenant", TENANTS.by_name["acme"]))["spec_decode"]
    # shared-s moves with globex's traffic too, globex-g is not acme's; the totals are everyone's
    assert acme == {"by_adapter": {"acme-a": {"drafts": 4, "draft_tokens": 16, "accepted_tokens": 12,
                                              "acceptance_rate": pytest.approx(0.75)}}}
    assert set(_route(Caller("tenant", TENANTS.by_name["globex"]))["spec_decode"]["by_adapter"]) == {"globex-g"}
    assert _route(Caller("tenant", TENANTS.by_name["acme"]), lambda: _stats(spec=False))["spec_decode"] is None
    admin = _route(Caller("admin"))["spec_decode"]
    assert admin["drafts"] == 10 and set(admin["by_adapter"]) == {"acme-a", "shared-s", "globex-g"}


def _spec(drafts, draft_tokens, accepted, per_pos, by_adapter) -> dict:
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted, "acceptance_rate": 0.0,
            "mean_acceptance_length": 0.0, "accepted_per_position": per_pos,
            "by_adapter": {name: {"drafts": d, "draft_tokens": t, "accepted_tokens": a, "acceptance_rate": 0.0}
                           for name, (d, t, a) in by_adapter.items()}}


def test_replicas_spec_counters_are_summed_and_rates_recomputed_from_the_sums():
    ra = _spec(2, 8, 8, [2, 2, 2, 2], {"acme-a": (2, 8, 8)})
    rb = _spec(6, 12, 0, [0, 0], {"acme-a": (1, 2, 0), "globex-g": (5, 10, 0)})
    merged = merge_spec_decode([ra, rb])
    assert (merged["drafts"], merged["draft_tokens"], merged["accepted_tokens"]) == (8, 20, 8)
    assert merged["acceptance_rate"] == pytest.approx(8 / 20)  # not the mean of 1.0 and 0.0
    assert merged["mean_acceptance_length"] == pytest.approx(2.0)
    assert merged["accepted_per_position"] == [2, 2, 2, 2]
    assert merged["by_adapter"]["acme-a"] == {"drafts": 3, "draft_tokens": 10, "accepted_tokens": 8,
                                              "acceptance_rate": pytest.approx(0.8)}
    assert merge_spec_decode([None, None]) is None
    assert merge_stats({"ra": {"spec_decode": ra}, "rb": {"spec_decode": rb}})["spec_decode"] == merged


def test_under_ray_a_tenant_reads_its_replicas_adapters_summed_over_the_engines():
    ra = _spec(2, 8, 8, [2], {"acme-a": (2, 8, 8), "globex-g": (1, 1, 1)})
    rb = _spec(1, 2, 0, [0], {"acme-a": (1, 2, 0)})
    merged = merge_stats({"ra": {"spec_decode": ra, "tenants": {"acme": {"requests": 1}}},
                          "rb": {"spec_decode": rb, "tenants": {"acme": {"requests": 2}}}})
    reply = {"tenant": "acme", "adapter_scope": ["acme-*"], "requests": 1,
             "spec_decode": {"by_adapter": {"acme-a": ra["by_adapter"]["acme-a"]}}}
    mine = scoped_stats(merged, reply)
    assert mine["requests"] == 3
    assert mine["spec_decode"] == {"by_adapter": {"acme-a": {"drafts": 3, "draft_tokens": 10, "accepted_tokens": 8,
                                                             "acceptance_rate": pytest.approx(0.8)}}}
    assert scoped_stats(merged, {**reply, "spec_decode": None})["spec_decode"] is None
    assert scoped_stats(merged, {})["spec_decode"]["drafts"] == 3  # the operator: the engines' totals
