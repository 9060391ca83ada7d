"""A server with --speculative-config: the OpenAI endpoints give the tokens they give without drafts (streamed
or not), a request opts out with `speculative: false`, a bad value is a 400 naming it, and the operator's
stats count the drafts."""

from __future__ import annotations

import json

import pytest

from live_server import ADMIN_KEY, USER_KEY, assert_error, http, start_server, wait_idle

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "min_acceptance": 0})
BODY = {"model": "tiny", "prompt": "hello world, hello world, hello world, hello", "max_tokens": 24,
        "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    from loraplex.api.server import ServerConfig

    config = ServerConfig(served_model_name="tiny", model_path=str(tiny_model_dir), api_key=USER_KEY,
                          admin_api_key=ADMIN_KEY)
    made = [start_server(tiny_model_dir, config, num_kv_blocks=64, max_num_seqs=8, speculative_config=spec)
            for spec in (None, SPEC)]
    yield made
    for server in made:
        server.stop()


def completion(server, **extra) -> dict:
    status, out = http(server, "/v1/completions", {**BODY, **extra})
    assert status == 200, out
    return out


def streamed_text(server, **extra) -> str:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=USER_KEY, max_retries=0, timeout=60)
    body = {k: v for k, v in {**BODY, **extra}.items() if k not in ("model", "prompt", "max_tokens", "temperature")}
    chunks = client.completions.create(model="tiny", prompt=BODY["prompt"], max_tokens=BODY["max_tokens"],
                                       temperature=0, stream=True, extra_body=body)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_completions_with_drafts_equal_those_without(servers):
    plain, spec = servers
    want = completion(plain)["choices"][0]["text"]
    assert completion(spec)["choices"][0]["text"] == want
    assert streamed_text(spec) == want
    assert completion(spec, speculative=False)["choices"][0]["text"] == want
    assert completion(spec, stop=[want[5:8]])["choices"][0]["text"] == completion(plain, stop=[want[5:8]])[
        "choices"][0]["text"]
    wait_idle(spec.engine)
    status, stats = http(spec, "/v1/stats", key=ADMIN_KEY)
    assert status == 200 and stats["spec_decode"]["draft_tokens"] > 0
    status, stats = http(plain, "/v1/stats", key=ADMIN_KEY)
    assert status == 200 and stats["spec_decode"] is None


def test_a_request_that_opts_out_drafts_nothing(servers):
    _, spec = servers
    wait_idle(spec.engine)
    before = spec.engine.stats().spec_decode.num_drafts
    completion(spec, speculative=False)
    wait_idle(spec.engine)
    assert spec.engine.stats().spec_decode.num_drafts == before


def test_a_bad_speculative_value_is_a_400_naming_it(servers):
    _, spec = servers
    status, error = http(spec, "/v1/completions", {**BODY, "speculative": "sometimes"})
    assert_error((status, error), 400, "speculative")
