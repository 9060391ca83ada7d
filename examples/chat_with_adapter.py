"""Chat with the base model and with an adapter, per request, through the official openai client.

    make serve                                   # in another terminal
    .venv/bin/python examples/chat_with_adapter.py [--adapter NAME]

`model` is "base" for the base model and "base:adapter" (or just "adapter") for an adapter. With
no adapter loaded yet, this hot-loads a small random one first (see hot_load_adapter.py).
"""

from __future__ import annotations

import argparse
import os

import openai

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
parser.add_argument("--adapter", default=None, help="a loaded adapter (default: the first one listed)")
parser.add_argument("--prompt", default="Give me one tip for writing clear emails.")
args = parser.parse_args()

client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get("LORAPLEX_API_KEY") or "none")
models = client.models.list().data
base = next(m.id for m in models if m.parent is None)
adapters = [m.id for m in models if m.parent == base]
adapter = args.adapter or (adapters[0] if adapters else None)
if adapter is None:
    from example_adapter import ensure_example_adapter

    path = ensure_example_adapter()
    client.post("/load_lora_adapter", body={"lora_name": "example", "lora_path": str(path)}, cast_to=str)
    adapter = "example"

for model in (base, f"{base}:{adapter}"):
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": args.prompt}],
                                           max_tokens=64, temperature=0)
    print(f"--- {model} ({reply.usage.completion_tokens} tokens, {reply.choices[0].finish_reason})")
    print(reply.choices[0].message.content)
