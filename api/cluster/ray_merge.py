"""The replicas' views merged into the cluster's: pure functions over plain data (no Ray), so each
is tested with dicts (tests/api/test_ray_merge.py).

What is merged: `/metrics` (every replica's Prometheus text, labelled by replica), `/v1/stats`
(counts summed, percentiles the worst replica's, speculation's rates from the summed counts; a tenant
reads only its own), `/v1/adapters` (each adapter with the replicas holding it; a tenant's own
traffic). `/v1/usage` needs no merging: the cluster has one usage ledger, the catalog's. The ingress
(`api/cluster/ray_ingress.py`) calls `merged_view` with the replica's answer and the views the
catalog holds from the replicas' heartbeats (`api/cluster/ray_catalog.py`)."""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from loraplex.api.openai import openai_format as fmt
from loraplex.api.admin.metrics import acceptance_length, spec_rates

__all__ = ["merge_adapters", "merge_metrics", "merge_spec_decode", "merge_stats", "merged_view",
           "scoped_stats", "tenant_adapters"]

Counts = dict[str, int]


# ---- /metrics -------------------------------------------------------------------------------


def merge_metrics(by_replica: dict[str, str]) -> bytes:
    """Each replica's Prometheus text as one exposition, every sample labelled with its replica."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(by_replica.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            merged.samples += [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]

    class Collected:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collected())
    return generate_latest(registry)


# ---- /v1/stats ------------------------------------------------------------------------------


def merge_stats(by_replica: dict[str, dict]) -> dict:
    """Each replica's `/v1/stats` as one: counts summed, usage averaged, adapter lists joined,
    latency percentiles the worst replica's, each tenant's own numbers (`tenants`) merged alike;
    each replica's own under `replicas`."""
    stats = [s for _, s in sorted(by_replica.items())]
    if not stats:
        return {"replicas": {}}
    return {**_merged(stats), "replicas": dict(sorted(by_replica.items()))}


def _merged(stats: list[dict]) -> dict:
    merged: dict = {}
    for key in dict.fromkeys(key for s in stats for key in s):
        merged[key] = _merged_value(key, [s[key] for s in stats if key in s])
    return merged


def _merged_value(key: str, values: list):
    """One stats field over the replicas that have it; its name or its type says how."""
    first = values[0]
    if key == "time":
        return max(values)
    if key == "tenants":
        return {name: _merged([v[name] for v in values if name in v])
                for name in sorted({name for v in values for name in v})}
    if key == "served":
        return _summed_counts(values)
    if key == "spec_decode":
        return merge_spec_decode(values)
    if key.endswith("_perc"):
        return sum(values) / len(values)
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(values)
    if isinstance(first, list):
        return list(dict.fromkeys(v for value in values for v in value))
    if isinstance(first, dict):
        return _worst_percentiles(values)
    return first


def _worst_percentiles(values: list[dict]) -> dict:
    out = {}
    for key in values[0]:
        present = [v[key] for v in values if v.get(key) is not None]
        out[key] = (sum(present) if key == "count" else max(present)) if present else None
    return out


_SPEC_COUNTS = ("drafts", "draft_tokens", "accepted_tokens")


def merge_spec_decode(values: list[dict | None]) -> dict | None:
    """The replicas' `spec_decode` added up: counts and accepts per position summed, rates recomputed from
    the sums (an average of rates would weigh an idle replica like a busy one); None without speculation."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    counts = _spec_json(present)
    positions = [v.get("accepted_per_position", []) for v in present]
    per_position = [sum(p[i] for p in positions if i < len(p)) for i in range(max(map(len, positions)))]
    names = sorted({name for v in present for name in v.get("by_adapter", {})})
    by_adapter = {name: _spec_json([v["by_adapter"][name] for v in present if name in v.get("by_adapter", {})])
                  for name in names}
    return {**counts, "mean_acceptance_length": acceptance_length(counts["drafts"], counts["accepted_tokens"]),
            "accepted_per_position": per_position, "by_adapter": by_adapter}


def _spec_json(values: list[dict]) -> dict:
    return spec_rates(*(sum(v.get(key, 0) for v in values) for key in _SPEC_COUNTS))


def _tenant_spec(merged: dict, reply: dict) -> dict | None:
    """A tenant's `spec_decode` over the replicas: the adapters its replica let it read (`by_adapter` of its
    reply: only it may use them), each summed over every replica's engine."""
    own = reply.get("spec_decode")
    if own is None:
        return None
    engines = (merged.get("spec_decode") or {}).get("by_adapter", {})
    return {"by_adapter": {name: engines.get(name, counts) for name, counts in own.get("by_adapter", {}).items()}}


def scoped_stats(merged: dict, reply: dict) -> dict:
    """The merged stats as the caller may read them. A tenant (the replica's reply names it) reads its
    own numbers added up over the replicas, nothing of the engines' (docs/tenants.md); any other caller
    the engines', without each tenant's own."""
    tenant = reply.get("tenant")
    if tenant is None and "adapter_scope" not in reply:
        replicas = {name: _without_tenants(s) for name, s in merged.get("replicas", {}).items()}
        return {**_without_tenants(merged), **({"replicas": replicas} if "replicas" in merged else {})}
    own = merged.get("tenants", {}).get(tenant) if tenant is not None else None
    if own is None:  # no heartbeat carries its numbers yet: the replica's own answer
        return reply
    spec = {"spec_decode": _tenant_spec(merged, reply)} if "spec_decode" in reply else {}
    return {**{k: v for k, v in own.items() if k != "served"}, "tenant": tenant,
            "adapter_scope": reply.get("adapter_scope", []), **spec}


def _without_tenants(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k != "tenants"}


# ---- counts added up ------------------------------------------------------------------------


def _added(counts: Iterable[Counts]) -> Counts:
    """Flat counts added up key by key."""
    out: Counts = {}
    for value in counts:
        for key, count in value.items():
            out[key] = out.get(key, 0) + count
    return out


def _summed_counts(values: list[dict[str, Counts]]) -> dict[str, Counts]:
    """Counts per name (an adapter's traffic, a tenant's usage), added up name by name."""
    names = dict.fromkeys(name for value in values for name in value)
    return {name: _added(value[name] for value in values if name in value) for name in names}


# ---- /v1/adapters ---------------------------------------------------------------------------


TIERS = ("slot", "cpu", "spill", "disk")  # nearest first: a merged row says the nearest any replica has


def merge_adapters(reply: dict, by_replica: dict[str, list[dict]]) -> dict:
    """A replica's `/v1/adapters` (every shared name) with each adapter's residency and traffic
    summed over the replicas, and `replicas`: those holding it."""
    rows_of = {replica: {row["id"]: row for row in rows} for replica, rows in by_replica.items()}
    data = []
    for row in reply.get("data", []):
        here = {replica: rows[row["id"]] for replica, rows in sorted(rows_of.items()) if row["id"] in rows}
        rows = here.values()
        data.append({**row, "replicas": list(here), "in_memory": any(r.get("in_memory") for r in rows),
                     "resident": any(r.get("resident") for r in rows), "pinned": sum(r.get("pinned", 0) for r in rows),
                     "tier": min((r.get("tier", "disk") for r in rows), key=TIERS.index, default="disk"),
                     **{k: sum(r.get(k, 0) for r in rows) for k in ("hits", "misses", "bytes_read")},
                     "requests": sum(r.get("requests", 0) for r in rows),
                     "generation_tokens": sum(r.get("generation_tokens", 0) for r in rows)})
    return {**reply, "data": data}


def tenant_adapters(reply: dict, served: list[dict[str, Counts]]) -> dict:
    """A tenant's `/v1/adapters` (its replica's reply) with its own traffic on each adapter and the base
    model added up over the replicas (`served`: each replica's, from its stats); nothing of where an
    adapter is."""
    summed = _summed_counts(served)
    rows = [{**row, **fmt.adapter_traffic(summed.get(row["id"], {}))} for row in reply.get("data", [])]
    return {**reply, "data": rows, "base": fmt.adapter_traffic(summed.get("", {}))}


# ---- the views the ingress answers ----------------------------------------------------------


def _stats_view(reply: dict, views: dict[str, dict]) -> dict:
    return scoped_stats(merge_stats({replica: view["stats"] for replica, view in views.items()}), reply)


def _adapters_view(reply: dict, views: dict[str, dict]) -> dict:
    tenant = reply.get("tenant")
    if tenant is None:
        return merge_adapters(reply, {replica: view["adapters"] for replica, view in views.items()})
    return tenant_adapters(reply, [view.get("stats", {}).get("tenants", {}).get(tenant, {}).get("served", {})
                                   for view in views.values()])


# path -> how the replicas' views answer it; the replica's own reply says who asked (a tenant, its scope)
JSON_VIEWS: dict[str, Callable[[dict, dict[str, dict]], dict]] = {
    "/v1/stats": _stats_view, "/v1/adapters": _adapters_view}


def merged_view(path: str, reply: dict, views: dict[str, dict]) -> dict:
    """The cluster's answer to GET `path` (one of `JSON_VIEWS`): `reply` is one replica's answer,
    `views` each live replica's heartbeat view (`EngineReplica.view`: stats, adapters).
    Before any heartbeat, the one replica's answer."""
    if not views:
        return reply
    return JSON_VIEWS[path](reply, views)
