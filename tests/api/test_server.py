"""The OpenAI-compatible server, through the official `openai` client and raw HTTP, on a real
uvicorn server over the tiny model (random weights: the mechanics, not the prose)."""

from __future__ import annotations

import json
import socket
import time

import jsonschema
import openai
import pytest

from conftest import assert_all_blocks_free
from live_server import (ADMIN_KEY, SCHEMA, USER_KEY, HeldSteps, assert_error, client, http, live,  # noqa: F401
                         wait_idle)

MSG = [{"role": "user", "content": "Hello world, hello adapters"}]


def assert_clean(live) -> None:
    wait_idle(live.engine)
    assert_all_blocks_free(live.engine)
    assert live.engine.adapters.num_pins() == 0


def test_models_list_base_and_adapters_with_lineage(client, live):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "a0", "a1"}
    assert models["tiny"].parent is None
    admin_cards = {c["id"]: c for c in http(live, "/v1/models", key=ADMIN_KEY)[1]["data"]}
    for name in ("a0", "a1"):
        assert models[name].parent == "tiny"
        assert models[name].root == name  # a user key sees no folder; the admin key sees each adapter's
        assert admin_cards[name]["root"] == live.engine.adapters.get(name).path


def test_chat_and_completions(client, live):
    chat = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    choice = chat.choices[0]
    assert chat.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and chat.usage.completion_tokens == 5
    comp = client.completions.create(model="tiny", prompt="Hello world", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert comp.object == "text_completion" and comp.usage.completion_tokens == 4
    for prompts in (["Hello", "world"], [[5, 6, 7], [8, 9]]):
        batch = client.completions.create(model="tiny", prompt=prompts, max_tokens=3, temperature=0, n=2,
                                          extra_body={"ignore_eos": True})
        assert [c.index for c in batch.choices] == [0, 1, 2, 3] and batch.usage.completion_tokens == 12
    echo = client.completions.create(model="tiny", prompt="Hello world", max_tokens=2, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Hello world")
    assert_clean(live)


def test_chat_content_parts_equal_string_content(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello world, "},
                                          {"type": "text", "text": "hello adapters"}]}]
    a = client.chat.completions.create(model="tiny", messages=parts, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streaming_equals_non_streaming_and_reports_usage(client, live, kind):
    args = dict(model="tiny", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    if kind == "chat":
        full = client.chat.completions.create(messages=MSG, **args)
        chunks = list(client.chat.completions.create(messages=MSG, stream=True,
                                                     stream_options={"include_usage": True}, **args))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expected = full.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        full = client.completions.create(prompt="Hello world", **args)
        chunks = list(client.completions.create(prompt="Hello world", stream=True,
                                                stream_options={"include_usage": True}, **args))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        expected = full.choices[0].text
    assert text == expected
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert_clean(live)


def test_n2_with_seed_is_reproducible(client):
    args = dict(model="tiny", messages=MSG, max_tokens=8, temperature=1.0, n=2, seed=7)
    a = client.chat.completions.create(**args)
    b = client.chat.completions.create(**args)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1]
    assert texts == [c.message.content for c in b.choices]


def test_logprobs(client):
    chat = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top token
    comp = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == comp.choices[0].text
    assert lp.text_offset[0] == 0


def test_stop_strings_and_max_tokens_one(client):
    base = client.completions.create(model="tiny", prompt="Hello world", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[3:5]
    cut = client.completions.create(model="tiny", prompt="Hello world", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[:base.index(stop)]
    kept = client.completions.create(model="tiny", prompt="Hello world", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert kept.finish_reason == "stop" and kept.text == base[:base.index(stop) + len(stop)]
    one = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=1, extra_body={"ignore_eos": True})
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 1


def test_structured_outputs(client, live):
    out = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=60, temperature=1.0, seed=1, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    for c in out.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    pick = client.completions.create(model="a0", prompt="Hello", max_tokens=10,
                                     extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert pick.choices[0].text in ("alpha", "beta")
    regex = client.completions.create(model="tiny", prompt="Hello", max_tokens=10,
                                      extra_body={"structured_outputs": {"regex": "(ab|cd){2}!"}})
    assert regex.choices[0].text in {a + b + "!" for a in ("ab", "cd") for b in ("ab", "cd")}
    assert_clean(live)


def test_json_object_parses(client):
    out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=200, temperature=0.7, seed=3,
                                         response_format={"type": "json_object"})
    c = out.choices[0]
    if c.finish_reason == "stop":  # a random model may ramble past max_tokens inside the object
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.message.content.startswith("{")


def test_base_colon_adapter_equals_bare_adapter_and_differs_from_base(client):
    args = dict(prompt="Hello world", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    a = client.completions.create(model="tiny:a0", **args).choices[0].text
    b = client.completions.create(model="a0", **args).choices[0].text
    base = client.completions.create(model="tiny", **args).choices[0].text
    assert a == b
    assert a != base


def test_unknown_model_and_bad_input(client, live):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="tiny:nope", messages=MSG)
    assert_error(http(live, "/v1/chat/completions", {"model": "other:a0", "messages": MSG}), 404, "does not exist")
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    assert_error(http(live, "/v1/chat/completions", {"model": "tiny", "messages": MSG,
                                                     "response_format": bad_schema}), 400, "objectx")
    long_prompt = list(range(3, 300)) * 2  # 594 tokens, max_model_len is 512
    assert_error(http(live, "/v1/completions", {"model": "tiny", "prompt": long_prompt}), 400, "max_model_len")
    cases = [
        ({"model": "tiny", "messages": MSG, "temperature": -1}, "temperature"),
        ({"model": "tiny", "messages": MSG, "top_p": 7}, "top_p"),
        ({"model": "tiny", "messages": MSG, "n": 100000}, "n="),
        ({"model": "tiny", "messages": MSG, "max_tokens": 10**6}, "max_model_len"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"model": "tiny", "messages": "hi"}, "messages"),
        ({"model": "tiny", "messages": []}, "messages"),
        ({"messages": MSG}, "model"),
    ]
    for body, fragment in cases:
        assert_error(http(live, "/v1/chat/completions", body), 400, fragment)
    assert_error(http(live, "/v1/completions", {"model": "tiny", "prompt": [1, 2, 10**6]}), 400, "prompt_token_ids")
    assert_error(http(live, "/v1/chat/completions", raw=b"{not json"), 400, "not valid JSON")
    assert_error(http(live, "/v1/chat/completions", raw=b"x" * (65 * 1024)), 413, "larger than")
    assert_clean(live)


def test_auth(live):
    assert_error(http(live, "/v1/models", key=None), 401, "API key")
    assert_error(http(live, "/v1/chat/completions", {"model": "tiny", "messages": MSG}, key="wrong"), 401)
    assert_error(http(live, "/tokenize", {"prompt": "hi"}, key=None), 401)
    assert http(live, "/v1/models", key=ADMIN_KEY)[0] == 200  # the admin key opens user routes too
    assert http(live, "/health", key=None)[0] == 200
    assert http(live, "/metrics", key=None)[0] == 200
    assert http(live, "/version", key=None)[1]["version"]
    admin_body = {"lora_name": "x", "lora_path": "a2"}
    assert_error(http(live, "/v1/load_lora_adapter", admin_body, key=USER_KEY), 403, "admin")
    assert_error(http(live, "/v1/load_lora_adapter", admin_body, key=None), 401)
    assert_error(http(live, "/v1/unload_lora_adapter", {"lora_name": "a0"}, key=USER_KEY), 403)


def test_hot_load_use_unload(client, live):
    assert http(live, "/v1/load_lora_adapter", {"lora_name": "hot", "lora_path": "a2"}, key=ADMIN_KEY) == \
        (200, "Success: LoRA adapter 'hot' added successfully.")
    assert_error(http(live, "/v1/load_lora_adapter", {"lora_name": "hot", "lora_path": "a2"}, key=ADMIN_KEY), 400,
                 "already been loaded")
    assert "hot" in {m.id for m in client.models.list().data}
    out = client.completions.create(model="tiny:hot", prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    assert http(live, "/v1/unload_lora_adapter", {"lora_name": "hot"}, key=ADMIN_KEY)[0] == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="hot", prompt="Hello", max_tokens=4)
    assert_error(http(live, "/v1/unload_lora_adapter", {"lora_name": "hot"}, key=ADMIN_KEY), 404, "cannot be found")
    # an absolute path inside the root is fine too
    absolute = {"lora_name": "hot2", "lora_path": str(live.spare[1])}
    assert http(live, "/v1/load_lora_adapter", absolute, key=ADMIN_KEY)[0] == 200
    assert http(live, "/v1/unload_lora_adapter", {"lora_name": "hot2"}, key=ADMIN_KEY)[0] == 200
    assert_clean(live)


def streamed_text(tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text a request's detokenizer makes of `ids` (random tokens may cut UTF-8 sequences, held back)."""
    from loraplex.platform.engine.detokenizer import Detokenizer

    detokenizer = Detokenizer(tokenizer, prompt)
    for token in ids:
        detokenizer.append(token)
    return detokenizer.text


def test_adapter_kinds_hot_load_list_their_kind_and_answer_as_peft(live, tiny_model_dir):
    """Adapters beyond plain LoRA through the server (DoRA, lora_bias with a rank pattern, saved norms, trainable
    tokens with the adapter's own tokenizer): the admin load, /v1/adapters' kind, peft's greedy tokens and text,
    prompts tokenized by the adapter's tokenizer, and DoRA in a mix a 400 naming the field."""
    from transformers import AutoTokenizer

    from conftest import jitter, make_peft_adapter, peft_greedy
    
    folders = {"k-dora": jitter(make_peft_adapter(tiny_model_dir, live.root / "k-dora", rank=4, seed=21,
                                                  use_dora=True), "magnitude", 3),
               "k-bias": make_peft_adapter(tiny_model_dir, live.root / "k-bias", rank=4, seed=22, lora_bias=True,
                                           rank_pattern={"q_proj": 2}),
               "k-norm": jitter(make_peft_adapter(tiny_model_dir, live.root / "k-norm", rank=4, seed=23,
                                                  targets=["q_proj"], modules_to_save=["norm"]), "norm", 4),
               "k-tok": jitter(make_peft_adapter(tiny_model_dir, live.root / "k-tok", rank=4, seed=24,
                                                 targets=["q_proj"], trainable_token_indices=[400, 401, 9]),
                               "trainable_tokens", 5)}
    own = AutoTokenizer.from_pretrained(tiny_model_dir)
    own.add_tokens(["<|pirate|>", "<|parrot|>"])  # ids 400 and 401: rows the 448-row model has
    own.save_pretrained(folders["k-tok"])
    for name in folders:
        assert http(live, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": name}, key=ADMIN_KEY)[0] == 200
    rows = {row["id"]: row for row in http(live, "/v1/adapters", key=ADMIN_KEY)[1]["data"]}
    assert rows["k-dora"]["kind"] == ["dora"] and rows["k-bias"]["kind"] == ["lora", "lora_bias", "rank_pattern"]
    assert rows["k-norm"]["kind"] == ["lora", "modules_to_save"]
    assert rows["k-tok"]["kind"] == ["lora", "trainable_tokens", "tokenizer"]
    assert rows["a0"]["kind"] == ["lora"]
    prompt = [5, 9, 13, 17, 21, 25]
    want = peft_greedy(tiny_model_dir, list(folders.values()), [prompt] * len(folders), 5)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for name, expected in zip(folders, want):
        status, body = http(live, "/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 5,
                                                      "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        assert body["choices"][0]["text"] == streamed_text(own if name == "k-tok" else tokenizer, prompt, expected)
    text = "hello <|pirate|> world"  # the adapter's own tokenizer reads it as one token, the base's as many
    for name, tok in (("k-tok", own), ("tiny", tokenizer)):
        status, body = http(live, "/v1/completions", {"model": name, "prompt": text, "max_tokens": 1})
        assert status == 200 and body["usage"]["prompt_tokens"] == len(tok(text).input_ids), body
    result = http(live, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                            "adapters": [{"name": "k-dora", "weight": 0.5}]})
    assert_error(result, 400, "adapters[0].name: 'k-dora' is a DoRA adapter")
    for name in folders:
        assert http(live, "/v1/unload_lora_adapter", {"lora_name": name}, key=ADMIN_KEY)[0] == 200
    assert_clean(live)


def test_adapter_paths_outside_the_root_missing_or_corrupt_are_refused(live, tiny_adapters, tmp_path):
    def load(path: str):
        return http(live, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path}, key=ADMIN_KEY)

    assert_error(load(str(tiny_adapters[5])), 400, "adapter roots")  # absolute, outside
    assert_error(load("../" + tiny_adapters[5].parent.name + "/" + tiny_adapters[5].name), 400, "adapter roots")
    (live.root / "escape").symlink_to(tiny_adapters[5], target_is_directory=True)
    assert_error(load("escape"), 400, "adapter roots")
    linked = live.root / "linked"
    linked.mkdir()
    for f in tiny_adapters[5].iterdir():
        (linked / f.name).symlink_to(f)
    assert_error(load("linked"), 400, "outside")
    assert_error(load("does-not-exist"), 404, "no adapter folder")
    corrupt = live.root / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((live.spare[0] / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)
    assert_error(load("corrupt"), 400, "cannot read weights")
    assert "bad" not in {a.name for a in live.engine.adapters.list()}


def test_unload_of_an_adapter_in_use_is_409(live, client):
    held = HeldSteps(live.engine, 1)  # running until the unload is answered, however fast the machine
    try:
        stream = client.completions.create(model="a1", prompt="Hello", max_tokens=300, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        assert_error(http(live, "/v1/unload_lora_adapter", {"lora_name": "a1"}, key=ADMIN_KEY), 409, "in use")
    finally:
        held.remove()
    stream.close()
    assert_clean(live)
    assert "a1" in {a.name for a in live.engine.adapters.list()}


def _raw_request_then_disconnect(live, body: dict, read_events: int) -> None:
    port = int(live.url.rsplit(":", 1)[1])
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + USER_KEY.encode() + b"\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        seen = b""
        while seen.count(b"data:") < read_events:
            seen += sock.recv(4096)
        for _ in range(500):  # the request is running in the engine before the client leaves
            if live.engine.has_unfinished():
                break
            time.sleep(0.01)
        assert live.engine.has_unfinished()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_everything(live, monkeypatch, stream):
    aborted = []
    real_abort = live.front.abort
    monkeypatch.setattr(live.front, "abort", lambda rid: (aborted.append(rid), real_abort(rid)))
    body = {"model": "a0", "prompt": "Hello world", "max_tokens": 480, "ignore_eos": True, "stream": stream}
    _raw_request_then_disconnect(live, body, read_events=2 if stream else 0)
    assert_clean(live)
    assert len(aborted) == 1 and aborted[0].startswith("cmpl-")


def test_tokenize_detokenize_health_version(live):
    status, tok = http(live, "/tokenize", {"prompt": "Hello world"})
    assert status == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    assert http(live, "/detokenize", {"tokens": tok["tokens"]})[1]["prompt"] == "Hello world"
    chat = http(live, "/tokenize", {"messages": MSG})[1]
    assert chat["count"] > tok["count"]
    assert_error(http(live, "/detokenize", {"tokens": [10**7]}), 400, "tokens")
    assert_error(http(live, "/tokenize", {}), 400, "prompt or messages")


def test_metrics_expose_vllm_names(client, live):
    client.completions.create(model="a0", prompt="Hello", max_tokens=3, stream=True).close()
    client.completions.create(model="a0", prompt="Hello", max_tokens=3)
    status, text = http(live, "/metrics", key=None)
    assert status == 200
    for name in ("loraplex:num_requests_running", "loraplex:num_requests_waiting", "loraplex:kv_cache_usage_perc",
                 "loraplex:prefix_cache_hit_rate", "loraplex:time_to_first_token_seconds_bucket",
                 "loraplex:inter_token_latency_seconds_bucket", "loraplex:e2e_request_latency_seconds_bucket",
                 "loraplex:prompt_tokens_total", "loraplex:generation_tokens_total",
                 'loraplex:lora_requests_total{lora_name="a0"}', "loraplex:lora_requests_info{",
                 'max_lora="2"', 'loraplex:request_success_total{finished_reason="length"}'):
        assert name in text, name


LOOSE = {"type": "object", "additionalProperties": False, "required": ["tags"],
         "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3, "uniqueItems": True}}}


@pytest.mark.parametrize("stream", [False, True])
def test_strict_false_lists_unenforced_keywords_in_a_header_and_the_body(client, live, stream):
    loose = {"type": "json_schema", "json_schema": {"name": "x", "schema": LOOSE, "strict": False}}
    body = {"model": "tiny", "messages": MSG, "max_tokens": 40, "seed": 2, "response_format": loose, "stream": stream}
    response = client.chat.completions.with_raw_response.create(**body)
    assert response.headers["x-loraplex-unenforced-keywords"] == "uniqueItems at #/properties/tags"
    parsed = response.parse()
    if stream:
        chunks = list(parsed)
        assert chunks[0].model_extra["unenforced_keywords"] == ["uniqueItems at #/properties/tags"]
    else:
        assert parsed.model_extra["unenforced_keywords"] == ["uniqueItems at #/properties/tags"]
    # strict (the default, and strict: true) refuses it by name
    for strict in (None, True):
        fmt = {"name": "x", "schema": LOOSE, **({"strict": strict} if strict is not None else {})}
        assert_error(http(live, "/v1/chat/completions", {"model": "tiny", "messages": MSG,
                     "response_format": {"type": "json_schema", "json_schema": fmt}}), 400, "'uniqueItems'")
    exact = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MSG, max_tokens=40, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": SCHEMA, "strict": False}})
    assert "x-loraplex-unenforced-keywords" not in exact.headers
    assert "unenforced_keywords" not in (exact.parse().model_extra or {})
    vllm_style = client.completions.with_raw_response.create(
        model="tiny", prompt="Hello", max_tokens=40, extra_body={"structured_outputs": {"json": LOOSE, "strict": False}})
    assert vllm_style.headers["x-loraplex-unenforced-keywords"] == "uniqueItems at #/properties/tags"
    assert_clean(live)


def test_a_whole_answer_times_each_token_as_it_comes(client, live):
    """Latencies come from the engine's deltas, whether the answer streams or not: a non-streamed answer of
    8 tokens adds 7 inter-token gaps (its bill waits for the whole answer; its clock does not)."""
    import re

    def gaps() -> float:
        text = http(live, "/metrics", key=None)[1]
        return float(re.search(r"^loraplex:inter_token_latency_seconds_count ([0-9.e+]+)$", text, re.M).group(1))

    before = gaps()
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8
    assert gaps() - before == 7
    assert_clean(live)


def test_an_unknown_format_is_served_as_an_annotation_unless_openai_strict(client, live):
    """#51: `format: url` constrains nothing in JSON Schema 2020-12, so the schema is served and the format listed;
    `strict: true` named in the request asks for OpenAI's list of formats, which has no `url`."""
    schema = {"type": "object", "additionalProperties": False, "required": ["link"],
              "properties": {"link": {"type": "string", "format": "url", "maxLength": 8}}}
    note = "format: url at #/properties/link (an annotation: a format JSON Schema does not define constrains nothing)"
    for strict in ({}, {"strict": False}):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, **strict}}
        response = client.chat.completions.with_raw_response.create(
            model="tiny", messages=MSG, max_tokens=40, seed=1, response_format=fmt)
        assert response.headers["x-loraplex-unenforced-keywords"] == note
        assert response.parse().model_extra["unenforced_keywords"] == [note]
    refused = http(live, "/v1/chat/completions", {"model": "tiny", "messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}})
    assert_error(refused, 400, "'format: url' at #/properties/link is not one of the formats OpenAI's strict mode")
    assert_clean(live)


def test_every_structured_output_is_checked_and_violations_are_counted(client, live, monkeypatch, caplog):
    from loraplex.grammar.manager import Compiled

    def metric(text: str, name: str) -> float:
        line = next(line for line in text.splitlines() if line.startswith(name))
        return float(line.rsplit(" ", 1)[1])

    _, before = http(live, "/metrics", key=None)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=60, seed=1, response_format=fmt)
    assert out.choices[0].finish_reason == "stop"
    _, after = http(live, "/metrics", key=None)
    assert metric(after, "loraplex:structured_output_checked_total") == \
        metric(before, "loraplex:structured_output_checked_total") + 1
    violations = 'loraplex:structured_output_violations_total{strict="true"}'
    assert metric(after, violations) == metric(before, violations)
    # a grammar that let a violation through: counted and logged as the bug it is
    monkeypatch.setattr(Compiled, "violation", lambda self, text: "'n' is a required property at $")
    with caplog.at_level("ERROR", logger="loraplex.outputs"):
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=60, seed=1, response_format=fmt)
    _, last = http(live, "/metrics", key=None)
    assert metric(last, violations) == metric(after, violations) + 1
    assert "breaks its schema (strict)" in caplog.text
