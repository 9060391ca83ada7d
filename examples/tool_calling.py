"""Tool calling: the model picks a function and its arguments; the server guarantees every call's
arguments match that function's JSON Schema. Then the tool's result goes back for an answer.

    make serve                                   # in another terminal
    .venv/bin/python examples/tool_calling.py
"""

from __future__ import annotations

import argparse
import json
import os

import openai

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                       "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 40},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between currencies",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["amount", "from", "to"],
                       "properties": {"amount": {"type": "number", "minimum": 0},
                                      "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                      "to": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}},
]


def get_weather(city: str, unit: str) -> dict:  # stands in for a real API
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit, "sky": "sunny"}


def convert_currency(amount: float, **currencies) -> dict:
    return {"amount": round(amount * 1.08, 2), "currency": currencies["to"]}


parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
parser.add_argument("--model", default=None, help="base or base:adapter (default: the base model)")
args = parser.parse_args()

client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get("LORAPLEX_API_KEY") or "none")
model = args.model or next(m.id for m in client.models.list().data if m.parent is None)
messages = [{"role": "user", "content": "Use get_weather: what is the weather like in Paris and in Rome?"}]

# "required": the reply is one or more calls (parallel_tool_calls is on by default)
reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                       max_tokens=120, temperature=0)
calls = reply.choices[0].message.tool_calls
for call in calls:
    print(f"call {call.function.name}({call.function.arguments})")

# run the tools and send their results back; "auto" lets the model answer in text (or call again)
messages.append(reply.choices[0].message.model_dump(exclude_none=True))
for call in calls:
    result = globals()[call.function.name](**json.loads(call.function.arguments))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=60, temperature=0)
print("answer:", answer.choices[0].message.content or answer.choices[0].message.tool_calls)

# a named function, streamed: the arguments arrive in pieces, as with OpenAI
stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "How much is 100 US dollars in euros?"}], tools=TOOLS,
    tool_choice={"type": "function", "function": {"name": "convert_currency"}}, max_tokens=60, stream=True)
name, arguments = "", ""
for chunk in stream:
    for part in chunk.choices[0].delta.tool_calls or []:
        name = part.function.name or name
        arguments += part.function.arguments or ""
print(f"streamed call {name}({arguments}) ->", convert_currency(**json.loads(arguments)))
