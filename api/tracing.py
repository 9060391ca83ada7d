"""OpenTelemetry traces of generation requests (`--otlp-traces-endpoint`, vLLM's flag), decided once when a
server's state is built: without an endpoint `NoTracing`, whose methods do nothing, with the OpenTelemetry SDK
and exporter never imported (FastAPI imports the API package itself); with one, `OtlpTracing`, exporting over
OTLP/HTTP (protobuf) in batches from the SDK's own thread, flushed when the server stops.

As in vLLM, a prompt's spans are made once it has finished, from the times its timer kept, with explicit start
and end times: nothing is traced while it runs. Each prompt of a call is one `llm_request` span (its tenant,
adapter, engine request id, model, token counts and finish reasons as attributes) with its children on that
timeline: `adapter_load` (a first use that read the adapter for this call), `grammar_compile` (the front end's
wait for the request's grammar), `queue` (arrival to admission into the batch), `prefill` (admission to the
first token) and `decode` (first token to finish)."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from typing import TYPE_CHECKING, Iterator
from urllib.parse import urlsplit

from loraplex.platform.engine.engine_client import AdapterMix

if TYPE_CHECKING:
    from loraplex.api.admin.metrics import RequestTimer
    from loraplex.api.settings import ServerConfig

log = logging.getLogger(__name__)

SERVICE_NAME = "loraplex"
TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for spans, added to an endpoint given without a path
FLUSH_TIMEOUT_S = 5.0  # what the spans still buffered get at stop: a collector that hangs cannot hold the exit

# A call's first-use adapter reads, (name, start, end) on the perf_counter clock: the adapter is resolved in the
# route's handler before the call's timers exist, and the generation runs in that task (or in tasks it started),
# which see what was set here.
_adapter_loads: contextvars.ContextVar[tuple[tuple[str, float, float], ...]] = \
    contextvars.ContextVar("loraplex_adapter_loads", default=())


@contextlib.contextmanager
def adapter_load(name: str) -> Iterator[None]:
    """Times a first-use read of adapter `name` (its own or the wait for another caller's) for the call's spans.
    Kept with or without tracing: it runs only when an adapter is read, beside a disk or network read."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _adapter_loads.set(_adapter_loads.get() + ((name, start, time.perf_counter()),))


class NoTracing:
    """Without `--otlp-traces-endpoint`: nothing recorded, nothing exported, no SDK imported."""

    def finished(self, timer: RequestTimer, request_id: str, prompt_tokens: int, generated: int,
                 reasons: list[str | None]) -> None:
        pass

    def shutdown(self) -> None:
        pass


class OtlpTracing:
    """Spans exported to an OTLP/HTTP collector (service.name `loraplex`). Its own provider, not the global one:
    a process that also runs Ray (which brings its own OpenTelemetry) keeps its settings."""

    def __init__(self, endpoint: str, served_model_name: str) -> None:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.served_model_name = served_model_name
        self.provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("loraplex.api")
        self.in_span, self.server_kind = trace.set_span_in_context, trace.SpanKind.SERVER
        log.info("exporting OpenTelemetry traces to %s", endpoint)

    def finished(self, timer: RequestTimer, request_id: str, prompt_tokens: int, generated: int,
                 reasons: list[str | None]) -> None:
        """The spans of one finished prompt. A failure is logged, never raised: the answer is already out."""
        try:
            self._record(_Timeline(timer, _adapter_loads.get()), timer, request_id, prompt_tokens, generated, reasons)
        except Exception:
            log.exception("the spans of request %s could not be recorded", request_id)

    def _record(self, line: _Timeline, timer: RequestTimer, request_id: str, prompt_tokens: int, generated: int,
                reasons: list[str | None]) -> None:
        names = timer.adapter.names if isinstance(timer.adapter, AdapterMix) else (timer.adapter or "",)
        model = timer.adapter if isinstance(timer.adapter, str) else self.served_model_name
        attributes = {"gen_ai.request.id": request_id, "gen_ai.request.model": model,
                      "loraplex.tenant": timer.tenant or "", "loraplex.adapter": ",".join(names),
                      "gen_ai.usage.prompt_tokens": prompt_tokens, "gen_ai.usage.completion_tokens": generated,
                      "gen_ai.response.finish_reasons": [reason or "abort" for reason in reasons],
                      "gen_ai.latency.e2e": line.end - line.arrival, **line.latencies()}
        parent = self.tracer.start_span("llm_request", kind=self.server_kind, start_time=line.ns(line.start),
                                        attributes=attributes)
        context = self.in_span(parent)
        for name, start, end, extra in line.children():
            child = self.tracer.start_span(name, context, start_time=line.ns(start), attributes=extra)
            child.end(end_time=line.ns(end))
        parent.end(end_time=line.ns(line.end))

    def shutdown(self) -> None:
        """Exports what is still buffered and stops the exporter's thread, waiting at most FLUSH_TIMEOUT_S (an
        export to a collector that does not answer runs to the exporter's own timeout; it is left to finish, a
        daemon thread, while the server goes on stopping)."""
        stopping = threading.Thread(target=self.provider.shutdown, name="loraplex-traces-flush", daemon=True)
        stopping.start()
        stopping.join(FLUSH_TIMEOUT_S)


class _Timeline:
    """A finished prompt's moments on the perf_counter clock, each child span inside the parent's range. The
    engine's grammar wait and queue time count from its own arrival, a hop after the timer's: placed from the
    timer's, they keep their order (admission before the first token the API saw)."""

    def __init__(self, timer: RequestTimer, loads: tuple[tuple[str, float, float], ...]) -> None:
        self.end = time.perf_counter()
        self.wall_ns = time.time_ns()  # read once: every moment is converted with the same offset
        self.arrival, self.first, self.loads = timer.arrival, timer.first_token, loads
        self.start = min([self.arrival, *(start for _, start, _ in loads)])
        self.queue_s, self.grammar_wait_s = timer.queue_s, timer.grammar_wait_s
        first = self.first if self.first is not None else self.end
        self.admitted = None if self.queue_s is None else min(self.arrival + self.queue_s, first)

    def ns(self, moment: float) -> int:
        return self.wall_ns - int((self.end - moment) * 1e9)

    def latencies(self) -> dict[str, float]:
        """vLLM's latency attributes, those that are known."""
        known = {}
        if self.queue_s is not None:
            known["gen_ai.latency.time_in_queue"] = self.queue_s
        if self.first is not None:
            known["gen_ai.latency.time_to_first_token"] = self.first - self.arrival
        return known

    def children(self) -> Iterator[tuple[str, float, float, dict]]:
        """(name, start, end, attributes) of each child span that happened."""
        for name, start, end in self.loads:
            yield "adapter_load", start, end, {"loraplex.adapter": name}
        if self.grammar_wait_s is not None:
            until = self.admitted if self.admitted is not None else self.end
            start, end = (min(self.arrival + offset, until) for offset in self.grammar_wait_s)
            yield "grammar_compile", start, end, {}
        if self.admitted is not None:
            yield "queue", self.arrival, self.admitted, {}
        if self.first is not None:
            yield "prefill", self.admitted if self.admitted is not None else self.arrival, self.first, {}
            yield "decode", self.first, self.end, {}


Tracing = NoTracing | OtlpTracing


def tracing_for(config: ServerConfig) -> Tracing:
    """What the server traces with, once at start: `NoTracing` without an endpoint."""
    if not config.otlp_traces_endpoint:
        return NoTracing()
    return OtlpTracing(traces_url(config.otlp_traces_endpoint), config.served_model_name)


def traces_url(endpoint: str) -> str:
    """The URL spans are posted to: `endpoint`, with OTLP/HTTP's `/v1/traces` when it names no path (a collector's
    base URL, as `http://127.0.0.1:4318`)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL (OTLP/HTTP), got {endpoint!r}")
    return endpoint if parts.path.strip("/") else endpoint.rstrip("/") + TRACES_PATH
