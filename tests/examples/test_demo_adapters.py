"""The demo adapters (`make demo-adapters`, trained here if the cache lacks them) visibly change
the default model's answers, and `examples/demo.py` shows them against a live server."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HELD_OUT = ["What is the best way to learn to cook?", "Why do stars twinkle?",
            "How does a refrigerator keep food cold?", "What is a good hobby for a rainy day?"]


@pytest.fixture(scope="module")
def demo_adapters(default_model_dir) -> dict[str, Path]:
    sys.path.insert(0, str(EXAMPLES))
    try:
        from train_demo_adapters import ADAPTERS, build
    finally:
        sys.path.remove(str(EXAMPLES))
    from loraplex.platform.model_store import adapters_dir

    return build(list(ADAPTERS), adapters_dir())


def test_each_adapter_has_its_style(default_model_dir, demo_adapters):
    from loraplex.platform import LLM, SamplingParams

    llm = LLM(str(default_model_dir), lora_modules={n: str(p) for n, p in demo_adapters.items()}, max_loras=4,
              max_model_len=1024)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in HELD_OUT]
    params = SamplingParams(temperature=0, max_tokens=80)
    rows = [(p, a) for a in (None, "shout", "terse", "pirate") for p in prompts]
    outs = llm.generate([p for p, _ in rows], params, adapter=[a for _, a in rows])
    texts: dict[str | None, list[str]] = {}
    for (_, adapter), out in zip(rows, outs):
        texts.setdefault(adapter, []).append(out.outputs[0])

    def capitals(text: str) -> float:
        letters = [c for c in text if c.isalpha()]
        return sum(c.isupper() for c in letters) / max(1, len(letters))

    for out in texts["shout"]:
        assert capitals(out.text) > 0.8, out.text
    for out in texts["terse"]:
        assert out.finish_reason == "stop", out.text
        assert len(re.findall(r"[.!?](\s|$)", out.text.strip())) == 1, out.text
    for out in texts["pirate"]:
        assert out.text.startswith("Arr"), out.text
    for out in texts[None]:  # the base model does none of that
        assert capitals(out.text) < 0.2 and not out.text.startswith("Arr")
    assert sum(len(o.token_ids) for o in texts["terse"]) < sum(len(o.token_ids) for o in texts[None]) / 2


def test_demo_script_against_a_live_server(default_model_dir, demo_adapters):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
    try:
        from live_server import start_server
    finally:
        sys.path.pop(0)
    from loraplex.api.server import ServerConfig

    config = ServerConfig(served_model_name="SmolLM2-135M-Instruct", model_path=str(default_model_dir))
    server = start_server(default_model_dir, config, demo_adapters, max_model_len=1024, max_loras=4)
    try:
        run = subprocess.run([sys.executable, "demo.py", "--base-url", server.url + "/v1", "--max-tokens", "40"],
                             cwd=EXAMPLES, capture_output=True, text=True, timeout=600)
    finally:
        server.stop()
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    for name in ("SmolLM2-135M-Instruct:shout", "SmolLM2-135M-Instruct:terse", "SmolLM2-135M-Instruct:pirate",
                 "Arr, matey", "as JSON matching a schema", '"confidence"'):
        assert name in run.stdout, name
