"""`loraplex serve` as users run it: a subprocess on the default model, the official client, the
examples against it, and SIGTERM ending it with exit status 0."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import jsonschema
import openai
import pytest

from conftest import make_peft_adapter, write_random_adapter

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
ADMIN = "sekrit-admin-key-0123"  # given through the environment; must never show up in the log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server exited during start-up"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("server did not become healthy")


@contextlib.contextmanager
def serving(model_dir, *flags: str, env: dict | None = None, stdout=subprocess.DEVNULL):
    """`loraplex serve` in a subprocess on a free loopback port, healthy, killed on exit.
    `stdout=subprocess.PIPE` keeps the log for a test to read (it must read it)."""
    port = free_port()
    cmd = [sys.executable, "-m", "loraplex.api.cli", "serve", str(model_dir), "--port", str(port),
           "--usage-db", "memory", "--batch-dir", tempfile.mkdtemp(prefix="loraplex-batches-"),
           *flags]  # no ledger file or batch folder left in the cache (a --usage-db or --batch-dir in flags wins)
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def served(default_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter-root")
    make_peft_adapter(default_model_dir, root / "ex", rank=8, seed=0, scale=0.3)
    # float32: a prefix-cache hit changes the rows a bf16 matmul rounds together (oneDNN picks its
    # kernel by row count), and the tool test compares a repeated request's text exactly
    with serving(default_model_dir, "--dtype", "float32", "--max-model-len", "2048", "--lora-modules", f"ex={root / 'ex'}",
                 "--adapter-root", str(root), "--shutdown-timeout", "3", env={"LORAPLEX_ADMIN_API_KEY": ADMIN},
                 stdout=subprocess.PIPE) as (url, proc):
        yield url, proc, root


def test_chat_json_and_adapters(served):
    url, _, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    base = "SmolLM2-135M-Instruct"
    assert [m.id for m in client.models.list().data] == [base, "ex"]
    reply = client.chat.completions.create(
        model=base, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=24,
        temperature=0)
    assert "Paris" in reply.choices[0].message.content
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"], "additionalProperties": False}
    for model in (base, f"{base}:ex"):
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}, temperature=0)
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
        obj = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": 'Reply with a JSON object with the keys "name" '
                                                                'and "color" for a red apple.'}],
            max_tokens=300, response_format={"type": "json_object"}, temperature=0)
        assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


TOOL_SCHEMAS = {
    "get_weather": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 30},
                                   "unit": {"enum": ["celsius", "fahrenheit"]}}},
    "book_table": {"type": "object", "additionalProperties": False, "required": ["restaurant", "people", "time"],
                   "properties": {"restaurant": {"type": "string", "maxLength": 30},
                                  "people": {"type": "integer", "minimum": 1, "maximum": 12},
                                  "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                                  "notes": {"type": ["string", "null"], "maxLength": 40}}},
    "search": {"type": "object", "required": ["query"],
               "properties": {"query": {"type": "string", "maxLength": 40},
                              "filters": {"type": "array", "maxItems": 3, "items": {
                                  "anyOf": [{"type": "string", "maxLength": 12}, {"type": "integer"}]}}}},
}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in TOOL_SCHEMAS.items()]
ASKS = {"get_weather": "What's the weather like in Paris?", "book_table": "Book a table for 4 at Luigi's at 19:30.",
        "search": "Find recent papers about LoRA adapters."}


def _calls_are_valid(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


def _streamed_calls(chunks) -> tuple[list[tuple[str, str]], str | None]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in chunks:
        for part in chunk.choices[0].delta.tool_calls or []:
            have = calls.setdefault(part.index, ["", ""])
            have[0] = part.function.name or have[0]
            have[1] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


def test_tool_calls_through_the_openai_client(served):
    url, _, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    base = "SmolLM2-135M-Instruct"
    for name, ask in ASKS.items():  # named and required, streamed and not, base and adapter
        for choice, model in [({"type": "function", "function": {"name": name}}, base), ("required", f"{base}:ex")]:
            args = dict(model=model, messages=[{"role": "user", "content": ask}], tools=TOOLS, tool_choice=choice,
                        max_tokens=120, temperature=0)
            reply = client.chat.completions.create(**args)
            calls = reply.choices[0].message.tool_calls
            assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0].message
            _calls_are_valid(calls)
            assert isinstance(choice, str) or [c.function.name for c in calls] == [name]
            streamed, finish = _streamed_calls(client.chat.completions.create(stream=True, **args))
            assert finish == "tool_calls" and streamed == [(c.function.name, c.function.arguments) for c in calls]
    several = client.chat.completions.create(  # parallel_tool_calls (the default): several calls
        model=base, messages=[{"role": "user", "content": "What is the weather in Paris and in London?"}],
        tools=TOOLS[:1], tool_choice="required", max_tokens=120, temperature=0)
    _calls_are_valid(several.choices[0].message.tool_calls)
    assert len(several.choices[0].message.tool_calls) >= 2
    single = client.chat.completions.create(
        model=base, messages=[{"role": "user", "content": "What is the weather in Paris and in London?"}],
        tools=TOOLS[:1], tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=0)
    assert len(single.choices[0].message.tool_calls) == 1
    for ask in ("Hi! How are you today?", ASKS["get_weather"]):  # auto: text, or a valid call
        reply = client.chat.completions.create(model=base, messages=[{"role": "user", "content": ask}], tools=TOOLS,
                                               max_tokens=40, temperature=0)
        message = reply.choices[0].message
        assert message.content or message.tool_calls
        if message.tool_calls:
            _calls_are_valid(message.tool_calls)
    # a round trip: the call and the tool's result go back, the model answers
    call = several.choices[0].message.tool_calls[0]
    turn = [{"role": "user", "content": "What is the weather in Paris?"},
            several.choices[0].message.model_dump(exclude_none=True),
            *[{"role": "tool", "tool_call_id": c.id, "content": '{"temperature": 21, "sky": "sunny"}'}
              for c in several.choices[0].message.tool_calls]]
    answer = client.chat.completions.create(model=base, messages=turn, tools=TOOLS, max_tokens=30, temperature=0)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
    assert call.id.startswith("call_")


@pytest.mark.parametrize("script,args", [("chat_with_adapter.py", []), ("json_extraction.py", []),
                                         ("tool_calling.py", []), ("responses.py", []),
                                         ("batch_extraction.py", ["--model", "SmolLM2-135M-Instruct:ex"]),
                                         ("hot_load_adapter.py", ["--path", "ex"])])
def test_examples_run_against_the_server(served, script, args):
    url, _, root = served
    run = subprocess.run([sys.executable, script, "--base-url", url + "/v1", *args], cwd=REPO / "examples",
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "LORAPLEX_ADMIN_API_KEY": ADMIN})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.strip()


def test_sigterm_exits_zero_and_keys_never_reach_the_log(served):
    url, proc, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    wrong = openai.OpenAI(base_url=url + "/v1", api_key=ADMIN[::-1], max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.post("/load_lora_adapter", body={"lora_name": "x", "lora_path": "ex"}, cast_to=str)
    stream = client.completions.create(model="ex", prompt="Once upon a time", max_tokens=1500, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    proc.send_signal(signal.SIGTERM)
    with pytest.raises(openai.APIError, match="shutting down"):  # after the 3 s grace period
        for _ in chunks:
            pass
    assert proc.wait(60) == 0
    log = proc.stdout.read()
    assert "shutting down" in log or "Shutting down" in log
    assert f"loraplex: ready at {url}/v1" in log  # said once /ready answers 200
    assert ADMIN not in log and ADMIN[::-1] not in log and "Bearer" not in log


def test_tensor_parallel_serve_answers_with_adapters_and_stops_its_workers(default_model_dir, tmp_path):
    """`--tensor-parallel-size 2`: the same answers as one process, an adapter loaded through the admin API on
    every rank, and SIGTERM ending the server and its worker processes."""
    from loraplex.platform import LLM, SamplingParams
    from loraplex.platform.models.registry import read_model_config

    adapter = write_random_adapter(tmp_path / "tp", read_model_config(default_model_dir), seed=1, rank=8)
    prompt = "The three primary colors are"
    with serving(default_model_dir, "--dtype", "float32", "--tensor-parallel-size", "2", "--shutdown-timeout", "1",
                 "--adapter-root", str(tmp_path), env={"LORAPLEX_ADMIN_API_KEY": ADMIN}) as (url, proc):
        admin = openai.OpenAI(base_url=url + "/v1", api_key=ADMIN, max_retries=0)
        admin.post("/load_lora_adapter", body={"lora_name": "tp", "lora_path": str(adapter)}, cast_to=object)
        texts = [admin.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
                 for model in ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct:tp")]
        workers = [pid for pid in _children(proc.pid) if b"spawn_main" in _cmdline(pid)]
        assert len(workers) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"]
    llm = LLM(str(default_model_dir), dtype="float32", grammar_compile_workers=0)
    llm.load_adapter("tp", adapter)
    params = SamplingParams(temperature=0, max_tokens=12)
    assert texts == [llm.generate([prompt], params, adapter=a)[0].outputs[0].text for a in (None, "tp")]


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
