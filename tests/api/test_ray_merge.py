"""The replicas' views merged into the cluster's (`api/cluster/ray_merge.py`): plain dicts in, plain dicts
out, no Ray. One test per merged view, and `merged_view`, the ingress's dispatch over them."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.api.cluster.ray_merge import (JSON_VIEWS, merge_adapters, merge_metrics, merge_stats, merged_view,
                                    scoped_stats, tenant_adapters)


def _exposition(requests: int, running: int, adapter: str) -> str:
    return ("# HELP loraplex:request_success_total Requests finished.\n"
            "# TYPE loraplex:request_success_total counter\n"
            f'loraplex:request_success_total{{finished_reason="stop"}} {requests}\n'
            "# HELP loraplex:num_requests_running Running.\n# TYPE loraplex:num_requests_running gauge\n"
            f"loraplex:num_requests_running {running}\n"
            "# HELP loraplex:adapter_loaded Adapter held.\n# TYPE loraplex:adapter_loaded gauge\n"
            f'loraplex:adapter_loaded{{lora_name="{adapter}"}} 1\n')


def test_metrics_keep_each_replicas_samples_and_labels_under_one_family():
    merged = merge_metrics({"rb": _exposition(4, 0, "y"), "ra": _exposition(2, 1, "x")}).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    success = families["loraplex:request_success"]
    assert success.type == "counter" and success.documentation == "Requests finished."
    assert [(s.labels, s.value) for s in success.samples if s.name.endswith("_total")] == [
        ({"finished_reason": "stop", "replica": "ra"}, 2.0), ({"finished_reason": "stop", "replica": "rb"}, 4.0)]
    loaded = {(s.labels["lora_name"], s.labels["replica"]) for s in families["loraplex:adapter_loaded"].samples}
    assert loaded == {("x", "ra"), ("y", "rb")}
    assert merged.count("# HELP loraplex:num_requests_running ") == 1
    assert merge_metrics({}) == b""


def test_stats_fields_merge_by_their_name_or_type():
    ra = {"time": 5.0, "gpu_cache_usage_perc": 0.1, "num_requests_waiting": 3, "model": "m", "enabled": True,
          "waiting_adapters": ["x", "y"], "itl_ms": {"p50": 1.0, "p99": 8.0, "count": 10},
          "served": {"x": {"requests": 1}, "": {"requests": 2}}}
    rb = {"time": 4.0, "gpu_cache_usage_perc": 0.3, "num_requests_waiting": 1, "model": "m", "enabled": False,
          "waiting_adapters": ["y", "z"], "itl_ms": {"p50": 3.0, "p99": None, "count": 5},
          "served": {"x": {"requests": 4, "prompt_tokens": 7}}, "only_here": 9}
    merged = merge_stats({"rb": rb, "ra": ra})
    assert merged["time"] == 5.0  # the latest
    assert merged["gpu_cache_usage_perc"] == pytest.approx(0.2)  # usage: averaged
    assert merged["num_requests_waiting"] == 4 and merged["only_here"] == 9  # counts: summed where present
    assert merged["model"] == "m" and merged["enabled"] is True  # neither a count nor a list: the first's
    assert merged["waiting_adapters"] == ["x", "y", "z"]  # joined, each once, in order
    assert merged["itl_ms"] == {"p50": 3.0, "p99": 8.0, "count": 15}  # the worst replica's, counts summed
    assert merged["served"] == {"x": {"requests": 5, "prompt_tokens": 7}, "": {"requests": 2}}
    assert merged["replicas"] == {"ra": ra, "rb": rb}


def test_each_tenants_stats_merge_alike_and_only_the_tenant_reads_them():
    def own(running: int, served: int) -> dict:
        return {"num_requests_running": running, "served": {"t-a": {"requests": served}}}

    merged = merge_stats({"ra": {"num_requests_running": 4, "tenants": {"t": own(1, 2)}},
                          "rb": {"num_requests_running": 2, "tenants": {"t": own(2, 3), "u": own(5, 5)}}})
    assert merged["tenants"]["t"] == {"num_requests_running": 3, "served": {"t-a": {"requests": 5}}}
    assert merged["tenants"]["u"]["num_requests_running"] == 5

    engines = scoped_stats(merged, {"num_requests_running": 4})  # the admin: the engines', no tenant's own
    assert engines["num_requests_running"] == 6 and "tenants" not in engines
    assert all("tenants" not in s for s in engines["replicas"].values())
    assert scoped_stats({"time": 1.0}, {}) == {"time": 1.0}  # no replicas listed: none added

    mine = scoped_stats(merged, {"tenant": "t", "adapter_scope": ["t-*"]})
    assert mine == {"num_requests_running": 3, "tenant": "t", "adapter_scope": ["t-*"]}
    early = {"tenant": "v", "adapter_scope": ["v-*"], "num_requests_running": 0}
    assert scoped_stats(merged, early) is early  # no heartbeat has its numbers yet
    assert scoped_stats(merged, {"adapter_scope": []}) == {"adapter_scope": []}  # a scope but no tenant


def test_adapters_list_their_holders_with_residency_and_traffic_added_up():
    def held(name: str, **fields) -> dict:
        return {"id": name, "in_memory": True, **fields}

    reply = {"object": "list", "data": [{"id": "x", "rank": 4}, {"id": "nowhere", "rank": 16}]}
    by_replica = {"rb": [held("x", resident=True, pinned=1, requests=2, generation_tokens=20, tier="slot", hits=4)],
                  "ra": [held("x", pinned=2, requests=1, tier="cpu", misses=2, bytes_read=10), held("stale")]}
    merged = merge_adapters(reply, by_replica)
    assert merged["object"] == "list"
    assert merged["data"] == [
        {"id": "x", "rank": 4, "replicas": ["ra", "rb"], "in_memory": True, "resident": True, "pinned": 3,
         "tier": "slot", "hits": 4, "misses": 2, "bytes_read": 10, "requests": 3, "generation_tokens": 20},
        {"id": "nowhere", "rank": 16, "replicas": [], "in_memory": False, "resident": False, "pinned": 0,
         "tier": "disk", "hits": 0, "misses": 0, "bytes_read": 0, "requests": 0,
         "generation_tokens": 0}]  # only the reply's names: "stale" is no longer shared


def test_a_tenants_adapters_carry_its_own_traffic_and_nothing_of_where_they_are():
    reply = {"object": "list", "tenant": "t", "data": [{"id": "t-a", "rank": 8}, {"id": "t-b", "rank": 8}]}
    served = [{"t-a": {"requests": 1, "generation_tokens": 5}, "": {"requests": 2, "generation_tokens": 1}},
              {"t-a": {"requests": 3, "generation_tokens": 7}}]
    merged = tenant_adapters(reply, served)
    assert merged["tenant"] == "t"
    assert merged["data"] == [{"id": "t-a", "rank": 8, "requests": 4, "generation_tokens": 12},
                              {"id": "t-b", "rank": 8, "requests": 0, "generation_tokens": 0}]
    assert merged["base"] == {"requests": 2, "generation_tokens": 1}


def _views() -> dict[str, dict]:
    """Two replicas' heartbeat views (`EngineReplica.view`)."""
    def view(running: int, tenant_requests: int, adapters: list[dict]) -> dict:
        tenants = {"t": {"requests": tenant_requests, "served": {"t-a": {"requests": tenant_requests}}}}
        return {"stats": {"num_requests_running": running, "tenants": tenants}, "adapters": adapters}

    return {"ra": view(1, 2, [{"id": "t-a", "requests": 2}]), "rb": view(3, 1, [])}


def test_the_ingress_answers_each_view_from_the_replicas_heartbeats():
    assert set(JSON_VIEWS) == {"/v1/stats", "/v1/adapters"}  # /v1/usage: the catalog's one ledger
    stats = merged_view("/v1/stats", {"num_requests_running": 1}, _views())
    assert stats["num_requests_running"] == 4 and set(stats["replicas"]) == {"ra", "rb"}
    assert merged_view("/v1/stats", {"tenant": "t", "adapter_scope": ["t-*"]}, _views())["requests"] == 3

    rows = merged_view("/v1/adapters", {"data": [{"id": "t-a"}]}, _views())["data"]
    assert rows[0]["replicas"] == ["ra"] and rows[0]["requests"] == 2
    tenant = merged_view("/v1/adapters", {"tenant": "t", "data": [{"id": "t-a"}]}, _views())
    assert tenant["data"][0]["requests"] == 3 and "replicas" not in tenant["data"][0]


def test_before_any_heartbeat_the_ingress_passes_the_replicas_own_answer_on():
    for path in JSON_VIEWS:
        reply = {"answered_by": "one replica"}
        assert merged_view(path, reply, {}) is reply
