"""Prometheus metrics with vLLM's names under our prefix. Engine state (queues, KV usage,
prefix-cache hits, adapters, speculative decoding's counters) is read from the engine's latest stats snapshot at
scrape time;
latencies and token counts are recorded by the server as requests stream. Each tenant's console
numbers (`TenantNumbers`) are kept apart, from its own requests only. What is billed (each answered
prompt, each 429) also goes to the usage ledger (`api/admin/ledger.py`), which outlives the process."""

from __future__ import annotations

import statistics
import time
import uuid
import weakref
from collections import deque
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraplex.api.admin.ledger import RemoteLedger, UsageLedger, UsageRow
from loraplex.platform.engine.engine_client import AdapterMix, EngineStats

P = "loraplex:"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats()
        yield GaugeMetricFamily(P + "num_requests_running", "Sequences in the running batch.", s.num_running)
        yield GaugeMetricFamily(P + "num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield GaugeMetricFamily(P + "kv_cache_usage_perc", "KV blocks held by requests / all blocks (0-1).",
                                s.kv_usage)
        rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        yield GaugeMetricFamily(P + "prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up.",
                                rate)
        yield CounterMetricFamily(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  s.prefix_cache_queries)
        yield CounterMetricFamily(P + "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  s.prefix_cache_hits)
        yield CounterMetricFamily(P + "num_preemptions", "Sequences preempted (recomputed later).",
                                  s.num_preemptions)
        yield CounterMetricFamily(P + "structured_output_checked", "Finished JSON outputs checked against their "
                                  "schema with the jsonschema validator.", s.structured_checked)
        violations = CounterMetricFamily(P + "structured_output_violations", "Finished JSON outputs that break their "
                                         "schema (strict=true: a bug; false: a keyword the request let drop).",
                                         labels=["strict"])
        violations.add_metric(["true"], s.schema_violations_strict)
        violations.add_metric(["false"], s.schema_violations_lenient)
        yield violations
        info = GaugeMetricFamily(P + "lora_requests_info", "Running and waiting LoRA adapters (value: time).",
                                 labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([",".join(s.running_adapters), ",".join(s.waiting_adapters), str(s.max_loras)], time.time())
        yield info
        if s.spec_decode is not None:  # without --speculative-config the series do not exist (as in vLLM)
            yield from _spec_families(s)


# vLLM's spec-decode counters: (name, help, SpecCounters attribute)
_SPEC_COUNTERS = (("num_drafts", "Verify steps of a request that had drafts.", "num_drafts"),
                  ("num_draft_tokens", "Draft tokens verified.", "num_draft_tokens"),
                  ("num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens"))


def _spec_families(s: EngineStats):
    """Engine-wide counters, accepted per draft position, and per adapter (a mix counts for each adapter)."""
    for name, help, attr in _SPEC_COUNTERS:
        yield CounterMetricFamily(P + "spec_decode_" + name, help, getattr(s.spec_decode, attr))
    per_pos = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos", "Drafts whose token at this "
                                  "position was accepted.", labels=["position"])
    for position, accepted in enumerate(s.spec_decode.accepted_per_position):
        per_pos.add_metric([str(position)], accepted)
    yield per_pos
    for name, help, attr in _SPEC_COUNTERS:
        family = CounterMetricFamily(P + "spec_decode_adapter_" + name, help[:-1] + ", per LoRA adapter.",
                                     labels=["lora_name"])
        for adapter, counters in sorted(s.spec_decode_by_adapter.items()):
            family.add_metric([adapter], getattr(counters, attr))
        yield family


class _StoreCollector:
    """Adapters from object storage (`api/sources/adapter_store.py`): the disk cache's hits and misses, downloads, bytes,
    failed fetches, evictions, and the bytes it holds."""

    HELP = {"cache_hits": "First uses of an adapter served from the disk cache.",
            "cache_misses": "First uses of an adapter that had to be downloaded.",
            "downloads": "Adapters downloaded from object storage.",
            "download_bytes": "Bytes downloaded from object storage.",
            "fetch_failures": "Object-storage reads that failed (a first use answered 503 or 504; a failed TTL "
                              "check leaves the loaded version serving).",
            "evictions": "Adapters removed from the disk cache to keep its size bound."}

    def __init__(self) -> None:
        self.store = None  # set by the server once it has an AdapterStore

    def collect(self):
        if self.store is None:
            return
        counts = self.store.counts
        for name, help in self.HELP.items():
            yield CounterMetricFamily(P + "adapter_store_" + name, help, counts.get(name, 0))
        yield GaugeMetricFamily(P + "adapter_cache_bytes", "Bytes of fetched adapters on disk.",
                                self.store.cache.nbytes())


TOP_ADAPTERS = 10  # per-adapter residency series: the adapters with the most misses, never one per adapter


class _ResidencyCollector:
    """Where adapters are and what bringing them in cost, with label sets bounded however many are loaded: adapters
    per tier, hits, misses and bytes read over every adapter ever loaded (the engine's totals, so an unload never
    makes a counter go down), and the `TOP_ADAPTERS` adapters with the most misses."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats
        self.status: Callable[[], dict] | None = None  # the engine client's `adapter_status`, set by the server

    def collect(self):
        if self.status is None:
            return
        status = self.status()
        tiers = GaugeMetricFamily(P + "adapters", "Loaded adapters by where they are now (slot: in a slot; cpu: "
                                  "weights in memory; spill: prepared file on local disk; disk: their folder).",
                                  labels=["tier"])
        for tier in ("slot", "cpu", "spill", "disk"):
            tiers.add_metric([tier], sum(1 for a in status.values() if a.tier == tier))
        yield tiers
        s = self.stats()
        for name, help in (("hits", "Adapter uses that found its weights in memory."),
                           ("misses", "Adapter uses that read its weights (prepared file or folder)."),
                           ("bytes_read", "Bytes of adapter weights read back into memory.")):
            yield CounterMetricFamily(P + "adapter_" + name, help, getattr(s, "adapter_" + name))
        top = GaugeMetricFamily(P + "adapter_misses_top", f"Misses of the {TOP_ADAPTERS} adapters with the most.",
                                labels=["lora_name"])
        for name, a in sorted(status.items(), key=lambda kv: (-kv[1].misses, kv[0]))[:TOP_ADAPTERS]:
            if a.misses:
                top.add_metric([name], a.misses)
        yield top
        fills = CounterMetricFamily(P + "adapter_slot_fills", "Adapter slots filled: by the prefetcher beside a "
                                    "step, or by a step itself (which waited on it).", labels=["by"])
        fills.add_metric(["prefetch"], s.adapter_prefetch_fills)
        fills.add_metric(["step"], s.adapter_step_fills)
        yield fills


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], ledger: UsageLedger | RemoteLedger | None = None) -> None:
        """`ledger`: where each answered request and each 429 is billed (in memory when None)."""
        self.ledger = ledger if ledger is not None else UsageLedger(None)
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        self.adapter_store = _StoreCollector()
        self.registry.register(self.adapter_store)
        self.residency = _ResidencyCollector(stats)
        self.registry.register(self.residency)
        r = self.registry
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter(P + "request_success", "Finished requests by finish reason.",
                                       ["finished_reason"], registry=r)
        self.lora_requests = Counter(P + "lora_requests", "Requests per LoRA adapter, alone or in a mix "
                                     "('' = base model).", ["lora_name"], registry=r)
        self.lora_generation_tokens = Counter(P + "lora_generation_tokens", "Tokens generated per LoRA adapter, "
                                              "alone or in a mix ('' = base model).", ["lora_name"], registry=r)
        self.mix_requests = Counter(P + "adapter_mix_requests", "Requests on a weighted mix of adapters "
                                    "(`adapters`).", registry=r)
        self.tenant_requests = Counter(P + "tenant_requests", "Requests per tenant (--tenants).", ["tenant"],
                                       registry=r)
        self.tenant_prompt_tokens = Counter(P + "tenant_prompt_tokens", "Prompt tokens per tenant.", ["tenant"],
                                            registry=r)
        self.tenant_generation_tokens = Counter(P + "tenant_generation_tokens", "Tokens generated per tenant.",
                                                ["tenant"], registry=r)
        self.tenant_rate_limited = Counter(P + "tenant_rate_limited", "Requests refused with 429 per tenant and "
                                           "limit.", ["tenant", "limit"], registry=r)
        self.tenant_queue_time = Histogram(P + "tenant_queue_time_seconds", "Arrival to first admission into the "
                                           "batch, per tenant.", ["tenant"], buckets=_LATENCY_BUCKETS, registry=r)
        self.stats = stats
        # for the console's live view: recent latencies and running totals, read without parsing
        # the Prometheus text
        self.recent_ttft: deque[float] = deque(maxlen=RECENT)
        self.recent_itl: deque[float] = deque(maxlen=RECENT)
        self.by_adapter: dict[str, dict[str, int]] = {}  # '' = the base model; a mix counts for each adapter
        self.totals = _counts()  # each request once, mixes included
        self.by_tenant: dict[str, dict[str, int]] = {}  # since start, for the console (the bill: the ledger)
        self.tenants: dict[str, TenantNumbers] = {}  # each tenant's console numbers, from its own requests only

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_request(self, adapter: str | AdapterMix | None, tenant: str | None = None) -> None:
        for name in adapter_labels(adapter):
            self.lora_requests.labels(name).inc()
            self.adapter_totals(name)["requests"] += 1
        if isinstance(adapter, AdapterMix):
            self.mix_requests.inc()
        self.totals["requests"] += 1
        if tenant is not None:
            self.tenant_requests.labels(tenant).inc()
            self.tenant_totals(tenant)["requests"] += 1
            for name in adapter_labels(adapter):
                self.tenant(tenant).served_on(name)["requests"] += 1

    def count_served(self, request_id: str, adapter: str | AdapterMix | None, prompt_tokens: int, generated: int,
                     tenant: str | None, reasoning: int = 0) -> None:
        """One answered prompt: counted here and billed in the ledger under its engine request id
        (`reasoning`: of `generated`, the tokens before the reasoning's end)."""
        self.ledger.record(UsageRow(request_id, time.time(), tenant or "", adapter_labels(adapter), 1, prompt_tokens,
                                    generated, reasoning))
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        counted = [self.totals] + [self.adapter_totals(name) for name in adapter_labels(adapter)]
        if tenant is not None:
            counted.append(self.tenant_totals(tenant))
            counted += [self.tenant(tenant).served_on(name) for name in adapter_labels(adapter)]
            self.tenant_prompt_tokens.labels(tenant).inc(prompt_tokens)
            self.tenant_generation_tokens.labels(tenant).inc(generated)
        for counts in counted:
            counts["prompt_tokens"] += prompt_tokens
            counts["generation_tokens"] += generated
        for name in adapter_labels(adapter):
            self.lora_generation_tokens.labels(name).inc(generated)

    def count_rate_limited(self, tenant: str, limit: str) -> None:
        self.tenant_rate_limited.labels(tenant, limit).inc()
        self.tenant_totals(tenant)["rate_limited"] += 1
        self.ledger.record(UsageRow(uuid.uuid4().hex, time.time(), tenant, (), rate_limited=1))

    def tenant_totals(self, tenant: str) -> dict[str, int]:
        return self.by_tenant.setdefault(tenant, {**_counts(), "rate_limited": 0})

    def adapter_totals(self, name: str | None) -> dict[str, int]:
        return self.by_adapter.setdefault(name or "", _counts())

    def tenant(self, name: str) -> TenantNumbers:
        return self.tenants.setdefault(name, TenantNumbers())

    def server_snapshot(self) -> dict:
        """The engine's state and recent latencies, as JSON for the console (`GET /v1/stats`) of
        callers other than tenants."""
        s = self.stats()
        totals = dict(self.totals)
        return {"time": time.time(), "num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
                "kv_cache_usage_perc": s.kv_usage, "max_loras": s.max_loras,
                "running_adapters": list(s.running_adapters), "waiting_adapters": list(s.waiting_adapters),
                **totals, "ttft_ms": _percentiles(self.recent_ttft), "itl_ms": _percentiles(self.recent_itl),
                "spec_decode": spec_decode_json(s)}

    def tenant_snapshot(self, tenant: str) -> dict:
        """A tenant's `GET /v1/stats`: the same fields, each from its own requests only (its requests in
        flight, its totals, its latencies); what only the shared engine knows (KV usage, max_loras) is
        left out: it moves with other tenants' traffic."""
        own = self.tenants.get(tenant) or TenantNumbers()
        totals = self.by_tenant.get(tenant, {})
        return {"time": time.time(), **own.in_flight(), **{key: totals.get(key, 0) for key in _counts()},
                "ttft_ms": _percentiles(own.recent_ttft), "itl_ms": _percentiles(own.recent_itl)}

    def tenant_spec_decode(self, owns: Callable[[str], bool]) -> dict | None:
        """A tenant's `spec_decode`: only `by_adapter`, for the adapters `owns` says no other tenant may use
        (their counters move with its own traffic only); the engine-wide totals are left out, like KV usage.
        None without speculation."""
        s = self.stats()
        if s.spec_decode is None:
            return None
        return {"by_adapter": {name: spec_counts(c) for name, c in sorted(s.spec_decode_by_adapter.items())
                               if owns(name)}}

    def tenant_served(self, tenant: str) -> dict[str, dict[str, int]]:
        """What a tenant was served, per adapter ('' = the base model; a mix counts for each adapter)."""
        own = self.tenants.get(tenant)
        return {} if own is None else {name: dict(counts) for name, counts in own.served.items()}

    def snapshot(self) -> dict:
        """What a replica reports for a Ray ingress to merge (api/cluster/replica.py): the server's stats and,
        under `tenants`, each tenant's own with what it was served per adapter (`served`)."""
        tenants = {name: {**self.tenant_snapshot(name), "served": self.tenant_served(name)}
                   for name in sorted(self.tenants.keys() | self.by_tenant.keys())}
        return {**self.server_snapshot(), "tenants": tenants}


RECENT = 512  # latencies kept for the console's percentiles


class TenantNumbers:
    """One tenant's console numbers, built only from its own requests: recent latencies, what it was
    served per adapter, and its requests in flight (each `RequestTimer` of its until it finishes; one
    that is dropped unfinished leaves with it)."""

    def __init__(self) -> None:
        self.recent_ttft: deque[float] = deque(maxlen=RECENT)
        self.recent_itl: deque[float] = deque(maxlen=RECENT)
        self.served: dict[str, dict[str, int]] = {}  # '' = the base model; a mix counts for each adapter
        self.flying: weakref.WeakSet[RequestTimer] = weakref.WeakSet()

    def served_on(self, name: str) -> dict[str, int]:
        return self.served.setdefault(name, _counts())

    def in_flight(self) -> dict:
        """Its requests running (the engine has answered) and waiting (not yet), with their adapters."""
        timers = [t for t in list(self.flying) if not t.done]
        running = [t for t in timers if t.started]
        waiting = [t for t in timers if not t.started]
        return {"num_requests_running": len(running), "num_requests_waiting": len(waiting),
                "running_adapters": _adapter_names(running), "waiting_adapters": _adapter_names(waiting)}


def _adapter_names(timers) -> list[str]:
    return sorted({name for t in timers for name in adapter_labels(t.adapter) if name})


def _counts() -> dict[str, int]:
    return {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0}


def adapter_labels(adapter: str | AdapterMix | None) -> tuple[str, ...]:
    """The `lora_name` labels a request counts under: '' for the base model, each adapter of a mix."""
    if isinstance(adapter, AdapterMix):
        return adapter.names
    return (adapter or "",)


def spec_decode_json(s: EngineStats) -> dict | None:
    """`/v1/stats`' `spec_decode`: the engine's counters with their rates, per position and per adapter; None
    without speculation."""
    if s.spec_decode is None:
        return None
    c = s.spec_decode
    return {**spec_counts(c), "mean_acceptance_length": acceptance_length(c.num_drafts, c.num_accepted_tokens),
            "accepted_per_position": list(c.accepted_per_position),
            "by_adapter": {name: spec_counts(a) for name, a in sorted(s.spec_decode_by_adapter.items())}}


def spec_counts(c) -> dict:
    """One `SpecCounters` (read by attribute: the API does not import the engine's types) as JSON."""
    return spec_rates(c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens)


def spec_rates(drafts: int, draft_tokens: int, accepted_tokens: int) -> dict:
    """The counts with their acceptance rate (None before any draft: no rate to show yet)."""
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted_tokens,
            "acceptance_rate": accepted_tokens / draft_tokens if draft_tokens else None}


def acceptance_length(drafts: int, accepted_tokens: int) -> float | None:
    """vLLM's mean acceptance length: tokens a verify step yields, its own next token included."""
    return 1 + accepted_tokens / drafts if drafts else None


def _percentiles(values) -> dict[str, float | None]:
    ms = sorted(v * 1e3 for v in values)
    if not ms:
        return {"p50": None, "p90": None, "p99": None, "count": 0}
    at = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return {"p50": statistics.median(ms), "p90": at(0.9), "p99": at(0.99), "count": len(ms)}


class RequestTimer:
    """Latencies of one request, fed each time new tokens arrive."""

    def __init__(self, metrics: ServerMetrics, adapter: str | AdapterMix | None = None,
                 tenant: str | None = None) -> None:
        self.metrics = metrics
        self.adapter, self.tenant = adapter, tenant
        self.arrival = self.last = time.perf_counter()
        self.num_tokens = 0
        self.started = self.done = False  # admitted (the engine answered); finished
        # for its spans (api/tracing.py): when the first token came, the engine's queue time and grammar wait
        self.first_token: float | None = None
        self.queue_s: float | None = None
        self.grammar_wait_s: tuple[float, float] | None = None
        self.own = metrics.tenant(tenant) if tenant is not None else None
        if self.own is not None:
            self.own.flying.add(self)

    def tokens(self, total: int) -> None:
        new = total - self.num_tokens
        if new <= 0:
            return
        now = time.perf_counter()
        self.started = True
        recent = [self.metrics] + ([self.own] if self.own is not None else [])
        if self.num_tokens == 0:
            self.first_token = now
            self.metrics.ttft.observe(now - self.arrival)
            for into in recent:
                into.recent_ttft.append(now - self.arrival)
        else:  # several tokens at once (jump-forward, n > 1) share the gap
            for _ in range(new):
                self.metrics.itl.observe((now - self.last) / new)
            for into in recent:
                into.recent_itl.append((now - self.last) / new)
        self.last, self.num_tokens = now, total

    def finish(self, request_id: str, prompt_tokens: int, finish_reasons: list[str | None], generated: int,
               reasoning: int = 0) -> None:
        """`generated`: tokens of all choices, `reasoning` of them before the reasoning ended; `request_id`:
        the engine's, the prompt's row in the usage ledger."""
        self._landed()
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        self.metrics.count_served(request_id, self.adapter, prompt_tokens, generated, self.tenant, reasoning)
        for reason in finish_reasons:
            self.metrics.request_success.labels(reason or "abort").inc()

    def abandon(self) -> None:
        """The engine refused the request before running any of it: out of its tenant's requests in
        flight, nothing served. (A timer dropped unfinished leaves that count too, once collected.)"""
        self._landed()

    def _landed(self) -> None:
        self.done = True
        if self.own is not None:
            self.own.flying.discard(self)

    def queued(self, seconds: float, grammar_wait_s: tuple[float, float] | None = None) -> None:
        """The engine's queue time (and its wait for the request's grammar: (start, end) after its arrival)."""
        self.started = True
        self.queue_s, self.grammar_wait_s = seconds, grammar_wait_s
        if self.tenant is not None:
            self.metrics.tenant_queue_time.labels(self.tenant).observe(seconds)
