"""Strict types at the edge (#49): no boolean or string where a number is expected, no number or
string where a boolean is, no number where a string is, in any body a client sends; each refusal a
400 in OpenAI's shape naming the field. Valid OpenAI input (an integer where a float is expected,
null for an optional field) is still served. Through a real server with tenants."""

from __future__ import annotations

import importlib
import json
import pkgutil
import typing

import pytest
from pydantic import BaseModel

from live_server import ADMIN_KEY, http, start_server
from loraplex.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from loraplex.api.tenancy.tenants import TenantsError, parse_tenants

ACME, GLOBEX, INITECH = "sk-acme-strict", "sk-globex-strict", "sk-initech-strict"
KEYS = (ACME, GLOBEX, INITECH)
COMPLETE = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "ignore_eos": True}


def _tenants(root) -> dict:
    return {"tenants": {
        "acme": {"api_keys": [ACME], "adapters": ["acme-*"], "base_model": True},
        "globex": {"api_keys": [GLOBEX], "adapters": ["globex-*"], "base_model": True, "can_load_adapters": True,
                   "adapter_root": str(root)},
        "initech": {"api_keys": [INITECH], "adapters": ["initech-*"], "weight": 2}}}


@pytest.fixture(scope="module")
def strict_server(tiny_model_dir, tiny_adapters, tmp_path_factory):
    from loraplex.api.server import ServerConfig

    folder = tmp_path_factory.mktemp("strict")
    root = folder / "globex-root"
    root.mkdir()
    path = folder / "tenants.json"
    path.write_text(json.dumps(_tenants(root)))
    config = ServerConfig(served_model_name="tiny", model_path=str(tiny_model_dir), admin_api_key=ADMIN_KEY,
                          tenants_file=str(path))
    server = start_server(tiny_model_dir, config, {"acme-a": tiny_adapters[0], "initech-c": tiny_adapters[1]},
                          num_kv_blocks=64, max_num_seqs=4, max_loras=2)
    yield server
    server.stop()


def _mix(weight, name="acme-a") -> list[dict]:
    return [{"name": name, "weight": weight}]


def _name(path: str) -> str:
    return "chat" if "chat" in path else path.rsplit("/", 1)[-1]


def _bad(path: str, base: dict, field: str, **change) -> tuple:
    return pytest.param(path, {**base, **change}, field, id=f"{_name(path)}:{field}={change!r}")


C, H = "/v1/completions", "/v1/chat/completions"
NUMBERS = [  # a number field given a boolean, a string, or a float where an integer is expected
    *[_bad(C, COMPLETE, "n", n=v) for v in ("2", True, 2.0)],
    *[_bad(C, COMPLETE, "max_tokens", max_tokens=v) for v in ("1", True, 1.5, 1.0)],
    *[_bad(C, COMPLETE, "temperature", temperature=v) for v in (True, "0.5")],
    *[_bad(C, COMPLETE, "top_p", top_p=v) for v in (False, "1")],
    *[_bad(C, COMPLETE, "top_k", top_k=v) for v in (True, "5", 5.5)],
    *[_bad(C, COMPLETE, "min_p", min_p=v) for v in (True, "0.1")],
    *[_bad(C, COMPLETE, "seed", seed=v) for v in (True, "1", 1.5)],
    *[_bad(C, COMPLETE, "presence_penalty", presence_penalty=v) for v in (True, "0")],
    *[_bad(C, COMPLETE, "frequency_penalty", frequency_penalty=v) for v in (False, "0")],
    *[_bad(C, COMPLETE, "repetition_penalty", repetition_penalty=v) for v in (True, "1")],
    *[_bad(C, COMPLETE, "min_tokens", min_tokens=v) for v in (True, "1", 1.0)],
    *[_bad(C, COMPLETE, "logprobs", logprobs=v) for v in (True, "1", 1.5)],
    *[_bad(C, COMPLETE, "prompt_logprobs", prompt_logprobs=v) for v in (True, "1", 0.0)],
    *[_bad(C, COMPLETE, "logit_bias.7", logit_bias={"7": v}) for v in (True, "1")],
    *[_bad(C, COMPLETE, "stop_token_ids.0", stop_token_ids=[v]) for v in (True, "1", 1.5)],
    *[_bad(C, COMPLETE, "prompt", prompt=v) for v in ([1, True, 3], [[5, 6], [7, False]], [5, "6"], [5, 6.0],
                                                      True, 5)],
    *[_bad(C, COMPLETE, "adapters.0.weight", adapters=_mix(v)) for v in ("0.5", True)],
    *[_bad(H, CHAT, "max_completion_tokens", max_completion_tokens=v) for v in ("1", True, 1.0)],
    *[_bad(H, CHAT, "top_logprobs", logprobs=True, top_logprobs=v) for v in (True, "1")],
    *[_bad(H, CHAT, "max_reasoning_tokens", max_reasoning_tokens=v) for v in ("4", True, 4.0)],
    *[_bad(H, CHAT, "n", n=v) for v in ("2", True)],
    *[_bad(H, CHAT, "temperature", temperature=v) for v in (True, "0")],
    _bad(H, CHAT, "adapters.0.weight", adapters=_mix("1")),
    *[_bad(C, COMPLETE, "best_of", best_of=v) for v in (True, 1.0)],  # not taken as its no-op value 1
]
BOOLEANS = [  # a boolean field given a number or a string
    *[_bad(C, COMPLETE, "stream", stream=v) for v in ("true", 1)],
    *[_bad(C, COMPLETE, "echo", echo=v) for v in (1, "true")],
    *[_bad(C, COMPLETE, "ignore_eos", ignore_eos=v) for v in ("true", 0)],
    _bad(C, COMPLETE, "skip_special_tokens", skip_special_tokens=1),
    _bad(C, COMPLETE, "include_stop_str_in_output", include_stop_str_in_output="false"),
    _bad(C, COMPLETE, "stream_options.include_usage", stream=True, stream_options={"include_usage": "true"}),
    _bad(C, COMPLETE, "store", store="true"),
    _bad(C, COMPLETE, "structured_outputs.any_whitespace", structured_outputs={"regex": "a", "any_whitespace": 1}),
    _bad(C, COMPLETE, "structured_outputs.json_object", structured_outputs={"json_object": "true"}),
    *[_bad(H, CHAT, "logprobs", logprobs=v) for v in (1, "true")],
    _bad(H, CHAT, "add_generation_prompt", add_generation_prompt="true"),
    _bad(H, CHAT, "parallel_tool_calls", parallel_tool_calls=0),
    _bad(H, CHAT, "stream", stream="false"),
    _bad(H, CHAT, "response_format.json_schema.strict",
         response_format={"type": "json_schema", "json_schema": {"schema": {}, "strict": "true"}}),
    _bad(H, CHAT, "tools.0.function.strict", tools=[{"type": "function", "function": {"name": "f", "strict": 1}}]),
]
STRINGS = [  # a string field given a number or a boolean
    _bad(C, COMPLETE, "model", model=1),
    *[_bad(C, COMPLETE, "stop", stop=v) for v in (5, True)],
    _bad(C, COMPLETE, "stop.1", stop=["a", 1]),
    _bad(C, COMPLETE, "adapters.0.name", adapters=[{"name": 1, "weight": 1}]),
    _bad(C, COMPLETE, "user", user=1),
    _bad(C, COMPLETE, "guided_regex", guided_regex=1),
    _bad(C, COMPLETE, "guided_choice.0", guided_choice=[1]),
    _bad(C, COMPLETE, "structured_outputs.choice.1", structured_outputs={"choice": ["a", 2]}),
    _bad(C, COMPLETE, "response_format.type", response_format={"type": 1}),
    *[_bad(C, COMPLETE, "cache_salt", cache_salt=v) for v in (1, True, "", "s" * 1025)],
    _bad(H, CHAT, "cache_salt", cache_salt=["salt"]),
    _bad(H, CHAT, "messages.0.content", messages=[{"role": "user", "content": 5}]),
    _bad(H, CHAT, "messages.0.content.0.text", messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
    _bad(H, CHAT, "messages.0.role", messages=[{"role": 1, "content": "Hi"}]),
    _bad(H, CHAT, "messages.0.name", messages=[{"role": "user", "content": "Hi", "name": 7}]),
    _bad(H, CHAT, "messages.1.tool_calls.0.function.arguments",
         messages=[*CHAT["messages"], {"role": "assistant", "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}]),
    _bad(H, CHAT, "tools.0.function.name", tools=[{"type": "function", "function": {"name": 1}}]),
    _bad(H, CHAT, "tool_choice", tool_choice=True),
    _bad(H, CHAT, "tool_choice.function.name", tools=[{"type": "function", "function": {"name": "f"}}],
         tool_choice={"type": "function", "function": {"name": 5}}),
]
OTHER_BODIES = [  # tokenize, detokenize, schema validation, adapter loading
    *[pytest.param("/detokenize", {"tokens": v}, "tokens.1", id=f"detokenize:{v!r}")
      for v in ([5, True], [5, "6"], [5, 6.0])],
    pytest.param("/tokenize", {"prompt": 5}, "prompt", id="tokenize:prompt"),
    pytest.param("/tokenize", {"prompt": "hi", "add_special_tokens": "true"}, "add_special_tokens",
                 id="tokenize:add_special_tokens"),
    pytest.param("/tokenize", {"prompt": "hi", "model": 1}, "model", id="tokenize:model"),
    pytest.param("/tokenize", {"messages": [{"role": "user", "content": 1}]}, "messages.0.content",
                 id="tokenize:messages"),
    pytest.param("/v1/validate_schema", {"schema": {}, "strict": "true"}, "strict", id="validate_schema:strict"),
    pytest.param("/v1/validate_schema", {"schema": 1}, "schema", id="validate_schema:schema"),
    pytest.param("/v1/load_lora_adapter", {"lora_name": 1, "lora_path": "x"}, "lora_name", id="load:lora_name"),
    pytest.param("/v1/load_lora_adapter", {"lora_name": "globex-x", "lora_path": True}, "lora_path",
                 id="load:lora_path"),
    pytest.param("/v1/unload_lora_adapter", {"lora_name": 1}, "lora_name", id="unload:lora_name"),
]


def _with_keys(cases: list) -> list:
    """Each tenant in turn; adapter loading as the tenant allowed to load."""
    return [pytest.param(*case.values, GLOBEX if "lora_adapter" in case.values[0] else KEYS[i % len(KEYS)],
                         id=case.id) for i, case in enumerate(cases)]


def _union_tag(part: str) -> bool:
    """How pydantic names the member of a union in an error's location: no field of ours."""
    return "[" in part or part[:1].isupper() or part in ("str", "int", "float", "bool")


@pytest.mark.parametrize("path,body,field,key", _with_keys([*NUMBERS, *BOOLEANS, *STRINGS, *OTHER_BODIES]))
def test_a_wrong_type_is_a_400_naming_the_field(strict_server, path, body, field, key):
    status, error = http(strict_server, path, body, key=key)
    assert status == 400, (body, error)
    assert set(error["error"]) == {"message", "type", "param", "code"} and error["error"]["code"] == 400
    param, message = error["error"]["param"] or "", error["error"]["message"]
    assert param == field or param.startswith(field + "."), (param, message)
    assert not any(_union_tag(part) for part in param.split(".")), param
    assert field in message, message


def _good(path: str, base: dict, key: str = ACME, **change) -> tuple:
    return pytest.param(path, {**base, **change}, key, id=f"{_name(path)}:{change!r}")


VALID = [  # integers where floats are expected, null for optional fields, floats, every tenant
    _good(C, COMPLETE, temperature=1, top_p=1, min_p=0, presence_penalty=0, frequency_penalty=1,
          repetition_penalty=1),
    _good(C, COMPLETE, GLOBEX, temperature=0.5, top_p=0.9, min_p=0.05, presence_penalty=-0.5,
          frequency_penalty=0.25, repetition_penalty=1.1, top_k=5, seed=7),
    _good(C, COMPLETE, INITECH, temperature=None, top_p=None, top_k=None, min_p=None, seed=None, stop=None,
          stop_token_ids=None, presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
          logprobs=None, prompt_logprobs=None, logit_bias=None, adapters=None, stream_options=None,
          response_format=None, structured_outputs=None, user=None, cache_salt=None),
    _good(C, COMPLETE, logit_bias={"7": 1, "8": -0.5}, stop_token_ids=[9], stop=["x", "y"], min_tokens=0, n=2),
    _good(C, COMPLETE, adapters=_mix(1)),
    _good(C, COMPLETE, adapters=[{"name": "acme-a", "weight": 0.25}]),
    _good(C, COMPLETE, INITECH, adapters=_mix(2, "initech-c")),
    _good(C, COMPLETE, GLOBEX, prompt=[[5, 6], [7]], echo=True, logprobs=1, prompt_logprobs=0),
    _good(C, COMPLETE, INITECH, prompt="Hello", stream=True, stream_options={"include_usage": True}),
    _good(C, COMPLETE, cache_salt="tenant-salt", best_of=1, suffix=""),
    _good(C, COMPLETE, GLOBEX, cache_salt="s" * 1024),
    _good(H, CHAT, temperature=0, top_p=1, max_tokens=None, max_completion_tokens=1),
    _good(H, CHAT, GLOBEX, logprobs=True, top_logprobs=0, seed=0, tool_choice=None, tools=None,
          response_format={"type": "text"}),
    _good(H, CHAT, INITECH, logprobs=False, top_logprobs=None, max_reasoning_tokens=None, cache_salt="abc",
          parallel_tool_calls=None, chat_template_kwargs=None, stream=True),
    _good(H, CHAT, tools=[{"type": "function", "function": {"name": "f", "strict": None}}], tool_choice="none"),
    _good(H, CHAT, GLOBEX, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": None}]),
    _good("/tokenize", {"prompt": "hi", "add_special_tokens": False, "model": None}, INITECH),
    _good("/detokenize", {"tokens": [5, 6, 0]}, GLOBEX),
    _good("/v1/validate_schema", {"schema": {"type": "object"}, "strict": False}),
]


@pytest.mark.parametrize("path,body,key", VALID)
def test_valid_edge_inputs_are_still_served(strict_server, path, body, key):
    status, out = http(strict_server, path, body, key=key)
    assert status == 200, (body, out)
    if isinstance(out, dict) and "choices" in out:
        assert len(out["choices"]) == body.get("n", 1) * (len(body["prompt"]) if path == C and isinstance(
            body["prompt"][0], list) else 1)


@pytest.mark.parametrize("token", [" 7", "7_0", "+7", "\u0667", "7.0", "-7"])
def test_a_logit_bias_key_is_decimal_digits_only(strict_server, token):
    status, error = http(strict_server, C, {**COMPLETE, "logit_bias": {token: 1}}, key=ACME)
    assert status == 400 and "logit_bias keys must be token ids" in error["error"]["message"], error


def test_cache_salt_reaches_the_engine():
    chat = ChatCompletionRequest.model_validate({**CHAT, "cache_salt": "salt-1"})
    assert chat.sampling_params(1, None).cache_salt == "salt-1"
    plain = CompletionRequest.model_validate(COMPLETE)
    assert plain.sampling_params(1, None).cache_salt is None


def test_an_integer_stays_an_integer_and_a_float_field_takes_one():
    body = CompletionRequest.model_validate({**COMPLETE, "temperature": 1, "adapters": _mix(1), "seed": 3})
    assert body.temperature == 1.0 and isinstance(body.temperature, float)
    assert body.adapters[0].weight == 1.0 and isinstance(body.adapters[0].weight, float)
    assert body.seed == 3 and type(body.seed) is int


@pytest.mark.parametrize("model,base,field,values", [
    (CompletionRequest, COMPLETE, "prompt", ["x", ["x", "y"], [5, 6], [[5], [6, 7]]]),
    (CompletionRequest, COMPLETE, "stop", ["x", ["x"], None]),
    (CompletionRequest, COMPLETE, "guided_json", [{"type": "object"}, '{"type": "object"}', None]),
    (ChatCompletionRequest, {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     ["auto", {"type": "function", "function": {"name": "f"}}, None]),
])
def test_each_member_of_a_union_field_is_taken(model, base, field, values):
    for value in values:
        assert model.model_validate({**base, field: value}).model_dump()[field] == value
    chat = ChatCompletionRequest.model_validate({**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}]}, {"role": "assistant", "content": None}, {"role": "user", "content": "b"}]})
    assert [m.text() for m in chat.messages] == ["a", "", "b"]


def _held_models(annotation) -> set:
    """The models a field's type holds, through unions, lists, dicts and Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return {annotation}
    return set().union(*(_held_models(arg) for arg in typing.get_args(annotation)))


def _bodies() -> set:
    """Every model a route of the server takes as its body, and every model those hold."""
    import loraplex.api as api
    from fastapi.routing import APIRoute

    found = set()
    for info in pkgutil.walk_packages(api.__path__, "loraplex.api."):
        if info.name.rpartition(".")[2].startswith("routes_"):
            routes = [r for r in importlib.import_module(info.name).router.routes if isinstance(r, APIRoute)]
            found |= {p.field_info.annotation for r in routes for p in r.dependant.body_params}
    todo = list(found)
    while todo:
        for field in todo.pop().model_fields.values():
            new = _held_models(field.annotation) - found
            found |= new
            todo += new
    return found


def test_every_body_and_every_model_inside_one_is_strict():
    bodies = _bodies()
    names = {b.__name__ for b in bodies}
    assert {"CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest", "LoadAdapterRequest",
            "UnloadAdapterRequest", "ValidateSchemaRequest", "AdapterWeight", "ChatMessage", "NamedToolChoice"} <= names
    lax = sorted(b.__name__ for b in bodies if b.model_config.get("strict") is not True)
    assert not lax, f"bodies that coerce: {lax}"


TENANT = {"api_keys": ["k"], "adapters": ["a-*"]}


@pytest.mark.parametrize("field,value", [
    ("max_concurrent", True), ("max_concurrent", "2"), ("max_concurrent", 1.5), ("max_concurrent", 2.0),
    ("requests_per_minute", True), ("requests_per_minute", "60"), ("requests_per_minute", 1.5),
    ("tokens_per_minute", 1.5), ("tokens_per_minute", "1000"), ("tokens_per_minute", False),
    ("weight", "2"), ("weight", True), ("weight", None), ("weight", float("nan")), ("weight", float("inf")),
    ("base_model", 1), ("base_model", "true"), ("base_model", None),
    ("can_load_adapters", 1), ("can_load_adapters", "false"),
    ("adapter_root", 1), ("adapter_root", True),
    ("api_keys", [1]), ("api_keys", "k"), ("api_keys", [True]),
    ("adapters", [1]), ("adapters", "a-*"), ("adapters", [False]),
])
def test_the_tenants_file_refuses_wrong_types_by_field(field, value):
    entry = {**TENANT, "adapter_root": "/srv/a", field: value}
    with pytest.raises(TenantsError, match=rf"tenants\.acme\.{field}"):
        parse_tenants({"tenants": {"acme": entry}})
