"""Offline structured extraction through the Batch API: one JSON Schema, many documents, one adapter. Each line
runs as its own request below all interactive traffic; every answer matches the schema; the batch survives a
server restart.

    make serve                                   # in another terminal
    .venv/bin/python examples/batch_extraction.py [--model base:adapter]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time

import openai

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "city", "age"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
DOCUMENTS = ["Maria Lopez is 34 and lives in Valencia.", "Tom Berg, 52, moved to Oslo last year.",
             "Aiko Tanaka (27) works in Kyoto.", "In Lyon lives Paul Girard, aged 61."]

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
parser.add_argument("--model", default=None, help="base or base:adapter (default: the base model)")
args = parser.parse_args()

client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get("LORAPLEX_API_KEY") or "none")
model = args.model or next(m.id for m in client.models.list().data if m.parent is None)
lines = [{"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/responses",
          "body": {"model": model, "input": f"Extract the person as JSON: {text}", "max_output_tokens": 80,
                   "temperature": 0,
                   "text": {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}}}}
         for i, text in enumerate(DOCUMENTS)]
upload = client.files.create(file=("documents.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())),
                             purpose="batch")
batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/responses", completion_window="24h")
while batch.status not in ("completed", "failed", "expired", "cancelled"):
    time.sleep(0.5)
    batch = client.batches.retrieve(batch.id)
    print(f"{batch.status}: {batch.request_counts.completed} done, {batch.request_counts.failed} failed "
          f"of {batch.request_counts.total}")
assert batch.status == "completed", batch
for line in client.files.content(batch.output_file_id).text.splitlines():
    answer = json.loads(line)
    person = json.loads(answer["response"]["body"]["output_text"])  # valid JSON, matching SCHEMA
    print(answer["custom_id"], person)
if batch.error_file_id:
    print("failed lines:", client.files.content(batch.error_file_id).text)
