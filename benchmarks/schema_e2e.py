"""Structured outputs end to end: real-world schemas through `loraplex serve` on the default
model, each answer checked with the `jsonschema` validator.

    .venv/bin/python benchmarks/schema_e2e.py ../shared/data/jsonschema [--num 40 --backend auto]

Samples `--num` schemas (fixed seed) from the corpus and asks, for each, for a JSON value that
follows it (chat, greedy, `response_format` json_schema, strict). Each answer is one of: valid
(ended by the grammar and passes the validator), INVALID (a 200 that breaks its schema: must
be 0), cut off (`length`: ran into max_tokens), refused (400 naming what cannot be enforced, or
the shortest answer's length where it exceeds max_tokens), or another error. Exits 1 on any invalid answer.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import random
import socket
import sys
from pathlib import Path

import openai

from loraplex.grammar.manager import json_validator, schema_error

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import start_server  # noqa: E402

MAX_SCHEMA_CHARS = 4000  # in the prompt; the constraint itself is the whole schema


def ask(client: openai.OpenAI, schema: dict, max_tokens: int) -> tuple[str, str]:
    text = json.dumps(schema)
    prompt = ("Reply with one JSON value that follows this JSON Schema, and nothing else.\n\n"
              + (text if len(text) <= MAX_SCHEMA_CHARS else text[:MAX_SCHEMA_CHARS] + " ..."))
    try:
        out = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                     "strict": True}})
    except openai.BadRequestError as exc:
        return "refused", str(exc.body.get("message", exc) if isinstance(exc.body, dict) else exc)[:160]
    except openai.APIError as exc:
        return "error", str(exc)[:160]
    choice = out.choices[0]
    if choice.finish_reason == "length":
        return "cut off", f"{len(choice.message.content)} chars"
    try:
        value = json.loads(choice.message.content)
    except ValueError as exc:
        return "INVALID", f"not JSON: {exc}"
    error = schema_error(json_validator(schema), value)
    return ("valid", "") if error is None else ("INVALID", error[:160])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--num", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=768)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--no-finish-within-budget", action="store_true",
                        help="serve without the budget guarantee (the softer --json-close-window steer only)")
    args = parser.parse_args()
    files = sorted(args.corpus.glob("*.json"))
    picked = random.Random(args.seed).sample(files, min(args.num, len(files)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extra = ("--served-model-name", "default", "--grammar-backend", args.backend,
             *(["--no-finish-within-budget"] if args.no_finish_within_budget else []))
    proc = start_server(port, 0, None, extra, max_model_len=4096)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)
    try:
        with cf.ThreadPoolExecutor(args.concurrency) as pool:
            schemas = [json.loads(f.read_text())["schema"] for f in picked]
            results = list(pool.map(lambda schema: ask(client, schema, args.max_tokens), schemas))
    finally:
        proc.terminate()
        proc.wait(60)
    counts = collections.Counter(kind for kind, _ in results)
    print(f"backend {args.backend}: {len(picked)} schemas sampled (seed {args.seed}) from {args.corpus}, "
          f"max_tokens {args.max_tokens}, greedy, budget guarantee {'off' if args.no_finish_within_budget else 'on'}")
    for kind in ("valid", "INVALID", "cut off", "refused", "error"):
        print(f"  {kind:<8} {counts[kind]:>4}  ({100 * counts[kind] / len(picked):.0f}%)")
    for path, (kind, detail) in zip(picked, results):
        if kind != "valid":
            print(f"  {kind:<8} {path.name}: {detail}")
    return 1 if counts["INVALID"] else 0


if __name__ == "__main__":
    sys.exit(main())
