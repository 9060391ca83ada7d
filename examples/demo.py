"""The same prompt through the base model and each adapter, then a JSON-Schema request per
adapter, printed side by side.

    make demo-adapters     # once: trains shout / terse / pirate into the adapter root
    make serve             # loads them when present
    .venv/bin/python examples/demo.py
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap

import openai

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 120},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 10}},
          "required": ["answer", "confidence"], "additionalProperties": False}

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
parser.add_argument("--prompt", default="Why is the sky blue?")
parser.add_argument("--max-tokens", type=int, default=60)
args = parser.parse_args()

client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get("LORAPLEX_API_KEY") or "none")
models = client.models.list().data
base = next(m.id for m in models if m.parent is None)
names = [base] + [f"{base}:{m.id}" for m in models if m.parent == base]
if len(names) == 1:
    print("(no adapters loaded: run `make demo-adapters`, then restart `make serve`)")


def ask(model: str, max_tokens: int, **extra) -> str:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": args.prompt}],
                                           max_tokens=max_tokens, temperature=0, **extra)
    choice = reply.choices[0]
    if "response_format" in extra and choice.finish_reason == "stop":
        json.loads(choice.message.content)  # complete JSON always parses: the grammar guarantees it
    return choice.message.content + (" [cut at max_tokens]" if choice.finish_reason == "length" else "")


def show(title: str, answers: dict[str, str]) -> None:
    print(f"\n=== {title}")
    width = max(len(n) for n in answers)
    for name, text in answers.items():
        lines = textwrap.wrap(" ".join(text.split()), 90) or [""]
        print(f"{name:>{width}} | {lines[0]}")
        for line in lines[1:]:
            print(f"{'':>{width}} | {line}")


show(f"prompt: {args.prompt}", {n: ask(n, args.max_tokens) for n in names})
fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
show("the same prompt, as JSON matching a schema", {n: ask(n, 200, response_format=fmt) for n in names})
