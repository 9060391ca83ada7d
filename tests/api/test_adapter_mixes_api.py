"""Adapter mixes over HTTP (#41): `adapters` on completions and chat, sent at once to one server, give
peft's greedy tokens on the equivalent `add_weighted_adapter(..., "cat")` adapter; bad mixes are 400s
naming the field; metrics count an adapter's use inside mixes."""

from __future__ import annotations

import json
import re
import shutil
import threading
import urllib.request

import pytest

from conftest import assert_all_blocks_free
from live_server import ADMIN_KEY, USER_KEY, assert_error, http, start_server, wait_idle
from tests.adapters.test_adapter_mixes import MIXES, NEW_TOKENS, PROMPTS, _peft_mix_greedy


def _body(mix) -> list[dict]:
    pairs = mix.items() if isinstance(mix, dict) else mix
    return [{"name": name, "weight": weight} for name, weight in pairs]


@pytest.fixture(scope="module")
def mix_server(tiny_model_dir, tiny_adapters, tmp_path_factory):
    from loraplex.api.server import ServerConfig

    root = tmp_path_factory.mktemp("mix-root")
    shutil.copytree(tiny_adapters[3], root / "a3")  # not loaded: the resolver reads it on first use
    config = ServerConfig(served_model_name="tiny", model_path=str(tiny_model_dir), api_key=USER_KEY,
                          admin_api_key=ADMIN_KEY, adapter_roots=(str(root),), enable_lora_resolver=True)
    adapters = {f"a{i}": tiny_adapters[i] for i in range(3)}
    server = start_server(tiny_model_dir, config, adapters, num_kv_blocks=64, max_loras=3,
                          max_adapters_per_request=3)
    server.adapter_dirs = {name: str(path) for name, path in adapters.items()}
    yield server
    server.stop()


def _complete(server, prompt: list[int], mix, results: dict, key) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    if mix is not None:
        body["adapters"] = _body(mix)
    results[key] = http(server, "/v1/completions", body)


def test_four_mixes_at_once_give_peft_weighted_adapter_tokens(mix_server, tiny_model_dir):
    """A negative weight, one adapter at 0.5 and a mix of three among them, plus the base model, all in
    flight together; the tokens (read back from the logprobs) are peft's on the combined adapter."""
    from transformers import AutoTokenizer

    specs = [*MIXES, None]
    prompts = PROMPTS[:len(specs)]
    expected = _peft_mix_greedy(tiny_model_dir, mix_server.adapter_dirs, specs, prompts)
    assert len({tuple(t) for t in expected}) == len(expected)  # every mix changes the tokens
    results: dict = {}
    threads = [threading.Thread(target=_complete, args=(mix_server, p, m, results, i))
               for i, (p, m) in enumerate(zip(prompts, specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for i, want in enumerate(expected):
        status, body = results[i]
        assert status == 200, body
        assert body["model"] == "tiny"
        got = body["choices"][0]["logprobs"]["tokens"]
        assert got == [tokenizer.decode([t]) for t in want], (i, specs[i])
    wait_idle(mix_server.engine)
    assert mix_server.engine.adapters.num_pins() == 0
    assert_all_blocks_free(mix_server.engine)


@pytest.mark.parametrize("adapters,status,param,fragment", [
    ([], 400, "adapters", "at least one adapter"),
    ([{"name": "a0", "weight": float("nan")}], 400, "adapters", "adapters[0].weight"),
    ([{"name": "a0", "weight": 0.5}, {"name": "a1", "weight": -4.5}], 400, "adapters", "adapters[1].weight"),
    ([{"name": "a0", "weight": 0.5}, {"name": "a0", "weight": 0.2}], 400, "adapters", "'a0' appears more than once"),
    ([{"name": f"a{i}", "weight": 0.1} for i in range(4)], 400, "adapters", "at most 3"),
    ([{"name": "a0", "weight": "heavy"}], 400, "adapters.0.weight", "weight"),
    ([{"name": "a0"}, {"name": "nope", "weight": 0.5}], 404, "adapters[1].name", "`nope` does not exist"),
])
def test_bad_mixes_are_refused_naming_the_field(mix_server, adapters, status, param, fragment):
    raw = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, "adapters": adapters}).encode()
    result = http(mix_server, "/v1/completions", raw=raw)
    assert_error(result, status, fragment)
    assert result[1]["error"]["param"] == param
    assert mix_server.engine.adapters.num_pins() == 0


def test_the_resolver_loads_a_mixed_adapter_on_first_use(mix_server):
    assert "a3" not in {a.name for a in mix_server.engine.adapters.list()}
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "adapters": [{"name": "a0", "weight": 0.5}, {"name": "a3", "weight": -0.5}]}
    status, reply = http(mix_server, "/v1/completions", body)
    assert status == 200, reply
    assert "a3" in {a.name for a in mix_server.engine.adapters.list()}
    wait_idle(mix_server.engine)
    assert mix_server.engine.adapters.num_pins() == 0


def test_an_adapter_in_model_and_adapters_is_a_400(mix_server):
    body = {"model": "tiny:a0", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "adapters": [{"name": "a1", "weight": 0.5}]}
    result = http(mix_server, "/v1/chat/completions", body)
    assert_error(result, 400, "model names the base model")
    assert result[1]["error"]["param"] == "adapters"


def _metric(text: str, name: str, label: str | None = None) -> float:
    pattern = rf'^loraplex:{name}(?:_total)?{{lora_name="{label}"}} (\S+)$' if label is not None else \
        rf"^loraplex:{name}(?:_total)? (\S+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def test_chat_streams_a_mix_and_metrics_count_each_adapter(mix_server):
    """A streamed chat on a mix equals the same request unstreamed; the adapters' request and token
    counters rise for each adapter of the mix, the server's totals once."""
    def scrape() -> str:
        req = urllib.request.Request(mix_server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.read().decode()

    before, stats_before = scrape(), http(mix_server, "/v1/stats")[1]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Mix these"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "adapters": [{"name": "a2", "weight": 0.8},
                                                                {"name": "a1", "weight": -0.3}]}
    status, whole = http(mix_server, "/v1/chat/completions", body)
    assert status == 200, whole
    req = urllib.request.Request(mix_server.url + "/v1/chat/completions", data=json.dumps({**body, "stream": True})
                                 .encode(), headers={"Authorization": f"Bearer {USER_KEY}",
                                                     "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events if e != "[DONE]")
    assert text == whole["choices"][0]["message"]["content"]
    after, stats_after = scrape(), http(mix_server, "/v1/stats")[1]
    for name in ("a1", "a2"):
        assert _metric(after, "lora_requests", name) - _metric(before, "lora_requests", name) == 2
        assert _metric(after, "lora_generation_tokens", name) - _metric(before, "lora_generation_tokens", name) == 8
    assert _metric(after, "adapter_mix_requests") - _metric(before, "adapter_mix_requests") == 2
    assert _metric(after, "generation_tokens") - _metric(before, "generation_tokens") == 8
    assert stats_after["requests"] - stats_before["requests"] == 2
    assert stats_after["generation_tokens"] - stats_before["generation_tokens"] == 8
