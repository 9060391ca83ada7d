"""No silent drops: every field of OpenAI's own request schemas (from the `openai` package) is
implemented, refused with a 400 naming it, or taken on purpose without effect (and listed in
README); a field nobody knows is refused too."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from live_server import assert_error, client, http, live  # noqa: F401
from loraplex.api.openai.protocol import IGNORED, REFUSED, ChatCompletionRequest, CompletionRequest

MSG = [{"role": "user", "content": "Hello"}]
ENDPOINTS = {"chat": (chat_create_params.CompletionCreateParamsBase, ChatCompletionRequest, "/v1/chat/completions",
                      {"model": "tiny", "messages": MSG, "max_tokens": 2}),
             "completions": (completion_create_params.CompletionCreateParamsBase, CompletionRequest, "/v1/completions",
                             {"model": "tiny", "prompt": "Hello", "max_tokens": 2})}
SAMPLES = {"functions": [{"name": "f"}], "function_call": "auto",
           "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
           "prediction": {"type": "content", "content": "x"}, "web_search_options": {}, "moderation": {},
           "best_of": 3, "suffix": "tail"}
IGNORED_SAMPLES = {"user": "u1", "metadata": {"k": "v"}, "store": True, "safety_identifier": "s",
                   "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {},
                   "service_tier": "auto", "reasoning_effort": "low", "verbosity": "low"}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_openai_field_is_implemented_refused_or_ignored_on_purpose(endpoint):
    schema, model, _, _ = ENDPOINTS[endpoint]
    fields = set(schema.__annotations__) | {"stream"}
    unaccounted = sorted(f for f in fields if f not in model.model_fields and f not in REFUSED and f not in IGNORED)
    assert not unaccounted, f"OpenAI {endpoint} fields with no decision: {unaccounted}"
    assert set(SAMPLES) == set(REFUSED) and set(IGNORED_SAMPLES) == set(IGNORED)


def test_readme_lists_what_is_refused_and_ignored():
    readme = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    for name in [*REFUSED, *IGNORED]:
        assert f"`{name}`" in readme, name


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_fields_are_a_400_naming_them(live, name):
    endpoint = "completions" if name in ("best_of", "suffix") else "chat"
    _, _, path, body = ENDPOINTS[endpoint]
    status, error = http(live, path, {**body, name: SAMPLES[name]})
    assert_error((status, error), 400, name)
    assert error["error"]["param"] == name


def test_no_op_values_of_refused_fields_and_ignored_fields_are_taken(live):
    _, _, path, body = ENDPOINTS["chat"]
    no_ops = {"tools": [], "tool_choice": "none", "functions": [], "function_call": "none", "modalities": ["text"]}
    status, out = http(live, path, {**body, **no_ops, **{k: v for k, v in IGNORED_SAMPLES.items()}})
    assert status == 200, out
    _, _, path, body = ENDPOINTS["completions"]
    status, out = http(live, path, {**body, "best_of": 1, "suffix": "", "user": "u"})
    assert status == 200, out


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_unknown_fields_are_refused_by_name(live, endpoint):
    _, _, path, body = ENDPOINTS[endpoint]
    status, error = http(live, path, {**body, "guided_decoding_backend": "xgrammar"})
    assert_error((status, error), 400, "guided_decoding_backend: unknown field")
    status, error = http(live, path, {**body, "response_format": {"type": "json_object", "strictness": 1}})
    assert_error((status, error), 400, "response_format.strictness: unknown field")


def test_replayed_assistant_messages_with_empty_extras_are_taken(live):
    _, _, path, body = ENDPOINTS["chat"]
    replay = [*MSG, {"role": "assistant", "content": "Hi", "refusal": None, "tool_calls": [], "annotations": None,
                     "audio": None, "function_call": None}, {"role": "user", "content": "Again"}]
    status, out = http(live, path, {**body, "messages": replay})
    assert status == 200, out
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    turn = [*MSG, {"role": "assistant", "tool_calls": calls}, {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    status, out = http(live, path, {**body, "messages": turn})
    assert status == 200, out
    calls[0]["function"]["arguments"] = "[1]"
    assert_error(http(live, path, {**body, "messages": turn}), 400, "function.arguments must be a JSON object")
    status, error = http(live, path, {**body, "messages": [*MSG, {"role": "assistant", "refusal": "no"}]})
    assert_error((status, error), 400, "messages.refusal")


def test_chat_template_kwargs_reach_the_template(live, monkeypatch):
    monkeypatch.setattr(live.engine.tokenizer, "chat_template",
                        "{{ greeting | default('') }}{% for m in messages %}{{ m.content }}{% endfor %}")
    _, _, path, body = ENDPOINTS["chat"]
    plain = http(live, path, body)[1]["usage"]["prompt_tokens"]
    status, out = http(live, path, {**body, "chat_template_kwargs": {"greeting": "Good morning, dear model. "}})
    assert status == 200 and out["usage"]["prompt_tokens"] > plain, out
    status, error = http(live, path, {**body, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert_error((status, error), 400, "chat_template_kwargs may not set ['add_generation_prompt']")


def test_one_model_card_by_id(live):
    listed = {card["id"]: card for card in http(live, "/v1/models")[1]["data"]}
    for model_id, card in listed.items():
        assert http(live, f"/v1/models/{model_id}") == (200, card)
    assert_error(http(live, "/v1/models/nope"), 404, "does not exist")


def test_logit_bias_steers_and_is_validated(live):
    _, _, path, body = ENDPOINTS["completions"]
    greedy = {**body, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    forced = http(live, path, {**greedy, "logit_bias": {"7": 100}})[1]["choices"][0]["logprobs"]["tokens"]
    assert len(forced) == 4 and len(set(forced)) == 1  # token 7, four times
    for bias, fragment in [({"x": 1}, "logit_bias keys must be token ids"), ({"7": 101}, "logit_bias must be"),
                           ({"99999": 1}, "logit_bias token ids must be in")]:
        assert_error(http(live, path, {**body, "logit_bias": bias}), 400, fragment)


def test_echo_with_logprobs_and_prompt_logprobs(live, client):
    _, _, path, body = ENDPOINTS["completions"]
    args = dict(model="tiny", prompt="Hello world, hello adapters", max_tokens=3, temperature=0,
                extra_body={"ignore_eos": True})
    reply = client.completions.create(echo=True, logprobs=2, **args)
    choice = reply.choices[0]
    lps = choice.logprobs
    prompt_len = reply.usage.prompt_tokens
    assert len(lps.tokens) == prompt_len + 3 and "".join(lps.tokens) == choice.text
    assert choice.text.startswith("Hello world, hello adapters")
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    assert all(lp <= 0 for lp in lps.token_logprobs[1:])
    assert lps.text_offset == sorted(lps.text_offset) and lps.text_offset[prompt_len] == len("Hello world, hello adapters")
    # vLLM's prompt_logprobs: per prompt token, id -> logprob, rank, decoded token; the same numbers
    vllm = client.completions.create(**{**args, "extra_body": {"ignore_eos": True, "prompt_logprobs": 1}})
    entries = vllm.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == prompt_len and entries[0] is None
    ids = http(live, "/tokenize", {"model": "tiny", "prompt": "Hello world, hello adapters"})[1]["tokens"]
    assert [entries[i][str(ids[i])]["logprob"] for i in range(1, prompt_len)] == lps.token_logprobs[1:prompt_len]
    assert all(1 <= min(e["rank"] for e in entry.values()) for entry in entries[1:])
    streamed = list(client.completions.create(stream=True, echo=True, logprobs=2, **args))
    tokens = [t for chunk in streamed for t in (chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else [])]
    assert tokens == lps.tokens
    chat = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    assert_error(http(live, path, {**body, "prompt_logprobs": 21}), 400, "prompt_logprobs")
