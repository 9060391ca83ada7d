"""Under load, faults and bad input nothing is lost or leaked: real servers on 127.0.0.1 over
the tiny model, bounded sizes so this runs in CI."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import time

import jsonschema
import openai
import pytest

from conftest import assert_all_blocks_free
from live_server import SCHEMA, assert_error, http, start_server, wait_idle
from loraplex.api.server import ServerConfig

MSG = [{"role": "user", "content": "Hello world"}]


def config(root=None, **kw) -> ServerConfig:
    return ServerConfig(served_model_name="tiny", adapter_roots=(str(root),) if root else (), **kw)


def assert_clean(server) -> None:
    wait_idle(server.engine)
    assert_all_blocks_free(server.engine)
    assert server.engine.adapters.num_pins() == 0
    assert http(server, "/health", key=None)[0] == 200


@pytest.fixture
def adapter_root(tmp_path, tiny_adapters):
    root = tmp_path / "root"
    root.mkdir()
    for src in tiny_adapters[:4]:
        shutil.copytree(src, root / src.name)
    return root


def test_64_streaming_clients_with_disconnects_preemption_and_admin_calls(tiny_model_dir, adapter_root):
    server = start_server(tiny_model_dir, config(adapter_root), {"a0": adapter_root / "a0", "a1": adapter_root / "a1"},
                          num_kv_blocks=12, max_num_seqs=16, max_num_batched_tokens=64, max_loras=2,
                          max_cpu_loras=3)
    rng = random.Random(0)
    outcomes: list[tuple[str, object]] = []

    async def one_client(i: int, client: openai.AsyncOpenAI) -> None:
        model = rng.choice(["tiny", "a0", "a1", "hot"])
        structured = rng.random() < 0.25
        cut = rng.random() < 0.3
        extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}} \
            if structured else {}
        try:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Hello world {i}"}], max_tokens=40,
                temperature=1.0, seed=i, stream=True, extra_body={"ignore_eos": not structured}, **extra)
            text, finish, chunks = "", None, 0
            async for chunk in stream:
                chunks += 1
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                if cut and chunks == 2:
                    await stream.close()
                    outcomes.append(("cut", None))
                    return
            if structured:
                assert finish == "stop", text
                jsonschema.validate(json.loads(text), SCHEMA)
            outcomes.append(("done", finish))
        except openai.NotFoundError:  # "hot" is not loaded (yet, or any more): a clear 404
            outcomes.append(("404", model))

    async def admin() -> None:
        def call(path, body):
            return http(server, path, body, key=None)

        await asyncio.sleep(0.3)
        assert (await asyncio.to_thread(call, "/v1/load_lora_adapter", {"lora_name": "hot", "lora_path": "a2"}))[0] == 200
        await asyncio.sleep(1.0)
        status = (await asyncio.to_thread(call, "/v1/unload_lora_adapter", {"lora_name": "a0"}))[0]
        assert status in (200, 409)  # 409 while requests use it, never pulled from under them
        if status == 200:
            assert (await asyncio.to_thread(call, "/v1/load_lora_adapter",
                                            {"lora_name": "a0", "lora_path": "a0"}))[0] == 200
        assert (await asyncio.to_thread(call, "/v1/load_lora_adapter", {"lora_name": "hot2", "lora_path": "a3"}))[0] == 200

    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        await asyncio.gather(admin(), *(one_client(i, client) for i in range(64)))
        await client.close()

    try:
        asyncio.run(main())
        assert len(outcomes) == 64
        kinds = [k for k, _ in outcomes]
        assert kinds.count("cut") >= 10 and kinds.count("done") >= 20
        assert all(f in ("stop", "length") for k, f in outcomes if k == "done")
        assert server.engine.core.scheduler.num_preemptions > 0
        assert_clean(server)
    finally:
        server.stop()


def test_bad_input_is_a_4xx_with_an_openai_error(tiny_model_dir):
    server = start_server(tiny_model_dir, config(max_request_body_bytes=8192), num_kv_blocks=64)
    chat = "/v1/chat/completions"
    cases = [
        (chat, {"model": "tiny", "messages": MSG, "temperature": "hot"}, "temperature"),
        (chat, {"model": "tiny", "messages": MSG, "top_p": 7}, "top_p"),
        (chat, {"model": "tiny", "messages": MSG, "top_k": -5}, "top_k"),
        (chat, {"model": "tiny", "messages": MSG, "n": 100000}, "n="),
        (chat, {"model": "tiny", "messages": MSG, "n": 0}, "n"),
        (chat, {"model": "tiny", "messages": MSG, "max_tokens": 0}, "max_tokens"),
        (chat, {"model": "tiny", "messages": MSG, "max_tokens": 100000}, "max_model_len"),
        (chat, {"model": "tiny", "messages": MSG, "logprobs": True, "top_logprobs": 50}, "logprobs"),
        (chat, {"model": "tiny", "messages": MSG, "top_logprobs": 2}, "top_logprobs"),
        (chat, {"model": "tiny", "messages": MSG, "stop_token_ids": [10**9]}, "stop_token_ids"),
        (chat, {"model": "tiny", "messages": MSG, "min_tokens": 99, "max_tokens": 5}, "min_tokens"),
        (chat, {"model": "tiny", "messages": MSG, "presence_penalty": 9}, "presence_penalty"),
        (chat, {"model": "tiny", "messages": MSG, "logit_bias": {"5": 300}}, "logit_bias"),
        (chat, {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        (chat, {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "role"),
        (chat, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "content"),
        (chat, {"model": "tiny", "messages": MSG, "response_format": {"type": "xml"}}, "response_format"),
        (chat, {"model": "tiny", "messages": MSG,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        (chat, {"model": "tiny", "messages": MSG, "structured_outputs": {"regex": "(unclosed"}}, "regex"),
        (chat, {"model": "tiny", "messages": MSG, "structured_outputs": {"choice": []}}, "choice"),
        (chat, {"model": "tiny", "messages": MSG, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        (chat, {"model": "tiny", "messages": MSG, "structured_outputs": {"json": {"type": "object",
                                                                                "not": {"pattern": "^a"}}}}, "'not'"),
        (chat, {"model": "tiny", "messages": MSG, "structured_outputs": {"json": {"type": "object", "not": {}}}},
         "unsatisfiable"),
        (chat, {"model": "tiny", "messages": MSG, "structured_outputs": {"json": "{bad"}}, "json"),
        (chat, {"model": "ghost", "messages": MSG}, "does not exist"),
        (chat, [1, 2, 3], "invalid request"),
        ("/v1/completions", {"model": "tiny", "prompt": [[]]}, "empty"),
        ("/v1/completions", {"model": "tiny", "prompt": [-1]}, "prompt_token_ids"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}, "adapter loading is off"),
        ("/v1/unload_lora_adapter", {"lora_name": "ghost"}, "cannot be found"),
        ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ]
    try:
        for path, body, fragment in cases:
            status, reply = http(server, path, body, key=None)
            assert 400 <= status < 500, (body, reply)
            assert_error((status, reply), status, fragment)
        assert_error(http(server, chat, raw=b"{" * 10000, key=None), 413, "larger than")
        assert_error(http(server, chat, raw=b'{"model": "tiny", "messages": [', key=None), 400, "not valid JSON")
        assert_clean(server)
    finally:
        server.stop()


def test_hostile_sampling_fields_never_reach_the_batch(tiny_model_dir):
    """Values that used to pass validation and raise inside the step (failing every request in
    the batch, and after three, the engine): each is a 400 now, and a concurrent request is fine."""
    import threading

    server = start_server(tiny_model_dir, config(), num_kv_blocks=64)
    chat = "/v1/chat/completions"
    innocent: list = []
    worker = threading.Thread(target=lambda: innocent.append(http(server, "/v1/completions", {
        "model": "tiny", "prompt": "Hello", "max_tokens": 40, "ignore_eos": True}, key=None)))
    try:
        worker.start()
        for extra, fragment in [({"top_k": 2**63}, "top_k"), ({"n": 2, "seed": 2**64 - 1}, "seed"),
                                ({"seed": -2**63 - 1}, "seed"), ({"top_k": 2**40}, "top_k")]:
            assert_error(http(server, chat, {"model": "tiny", "messages": MSG, **extra}, key=None), 400, fragment)
        for raw, fragment in [(b'"temperature": 1e999', "temperature"), (b'"repetition_penalty": 1e999', "repetition"),
                              (b'"top_p": NaN', "")]:
            body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], ' + raw + b"}"
            status, reply = http(server, chat, raw=body, key=None)
            assert_error((status, reply), 400, fragment)
        worker.join(60)
        assert innocent and innocent[0][0] == 200, innocent
        assert server.front.is_alive and http(server, "/health", key=None)[0] == 200
        assert_clean(server)
    finally:
        server.stop()


def test_invalid_unicode_and_oversized_lists_are_4xx(tiny_model_dir, adapter_root):
    """Lone surrogates anywhere in a body, a non-ASCII bearer token, too many prompts, stop
    strings or stop token ids: 4xx naming the problem; the server and /v1/models stay fine."""
    import urllib.request

    server = start_server(tiny_model_dir, config(adapter_root, api_key="k3y", admin_api_key="adm1n"),
                          max_waiting_requests=4, num_kv_blocks=64)
    chat, completions = "/v1/chat/completions", "/v1/completions"
    lone = b'"\\ud800"'  # the JSON escape of a lone surrogate
    try:
        for path, raw, fragment in [
            (completions, b'{"model": "tiny", "prompt": ' + lone + b"}", "prompt"),
            (chat, b'{"model": "tiny", "messages": [{"role": "user", "content": ' + lone + b"}]}", "messages"),
            (chat, b'{"model": ' + lone + b', "messages": [{"role": "user", "content": "hi"}]}', "model"),
            ("/v1/load_lora_adapter", b'{"lora_name": ' + lone + b', "lora_path": "a0"}', "lora_name"),
            ("/tokenize", b'{"prompt": ' + lone + b"}", "prompt"),
        ]:
            key = "adm1n" if path == "/v1/load_lora_adapter" else "k3y"
            assert_error(http(server, path, raw=raw, key=key), 400, fragment)
        req = urllib.request.Request(server.url + "/v1/models", headers={"Authorization": "Bearer caf\xe9"})
        try:
            urllib.request.urlopen(req, timeout=10)
            raise AssertionError("a wrong key was accepted")
        except urllib.error.HTTPError as err:
            assert err.code == 401
        assert_error(http(server, completions, {"model": "tiny", "prompt": ["x"] * 129}, key="k3y"), 400, "at most 128")
        assert_error(http(server, chat, {"model": "tiny", "messages": MSG, "stop": ["s"] * 65}, key="k3y"), 400, "stop")
        assert_error(http(server, chat, {"model": "tiny", "messages": MSG, "stop": ["s" * 2000]}, key="k3y"), 400,
                     "stop")
        assert_error(http(server, chat, {"model": "tiny", "messages": MSG, "stop_token_ids": [1] * 1025}, key="k3y"),
                     400, "stop_token_ids")
        # five prompts are five requests against max_waiting_requests=4
        assert_error(http(server, completions, {"model": "tiny", "prompt": ["a", "b", "c", "d", "e"]}, key="k3y"),
                     429, "max_waiting_requests")
        assert_error(http(server, chat, {"model": "tiny", "messages": MSG, "n": 5}, key="k3y"), 429, "waiting")
        assert http(server, "/v1/models", key="k3y")[0] == 200
        assert_clean(server)
    finally:
        server.stop()


def test_overload_gets_429_with_retry_after(tiny_model_dir):
    server = start_server(tiny_model_dir, config(), max_waiting_requests=2, num_kv_blocks=64, max_num_seqs=1)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 60, "ignore_eos": True}

    async def main():
        return await asyncio.gather(*(asyncio.to_thread(http, server, "/v1/completions", body, None)
                                      for _ in range(12)))

    try:
        results = asyncio.run(main())
        statuses = sorted(status for status, _ in results)
        assert statuses.count(200) >= 3 and 429 in statuses and set(statuses) <= {200, 429}
        rejected = next(reply for status, reply in results if status == 429)
        assert rejected["error"]["type"] == "RateLimitError"
        assert_clean(server)
    finally:
        server.stop()


def test_retry_after_header_and_request_timeout(tiny_model_dir):
    import urllib.error
    import urllib.request

    server = start_server(tiny_model_dir, config(request_timeout_s=0.5), max_waiting_requests=0,
                          num_kv_blocks=64)
    try:
        req = urllib.request.Request(server.url + "/v1/completions", method="POST",
                                     data=json.dumps({"model": "tiny", "prompt": "x"}).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 429 and err.value.headers["Retry-After"] == "1"
        server.front.max_waiting_requests = None
        slow = {"model": "tiny", "prompt": "Hello", "max_tokens": 480, "ignore_eos": True}
        real_step = server.engine.step
        server.engine.step = lambda: (time.sleep(0.05), real_step())[1]  # ~25 s for 480 tokens
        assert_error(http(server, "/v1/completions", slow, key=None), 504, "request timeout")
        server.engine.step = real_step
        assert_clean(server)
    finally:
        server.stop()


def test_a_failing_step_fails_its_batch_and_the_server_goes_on(tiny_model_dir):
    server = start_server(tiny_model_dir, config(), num_kv_blocks=64)
    real = server.engine.core.executor.execute
    calls = {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel fault")
        return real(*args)

    server.engine.core.executor.execute = flaky
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
    try:
        status, reply = http(server, "/v1/completions", body, key=None)
        assert_error((status, reply), 500, "generation failed")
        assert "simulated" not in reply["error"]["message"]  # internals stay in the log
        assert http(server, "/v1/completions", body, key=None)[0] == 200
        assert_clean(server)
    finally:
        server.stop()


def test_a_broken_engine_turns_health_503_and_fails_fast(tiny_model_dir, monkeypatch):
    server = start_server(tiny_model_dir, config(), num_kv_blocks=64)
    server.engine.core.executor.execute = lambda *a: (_ for _ in ()).throw(RuntimeError("device lost"))
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8}
    try:
        for _ in range(3):
            assert http(server, "/v1/completions", body, key=None)[0] in (500, 503)
        assert_error(http(server, "/health", key=None), 503)
        processed, real_process = [], server.front.inputs.process

        def process(*args, **kwargs):
            processed.append(args)
            return real_process(*args, **kwargs)

        monkeypatch.setattr(server.front.inputs, "process", process)
        streams = server.front.num_unfinished
        assert_error(http(server, "/v1/completions", body, key=None), 503, "engine failed")  # http's 60 s: a safety net
        # fast by what it skipped, not by seconds: refused at admission, before its prompt was processed, and
        # nothing was queued for the dead engine to (never) answer
        assert processed == [] and server.front.num_unfinished == streams
    finally:
        server.stop()


@pytest.mark.parametrize("spill", [0, 1 << 30], ids=["folder", "disk-tier"])
def test_adapter_folder_deleted_after_registration(tiny_model_dir, adapter_root, spill):
    """Without the disk tier an adapter the CPU cache dropped is read from its folder again: gone or broken, a 400
    naming it. With it, the adapter comes back from the prepared copy made when it was validated at load."""
    server = start_server(tiny_model_dir, config(adapter_root),
                          {f"a{i}": adapter_root / f"a{i}" for i in range(4)}, num_kv_blocks=64, max_loras=2,
                          max_cpu_loras=2, lora_spill_size=spill)
    body = lambda model: {"model": model, "prompt": "Hello", "max_tokens": 4}  # noqa: E731
    try:
        if spill:
            server.engine.adapters.spill.flush()
        shutil.rmtree(adapter_root / "a0")  # a0 was dropped from the 2-entry CPU cache by a2, a3
        (adapter_root / "a1" / "adapter_model.safetensors").write_bytes(b"garbage")
        for model in ("a0", "a1"):
            if spill:
                assert http(server, "/v1/completions", body(model), key=None)[0] == 200
            else:
                assert_error(http(server, "/v1/completions", body(model), key=None), 400, model)
        for model in ("a2", "a3", "tiny"):
            assert http(server, "/v1/completions", body(model), key=None)[0] == 200
        assert_clean(server)
    finally:
        server.stop()


def test_grammar_compile_timeout_is_a_400(tiny_model_dir):
    server = start_server(tiny_model_dir, config(), num_kv_blocks=64)
    server.engine.grammars.timeout_s = 1e-4
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"[a-z]{{{i}}}x"}
                                               for i in range(40)}}
    try:
        status, reply = http(server, "/v1/chat/completions",
                             {"model": "tiny", "messages": MSG, "response_format": {
                                 "type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}, key=None)
        assert_error((status, reply), 400, "longer than")
        assert_clean(server)
    finally:
        server.stop()


def test_health_answers_while_a_huge_prompt_is_tokenized(tiny_model_dir, monkeypatch):
    """Chat templating and tokenizing run in worker threads: a multi-megabyte prompt does not
    stall /health (or anyone's stream) on the event loop. Shown by order, not by seconds: both huge
    prompts are held inside the tokenizer call until /health has answered; on the event loop, a held
    call would hold the loop too, and /health could not answer."""
    import threading
    import urllib.request

    server = start_server(tiny_model_dir, config(max_request_body_bytes=16 << 20), num_kv_blocks=64)
    big = "hello world " * 175_000  # ~2 MB: 175,000 words, 350,000 tokens
    held, release, real_token_ids = threading.Semaphore(0), threading.Event(), server.front.inputs.token_ids

    def token_ids(text, *args, **kwargs):
        if len(text) >= len(big):
            held.release()
            release.wait(60)  # a safety net: the test releases it
        return real_token_ids(text, *args, **kwargs)

    monkeypatch.setattr(server.front.inputs, "token_ids", token_ids)
    results: list = []
    workers = [threading.Thread(target=lambda p=path, b=body: results.append(http(server, p, b, key=None)))
               for path, body in (("/tokenize", {"prompt": big}),
                                  ("/v1/completions", {"model": "tiny", "prompt": big, "max_tokens": 1}))]
    try:
        for w in workers:
            w.start()
        for _ in workers:  # both are in the tokenizer now, and stay there (60 s: a safety net)
            assert held.acquire(timeout=60), "a huge prompt never reached the tokenizer"
        for _ in range(3):  # 30 s: a safety net; a held event loop would never answer
            with urllib.request.urlopen(server.url + "/health", timeout=30) as resp:
                assert resp.status == 200
        assert all(w.is_alive() for w in workers) and not results  # /health answered while both were held
        release.set()
        for w in workers:
            w.join(60)  # a safety net
        assert not any(w.is_alive() for w in workers)
        assert sorted(status for status, _ in results) == [200, 400]  # tokenized; too long for the model
        assert_clean(server)
    finally:
        release.set()
        server.stop()
