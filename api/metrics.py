"""Prometheus metrics with vLLM's names under our prefix. Engine state (queues, KV usage,
prefix-cache hits, adapters) is read from the engine's latest stats snapshot at scrape time;
latencies and token counts are recorded by the server as requests stream."""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraplex.platform.engine_client import AdapterMix, EngineStats

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


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
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
        self.by_tenant: dict[str, dict[str, int]] = {}  # usage since start, for billing (`GET /v1/usage`)

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

    def count_served(self, adapter: str | AdapterMix | None, prompt_tokens: int, generated: int,
                     tenant: str | None = None) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        counted = [self.totals] + [self.adapter_totals(name) for name in adapter_labels(adapter)]
        if tenant is not None:
            counted.append(self.tenant_totals(tenant))
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

    def tenant_totals(self, tenant: str) -> dict[str, int]:
        return self.by_tenant.setdefault(tenant, {**_counts(), "rate_limited": 0})

    def usage(self) -> dict:
        """Token totals since start per tenant and per adapter ('' = the base model)."""
        return {"tenants": {name: dict(c) for name, c in self.by_tenant.items()},
                "adapters": {name: dict(c) for name, c in self.by_adapter.items()}, "totals": dict(self.totals)}

    def adapter_totals(self, name: str | None) -> dict[str, int]:
        return self.by_adapter.setdefault(name or "", _counts())

    def snapshot(self) -> dict:
        """The engine's state and recent latencies, as JSON for the console (`GET /v1/stats`)."""
        s = self.stats()
        totals = dict(self.totals)
        return {"time": time.time(), "num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
                "kv_cache_usage_perc": s.kv_usage, "max_loras": s.max_loras,
                "running_adapters": list(s.running_adapters), "waiting_adapters": list(s.waiting_adapters),
                **totals, "ttft_ms": _percentiles(self.recent_ttft), "itl_ms": _percentiles(self.recent_itl)}


RECENT = 512  # latencies kept for the console's percentiles


def _counts() -> dict[str, int]:
    return {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0}


def adapter_labels(adapter: str | AdapterMix | None) -> tuple[str, ...]:
    """The `lora_name` labels a request counts under: '' for the base model, each adapter of a mix."""
    if isinstance(adapter, AdapterMix):
        return adapter.names
    return (adapter or "",)


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

    def tokens(self, total: int) -> None:
        new = total - self.num_tokens
        if new <= 0:
            return
        now = time.perf_counter()
        if self.num_tokens == 0:
            self.metrics.ttft.observe(now - self.arrival)
            self.metrics.recent_ttft.append(now - self.arrival)
        else:  # several tokens at once (jump-forward, n > 1) share the gap
            for _ in range(new):
                self.metrics.itl.observe((now - self.last) / new)
            self.metrics.recent_itl.append((now - self.last) / new)
        self.last, self.num_tokens = now, total

    def finish(self, prompt_tokens: int, finish_reasons: list[str | None], generated: int | None = None) -> None:
        """`generated`: tokens of all choices (default: the longest choice's)."""
        generated = self.num_tokens if generated is None else generated
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        self.metrics.count_served(self.adapter, prompt_tokens, generated, self.tenant)
        for reason in finish_reasons:
            self.metrics.request_success.labels(reason or "abort").inc()

    def queued(self, seconds: float) -> None:
        if self.tenant is not None:
            self.metrics.tenant_queue_time.labels(self.tenant).observe(seconds)
