"""OpenTelemetry traces (#68): with `--otlp-traces-endpoint`, each prompt's `llm_request` span and its children
(adapter_load, grammar_compile, queue, prefill, decode) reach an OTLP/HTTP receiver started here, with the
tenant, adapter and engine request id as attributes, children inside their parent's time range, buffered spans
exported when the server stops; without the flag nothing is exported and the SDK and exporter are never imported
(FastAPI itself imports opentelemetry's API, so that much is always there)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from live_server import http, start_server

ACME = "sk-acme-1"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
CHILDREN = {"adapter_load", "grammar_compile", "queue", "prefill", "decode"}


class Receiver:
    """A minimal OTLP/HTTP trace collector on 127.0.0.1: POST /v1/traces, protobuf in, an empty
    ExportTraceServiceResponse out; the spans kept as dicts (with their resource's attributes)."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.posts = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.take(request, self.path)
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:  # the test's output stays quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self, request, path: str) -> None:
        assert path == "/v1/traces"
        self.posts += 1
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                self.spans += [{"name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                                "end": s.end_time_unix_nano, "attributes": _attributes(s.attributes),
                                "resource": resource} for s in scope_spans.spans]

    def requests(self) -> list[dict]:
        return [s for s in self.spans if s["name"] == "llm_request"]

    def children(self, parent: dict) -> dict[str, dict]:
        return {s["name"]: s for s in self.spans if s["parent"] == parent["id"]}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _attributes(pairs) -> dict:
    return {kv.key: _value(kv.value) for kv in pairs}


def _value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


def _wait_for(condition, timeout: float = 20.0) -> None:
    """A safety net, left as soon as `condition` holds; what follows asserts what arrived."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced(tiny_model_dir, tiny_adapters, tmp_path_factory, receiver):
    """A tenant's server exporting to the receiver; the batch's schedule is long, so only the flush at stop
    sends the spans (the test then stops the server itself)."""
    from loraplex.api.server import ServerConfig

    folder = tmp_path_factory.mktemp("traced")
    root = folder / "root"
    shutil.copytree(tiny_adapters[0], root / "acme-x")
    tenants = {"tenants": {"acme": {"api_keys": [ACME], "adapters": ["acme-*"], "base_model": True}}}
    (folder / "tenants.json").write_text(json.dumps(tenants))
    config = ServerConfig(served_model_name="tiny", model_path=str(tiny_model_dir), admin_api_key="sk-admin",
                          tenants_file=str(folder / "tenants.json"), adapter_roots=(str(root),),
                          enable_lora_resolver=True, otlp_traces_endpoint=receiver.url)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
        server = start_server(tiny_model_dir, config, {"acme-a": tiny_adapters[1]}, num_kv_blocks=64,
                              max_num_seqs=4, max_loras=2)
    yield server
    if server.thread.is_alive():
        server.stop()


def _complete(server, model: str, max_tokens: int = 3, **fields) -> str:
    """The response's id (a stream's from its first chunk)."""
    body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **fields}
    status, answer = http(server, "/v1/completions", body, key=ACME)
    assert status == 200, answer
    if isinstance(answer, str):
        answer = json.loads(answer.split("\n", 1)[0].removeprefix("data: "))
    return answer["id"]


def test_spans_of_a_tenants_requests_reach_the_collector_at_stop(traced, receiver):
    ids = [_complete(traced, "acme-x"),  # a first use: the adapter is read from the root
           _complete(traced, "acme-x", max_tokens=4, stream=True),
           _complete(traced, "tiny", max_tokens=16, response_format={"type": "json_schema", "json_schema": {
               "name": "n", "schema": SCHEMA}}, ignore_eos=False),
           _complete(traced, "tiny", adapters=[{"name": "acme-x", "weight": 0.5}, {"name": "acme-a", "weight": 0.5}])]
    assert receiver.posts == 0  # batched: nothing sent before the schedule or the stop
    traced.stop()
    _wait_for(lambda: len(receiver.requests()) >= 4)

    spans = receiver.requests()
    assert len(spans) == 4 and all(s["resource"]["service.name"] == "loraplex" for s in spans)
    # the engine's request id: the response's id and the prompt's index
    assert sorted(s["attributes"]["gen_ai.request.id"] for s in spans) == sorted(f"{i}-0" for i in ids)
    by_adapter = {}
    for span in spans:
        a = span["attributes"]
        assert a["loraplex.tenant"] == "acme" and a["gen_ai.usage.prompt_tokens"] == 4
        assert span["parent"] == ""  # a root: one trace per prompt
        by_adapter.setdefault(a["loraplex.adapter"], []).append(span)
        _assert_timeline(receiver, span)
    first, streamed = sorted(by_adapter["acme-x"], key=lambda s: s["start"])
    assert first["attributes"]["gen_ai.request.model"] == "acme-x"
    assert first["attributes"]["gen_ai.usage.completion_tokens"] == 3
    assert streamed["attributes"]["gen_ai.usage.completion_tokens"] == 4
    assert first["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    load = receiver.children(first)["adapter_load"]
    assert load["attributes"] == {"loraplex.adapter": "acme-x"}
    assert "adapter_load" not in receiver.children(streamed)  # loaded already
    structured, = by_adapter[""]
    assert structured["attributes"]["gen_ai.request.model"] == "tiny"
    assert "grammar_compile" in receiver.children(structured)
    assert "grammar_compile" not in receiver.children(first)
    mixed, = by_adapter["acme-x,acme-a"]
    assert mixed["attributes"]["gen_ai.request.model"] == "tiny"


def _assert_timeline(receiver: Receiver, parent: dict) -> None:
    """Every child in the parent's trace and time range; queue, prefill and decode back to back."""
    children = receiver.children(parent)
    assert {"queue", "prefill", "decode"} <= set(children) <= CHILDREN
    for child in children.values():
        assert child["trace"] == parent["trace"]
        assert parent["start"] <= child["start"] <= child["end"] <= parent["end"], child["name"]
    queue, prefill, decode = children["queue"], children["prefill"], children["decode"]
    assert queue["end"] == prefill["start"] and prefill["end"] == decode["start"]
    assert decode["end"] == parent["end"]
    if "grammar_compile" in children:
        assert children["grammar_compile"]["end"] <= queue["end"]


NO_FLAG = """
import json, sys, urllib.request
sys.path[:0] = sys.argv[3:]
from live_server import start_server
from loraplex.api.server import ServerConfig
server = start_server(sys.argv[1], ServerConfig(served_model_name="tiny", model_path=sys.argv[1]), num_kv_blocks=32)
body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}).encode()
urllib.request.urlopen(urllib.request.Request(server.url + "/v1/completions", body,
                                              {"Content-Type": "application/json"}), timeout=60).read()
server.stop()
ours = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto")  # the API is FastAPI's own import
print(json.dumps({"tracing": type(server.uvicorn_server.config.app.state.loraplex.tracing).__name__,
                  "imported": sorted(m for m in sys.modules if m.startswith(ours))}))
"""


def test_without_the_flag_nothing_is_exported_or_imported(tiny_model_dir, receiver):
    """A fresh process serves a request without the flag: neither the SDK nor the exporter is imported (the
    SDK's own variables pointing at the receiver change nothing)."""
    before = receiver.posts
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url + "/v1/traces",
           "OTEL_TRACES_EXPORTER": "otlp"}
    done = subprocess.run([sys.executable, "-c", NO_FLAG, str(tiny_model_dir), "", str(tests.parent), str(tests)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"tracing": "NoTracing", "imported": []}
    assert receiver.posts == before


def test_the_endpoint_gets_otlps_path_when_it_names_none():
    from loraplex.api.tracing import traces_url

    assert traces_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("http://127.0.0.1:4318/") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("https://collector:4318/custom/traces") == "https://collector:4318/custom/traces"
    with pytest.raises(ValueError, match="http"):
        traces_url("127.0.0.1:4317")
