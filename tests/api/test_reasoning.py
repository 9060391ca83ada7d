"""`--reasoning-parser qwen3` through a real server on a tiny model whose tokenizer holds
`<think>` / `</think>` as added tokens (as Qwen3's does) and whose template opens the reasoning
in the prompt: replies split into `reasoning_content` and `content`, `max_reasoning_tokens`
forces `</think>` after exactly that many tokens, `response_format` and tool calls hold what
follows, streams carry the reasoning first, then the content; a template that closes the
reasoning in the prompt leaves none. Random weights: `</think>` is pushed away by logit_bias
so that only the budget closes the reasoning."""

from __future__ import annotations

import json

import jsonschema
import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from conftest import assert_all_blocks_free, make_tiny_model
from live_server import USER_KEY, assert_error, http, start_server, wait_idle

MSG = [{"role": "user", "content": "Hello world, hello adapters"}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
BODY = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n")
THINKING = BODY + "<think>\n{% endif %}"
NOT_THINKING = BODY + "<think>\n\n</think>\n\n{% endif %}"
COUNT = [{"type": "function", "function": {"name": "count", "parameters": SCHEMA}}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    from loraplex.api.server import ServerConfig

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-thinker"))
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.chat_template = THINKING
    tok.save_pretrained(folder)
    config = ServerConfig(served_model_name="tiny", model_path=str(folder), api_key=USER_KEY, reasoning_parser="qwen3")
    server = start_server(folder, config, num_kv_blocks=64, max_num_seqs=8)
    yield server
    server.stop()


@pytest.fixture
def client(thinker):
    import openai

    return openai.OpenAI(base_url=thinker.url + "/v1", api_key=USER_KEY, max_retries=0, timeout=60)


def ask(thinker, **fields) -> dict:
    """A chat completion (raw JSON: reasoning_content is not in OpenAI's client types), `</think>`
    unlikely unless forced."""
    close = thinker.engine.tokenizer.convert_tokens_to_ids("</think>")
    body = {"model": "tiny", "messages": MSG, "temperature": 0, "logit_bias": {str(close): -100}, **fields}
    status, out = http(thinker, "/v1/chat/completions", body)
    assert status == 200, out
    return out


@pytest.mark.parametrize("budget", [0, 7])
def test_the_budget_forces_the_close_tag_and_the_schema_holds_after_it(thinker, budget):
    out = ask(thinker, max_tokens=60, max_reasoning_tokens=budget, logprobs=True,
              response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})
    choice = out["choices"][0]
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    assert tokens.index("</think>") == budget  # the close tag came right after the budget
    message = choice["message"]
    assert (message["reasoning_content"] or "") == "".join(tokens[:budget])
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert choice["finish_reason"] == "stop"
    billed = _ledger_row(thinker, out["id"])
    assert billed[1] == out["usage"]["completion_tokens"] and billed[2] == budget  # the reasoning's tokens


def _ledger_row(thinker, response_id: str) -> tuple:
    """(prompt, generation, reasoning) tokens the usage ledger billed the call's first prompt."""
    row = next(r for r in _state(thinker).ledger.rows() if r.id == f"{response_id}-0")
    return row.prompt_tokens, row.generation_tokens, row.reasoning_tokens


def _state(thinker):
    return thinker.uvicorn_server.config.app.state.loraplex


def test_streamed_deltas_carry_the_reasoning_then_the_content(client, thinker):
    close = thinker.engine.tokenizer.convert_tokens_to_ids("</think>")
    fields = dict(model="tiny", messages=MSG, temperature=0, max_tokens=40, logit_bias={str(close): -100},
                  extra_body={"max_reasoning_tokens": 9, "ignore_eos": True})
    whole = client.chat.completions.create(**fields).choices[0].message
    chunks = list(client.chat.completions.create(stream=True, **fields))
    kinds, reasoning, content = [], "", ""
    for chunk in chunks:
        delta = chunk.choices[0].delta.model_dump()
        if delta.get("reasoning_content"):
            kinds.append("reasoning")
            reasoning += delta["reasoning_content"]
        if delta.get("content"):
            kinds.append("content")
            content += delta["content"]
    assert kinds and kinds == sorted(kinds, key=["reasoning", "content"].index)  # never content, then reasoning
    assert "reasoning" in kinds and "content" in kinds
    assert (reasoning, content) == (whole.model_extra["reasoning_content"], whole.content)
    assert "</think>" not in reasoning + content


def test_without_a_budget_an_unclosed_reasoning_is_all_reasoning(thinker):
    out = ask(thinker, max_tokens=12, ignore_eos=True)
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] is None
    assert out["choices"][0]["finish_reason"] == "length"


def test_tool_calls_come_after_the_reasoning(thinker):
    for stream in (False, True):
        status, out = http(thinker, "/v1/chat/completions", {
            "model": "tiny", "messages": MSG, "tools": COUNT, "tool_choice": "required", "max_tokens": 80,
            "temperature": 0, "max_reasoning_tokens": 5, "parallel_tool_calls": False, "stream": stream})
        assert status == 200
    out = ask(thinker, tools=COUNT, tool_choice="required", max_tokens=80, max_reasoning_tokens=5,
              parallel_tool_calls=False)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"]
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "count"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMA)
    wait_idle(thinker.engine)
    assert_all_blocks_free(thinker.engine)


def test_a_template_that_closes_the_reasoning_leaves_none(thinker, monkeypatch):
    monkeypatch.setattr(thinker.engine.tokenizer, "chat_template", NOT_THINKING)
    out = ask(thinker, max_tokens=30, max_reasoning_tokens=0,
              response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] is None
    jsonschema.validate(json.loads(message["content"]), SCHEMA)


def test_a_bad_budget_is_a_400_naming_it(thinker):
    body = {"model": "tiny", "messages": MSG, "max_tokens": 4}
    assert_error(http(thinker, "/v1/chat/completions", {**body, "max_reasoning_tokens": -1}), 400,
                 "max_reasoning_tokens must be an integer")
    assert_error(http(thinker, "/v1/chat/completions", {**body, "max_reasoning_tokens": "many"}), 400,
                 "max_reasoning_tokens")


def test_responses_keep_the_reasoning_apart_and_the_schema_holds_after_it(client, thinker):
    """/v1/responses: the reasoning is its own output item (as the chat answer's reasoning_content), the
    structured text follows it, the reasoning's tokens are counted; streamed, the reasoning's deltas come first."""
    text = {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True}}
    chat = ask(thinker, max_tokens=60, max_reasoning_tokens=7, logit_bias={},
               response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}})
    fields = dict(model="tiny", input=MSG[0]["content"], text=text, max_output_tokens=60, temperature=0,
                  extra_body={"max_reasoning_tokens": 7})
    whole = client.responses.create(**fields)
    reasoning = [item for item in whole.output if item.type == "reasoning"]
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert reasoning[0].content[0].text == chat["choices"][0]["message"]["reasoning_content"]
    assert whole.output_text == chat["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(whole.output_text), SCHEMA)
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= 7
    events = list(client.responses.create(stream=True, **fields))
    kinds = [e.type for e in events if e.type.endswith(".delta")]
    assert kinds == sorted(kinds, key=["response.reasoning_text.delta", "response.output_text.delta"].index)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning[0].content[0].text
    assert events[-1].response.output_text == whole.output_text
