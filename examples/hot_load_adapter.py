"""Load an adapter into a running server, use it, unload it: no restart, other requests keep going.

    make serve                                   # in another terminal (adapter root: ~/.cache/loraplex/adapters)
    .venv/bin/python examples/hot_load_adapter.py [--path FOLDER]

The folder must lie inside one of the server's --adapter-root folders. With --admin-api-key set on
the server, export LORAPLEX_ADMIN_API_KEY here.
"""

from __future__ import annotations

import argparse
import os

import openai

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
parser.add_argument("--name", default="hot-example")
parser.add_argument("--path", default=None, help="PEFT folder under the adapter root (default: a random one)")
args = parser.parse_args()

path = args.path
if path is None:
    from example_adapter import ensure_example_adapter

    path = str(ensure_example_adapter())
admin_key = os.environ.get("LORAPLEX_ADMIN_API_KEY") or os.environ.get("LORAPLEX_API_KEY") or "none"
admin = openai.OpenAI(base_url=args.base_url, api_key=admin_key)
client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get("LORAPLEX_API_KEY") or "none")

print(admin.post("/load_lora_adapter", body={"lora_name": args.name, "lora_path": path}, cast_to=str))
print("models:", [(m.id, m.parent) for m in client.models.list().data])
reply = client.chat.completions.create(model=args.name, messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=32, temperature=0)
print(f"{args.name}: {reply.choices[0].message.content}")
print(admin.post("/unload_lora_adapter", body={"lora_name": args.name}, cast_to=str))
try:
    client.chat.completions.create(model=args.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
except openai.NotFoundError as err:
    print("after unload:", err.status_code, err.body["message"] if isinstance(err.body, dict) else err.body)
