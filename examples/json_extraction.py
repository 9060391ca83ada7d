"""Extract structured data: the server guarantees the reply matches the JSON Schema.

    make serve                                   # in another terminal
    .venv/bin/python examples/json_extraction.py
"""

from __future__ import annotations

import argparse
import json
import os

import openai

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    },
    "required": ["name", "age", "city", "languages"],
    "additionalProperties": False,
}
TEXT = "Maria Lopez is 34, lives in Valencia and speaks Spanish, Catalan and English."

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
parser.add_argument("--model", default=None, help="base or base:adapter (default: the base model)")
args = parser.parse_args()

client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get("LORAPLEX_API_KEY") or "none")
model = args.model or next(m.id for m in client.models.list().data if m.parent is None)
reply = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": f"Extract the person as JSON: {TEXT}"}],
    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    max_tokens=120, temperature=0)
person = json.loads(reply.choices[0].message.content)  # valid JSON, matching SCHEMA
print(json.dumps(person, indent=2))

# vLLM's extra body works too: regex, choice or an EBNF grammar
sentiment = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": f"Is this text positive or negative? {TEXT}"}],
    extra_body={"structured_outputs": {"choice": ["positive", "negative", "neutral"]}}, max_tokens=5)
print("sentiment:", sentiment.choices[0].message.content)
