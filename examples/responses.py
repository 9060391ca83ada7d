"""The Responses API, as agent clients speak it: a plain turn, a structured one, a streamed one, and a
function call answered through `previous_response_id` (the server keeps the conversation; its prefix cache
makes the history cheap).

    make serve                                   # in another terminal
    .venv/bin/python examples/responses.py [--model base:adapter]
"""

from __future__ import annotations

import argparse
import json
import os

import openai

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 30}}}
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
        "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}}}

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
parser.add_argument("--model", default=None, help="base or base:adapter (default: the base model)")
args = parser.parse_args()

client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get("LORAPLEX_API_KEY") or "none")
model = args.model or next(m.id for m in client.models.list().data if m.parent is None)

reply = client.responses.create(model=model, instructions="Answer in one sentence.",
                                input="What is the capital of France?", max_output_tokens=40, temperature=0)
print("plain:", reply.output_text)

structured = client.responses.create(
    model=model, input="Describe Paris as JSON.", max_output_tokens=60, temperature=0,
    text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}})
print("structured:", json.loads(structured.output_text))  # valid JSON, matching CITY

print("streamed: ", end="")
with client.responses.stream(model=model, input="Name three colours.", max_output_tokens=30,
                             temperature=0) as stream:
    for event in stream:
        if event.type == "response.output_text.delta":
            print(event.delta, end="", flush=True)
print()

tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]
asked = client.responses.create(model=model, input="What's the weather like in Paris?", tools=tools,
                                tool_choice="required", parallel_tool_calls=False, max_output_tokens=60, temperature=0)
call = next(item for item in asked.output if item.type == "function_call")
print("call:", call.name, json.loads(call.arguments))  # arguments match WEATHER
answered = client.responses.create(
    model=model, previous_response_id=asked.id, tools=tools, max_output_tokens=40, temperature=0,
    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}])
print("answer:", answered.output_text, f"({answered.usage.input_tokens_details.cached_tokens} prompt tokens cached)")
print("stored:", client.responses.retrieve(answered.id).status,
      [item.type for item in client.responses.input_items.list(answered.id).data])
