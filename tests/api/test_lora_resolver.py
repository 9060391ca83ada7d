"""--enable-lora-resolver: an unregistered adapter name that is a PEFT folder in an adapter root is
loaded on its first request (once, off the engine thread), served exactly as peft serves it, and
confined to the roots like the admin endpoint."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import openai
import pytest

from conftest import peft_greedy
from live_server import assert_error, http, start_server, wait_idle
from loraplex.adapters import registry as registry_module
from loraplex.api.server import ServerConfig

PROMPT = [5, 9, 14, 3, 22, 7]


@pytest.fixture(scope="module")
def resolver(tiny_model_dir, tiny_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("resolver-root")
    for src in tiny_adapters[:4]:
        shutil.copytree(src, root / src.name)
    broken = root / "broken"
    shutil.copytree(tiny_adapters[0], broken)
    (broken / "adapter_config.json").write_text(json.dumps({"r": 99, "target_modules": ["q_proj"]}))
    outside = tmp_path_factory.mktemp("outside")
    shutil.copytree(tiny_adapters[5], outside / "a5")
    (root / "escape").symlink_to(outside / "a5")
    config = ServerConfig(served_model_name="tiny", adapter_roots=(str(root),), enable_lora_resolver=True)
    server = start_server(tiny_model_dir, config, num_kv_blocks=64, max_num_seqs=8, max_loras=2)
    yield server
    server.stop()


def complete(server, model, max_tokens=8):
    return http(server, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                            "temperature": 0, "ignore_eos": True}, key=None)


def test_first_request_loads_the_folder_and_matches_peft(resolver, tiny_model_dir, tiny_adapters):
    assert "a2" not in {a.name for a in resolver.engine.adapters.list()}
    status, body = complete(resolver, "tiny:a2")
    assert status == 200, body
    ids = resolver.engine.tokenizer(body["choices"][0]["text"], add_special_tokens=False).input_ids
    want = peft_greedy(tiny_model_dir, [tiny_adapters[2]], [PROMPT], 8)[0]
    assert resolver.engine.tokenizer.decode(want) == body["choices"][0]["text"] and len(ids) > 0
    assert "a2" in {m["id"] for m in http(resolver, "/v1/models", key=None)[1]["data"]}


def test_concurrent_first_requests_load_once_and_never_on_the_engine_thread(resolver, monkeypatch):
    reads: list[str] = []
    real = registry_module.read_peft_adapter

    def counted(*args, **kwargs):
        reads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(registry_module, "read_peft_adapter", counted)

    async def many():
        client = openai.AsyncOpenAI(base_url=resolver.url + "/v1", api_key="none", max_retries=0, timeout=60)
        return await asyncio.gather(*(client.completions.create(model="a3", prompt=PROMPT, max_tokens=4)
                                      for _ in range(8)))

    outs = asyncio.run(many())
    assert len(outs) == 8 and all(o.choices[0].text is not None for o in outs)
    assert len(reads) == 1 and reads[0] != "loraplex-engine"
    wait_idle(resolver.engine)
    assert resolver.engine.adapters.num_pins() == 0


@pytest.mark.parametrize("model,status,fragment", [
    ("nope", 404, "does not exist"),  # no such folder
    ("tiny:..", 404, "does not exist"),
    ("escape", 404, "does not exist"),  # a symlink out of the root
    ("broken", 400, "could not be loaded"),  # the same validation as the admin endpoint
])
def test_what_the_resolver_refuses(resolver, model, status, fragment):
    assert_error(complete(resolver, model), status, fragment)
    assert model.split(":")[-1] not in {a.name for a in resolver.engine.adapters.list()}


def test_resolver_is_off_by_default(tiny_model_dir, tiny_adapters, tmp_path):
    shutil.copytree(tiny_adapters[0], tmp_path / "a0")
    server = start_server(tiny_model_dir, ServerConfig(served_model_name="tiny", adapter_roots=(str(tmp_path),)),
                          num_kv_blocks=32, max_loras=1)
    try:
        assert_error(complete(server, "a0"), 404, "does not exist")
    finally:
        server.stop()
