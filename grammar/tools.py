"""The tool-call format, in one place: the grammar that enforces calls, the prompt that asks for
them where the chat template cannot, and the parser that reads them back (whole or streamed).

A call is Hermes-style text, as Qwen2.5 and Hermes chat templates write it:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`required` (or a named function) constrains the whole output to calls; `auto` leaves text free
until the model writes `<tool_call>`, and from there constrains the call (llguidance's lazy
lexeme is the trigger). Inside a call the arguments follow their function's JSON Schema, under
the same exact-or-refused rules as `response_format`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from loraplex.grammar.backend import GrammarError, StructuredOutputs

OPEN, CLOSE = "<tool_call>", "\n</tool_call>"
HEAD = re.compile(r'\n\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')
HEAD_MAX = 100  # characters a call's head can take (names are at most 64)
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_FUNCTIONS = 128
# what llguidance's %json is told: the same compact JSON as response_format, oneOf never as anyOf
JSON_OPTIONS = {"whitespace_flexible": False, "coerce_one_of": False}


@dataclass(frozen=True)
class Function:
    name: str
    # none given: the function takes no arguments, so `{}` is the only call
    parameters: dict | bool = field(default_factory=lambda: {"type": "object", "properties": {},
                                                             "additionalProperties": False})
    strict: bool = True  # refuse what cannot be enforced exactly (false: drop it, and list it)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise GrammarError(f"tool function name {self.name!r} must be 1-64 letters, digits, '_' or '-'")
        if self.parameters is False:
            raise GrammarError(f"tool {self.name}: parameters `false` admit no arguments at all")
        StructuredOutputs(json=self.parameters)  # the size and depth caps of any schema
        if isinstance(self.parameters, dict) and self.parameters.get("type", "object") != "object":
            raise GrammarError(f"tool {self.name}: parameters must describe a JSON object, "
                               f"got type {self.parameters.get('type')!r}")

    def object_schema(self) -> dict:
        """The parameters as a schema that admits objects only (a call's arguments are one)."""
        schema = self.parameters if isinstance(self.parameters, dict) else {}
        return schema if schema.get("type") == "object" else {"type": "object", "allOf": [schema]}


@dataclass(frozen=True)
class ToolCalls:
    """What the grammar allows: calls to `functions`; `required` or not (text, or calls after
    text, under `auto`); several calls or one."""

    functions: tuple[Function, ...]
    required: bool = False
    parallel: bool = True

    def __post_init__(self) -> None:
        if not self.functions:
            raise GrammarError("tool calls need at least one function")
        if len(self.functions) > MAX_FUNCTIONS:
            raise GrammarError(f"at most {MAX_FUNCTIONS} tools, got {len(self.functions)}")
        names = [f.name for f in self.functions]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise GrammarError(f"tool names must be unique; given twice: {twice}")

    def key_payload(self) -> dict:
        return {"functions": [[f.name, f.parameters, f.strict] for f in self.functions], "required": self.required,
                "parallel": self.parallel}


def lark_grammar(calls: ToolCalls) -> str:
    """llguidance Lark for `calls`, each function's arguments an inline `%json` schema."""
    rules = [f'f{i}: "{{\\"name\\": \\"{f.name}\\", \\"arguments\\": " %json '
             f'{json.dumps({**f.object_schema(), "x-guidance": JSON_OPTIONS})} "}}"'
             for i, f in enumerate(calls.functions)]
    more = ' ("\\n" "<tool_call>" call)*' if calls.parallel else ""
    start = f'start: "<tool_call>" calls' if calls.required else "start: TEXT | call_head calls"
    return "\n".join([
        "%llguidance {}",
        start,
        f"calls: call{more}",
        'call: "\\n" (' + " | ".join(f"f{i}" for i in range(len(calls.functions))) + ') "\\n</tool_call>"',
        # free text until the model writes the trigger; from there the call is enforced
        "TEXT: /(.|\\n)*/",
        'call_head[lazy]: TEXT "<tool_call>"',
        *rules,
    ])


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (a replayed assistant message's calls, in prompts)."""
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}{CLOSE}'


# ---- prompts for chat templates that know nothing of tools ----------------------------------------

def template_takes_tools(chat_template) -> bool:
    """Whether a chat template renders `tools` itself (HF templates that do reference them)."""
    sources = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    return any("tools" in source for source in sources)


def system_prompt(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False, separators=(",", ":")) for tool in tools)
    return (f"You may call these tools (each with a JSON Schema of its arguments):\n<tools>\n{listed}\n</tools>\n"
            f'To call one, write:\n{OPEN}\n{{"name": <tool name>, "arguments": <JSON object>}}{CLOSE}')


def plain_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """`messages` for a template without tool support: the tools described in the system
    message, an assistant's calls written out as it would write them, tool results as user
    turns in `<tool_response>` tags (consecutive ones merged)."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("tool_response"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_response": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = [call_text(c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False))
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content"), *calls]))})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        described = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


# ---- reading calls back ------------------------------------------------------------------------

@dataclass
class ToolCall:
    name: str
    arguments: str = ""
    complete: bool = False
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallParser:
    """Reads an output as it streams: `feed` returns the content text and the call deltas
    (OpenAI's `tool_calls` delta entries) that are certain so far; what could still be the
    start of a marker waits for the next piece; `final=True` flushes it."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.content = ""
        self._buffer = ""
        self._state = "text"  # text | head | arguments

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self._buffer += text
        content, deltas = "", []
        while True:
            if self._state == "text":
                at = self._buffer.find(OPEN)
                if at < 0:
                    keep = 0 if final else _held(self._buffer, OPEN)
                    content += self._emit_text(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                content += self._emit_text(self._buffer[:at])
                self._buffer, self._state = self._buffer[at + len(OPEN):], "head"
            elif self._state == "head":
                head = HEAD.match(self._buffer)
                if head is None:
                    if final or len(self._buffer) > HEAD_MAX or not _could_be_head(self._buffer):
                        content += self._emit_text(OPEN + self._buffer)  # not a call after all
                        self._buffer, self._state = "", "text"
                        if not final:
                            continue
                    break
                call = ToolCall(head.group(1))
                self.calls.append(call)
                deltas.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
                self._buffer, self._state = self._buffer[head.end():], "arguments"
            else:
                end = self._buffer.find("}" + CLOSE)
                done = end >= 0
                cut = end if done else len(self._buffer) - (0 if final else _held(self._buffer, "}" + CLOSE))
                if cut:
                    self.calls[-1].arguments += self._buffer[:cut]
                    if deltas and deltas[-1]["index"] == len(self.calls) - 1:  # one entry per call and chunk
                        deltas[-1]["function"]["arguments"] += self._buffer[:cut]
                    else:
                        deltas.append({"index": len(self.calls) - 1, "function": {"arguments": self._buffer[:cut]}})
                if not done:
                    self._buffer = self._buffer[cut:]
                    break
                self.calls[-1].complete = _is_object(self.calls[-1].arguments)
                self._buffer, self._state = self._buffer[end + 1 + len(CLOSE):], "text"
        return content, deltas

    def _emit_text(self, text: str) -> str:
        """Content text; the whitespace between calls is not content."""
        if self.calls and not text.strip():
            return ""
        self.content += text
        return text

    def result(self) -> tuple[str | None, list[ToolCall]]:
        """The message's content (None when empty) and its complete calls; an incomplete call
        (cut off by max_tokens or a stop string) comes back as content text."""
        content = self.content
        for call in self.calls:
            if not call.complete:
                content += call_text(call.name, call.arguments).removesuffix("}" + CLOSE)
        content = content.strip() if self.calls else content
        return content or None, [c for c in self.calls if c.complete]


def _could_be_head(text: str) -> bool:
    """Whether `text` can still grow into a call's head."""
    prefix, middle = '\n{"name": "', '", "arguments": '
    if len(text) <= len(prefix):
        return prefix.startswith(text)
    rest = text[len(prefix):]
    name, quote, after = rest.partition('"')
    return re.fullmatch(r"[A-Za-z0-9_-]{0,64}", name) is not None and (not quote or middle.startswith(quote + after))


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content and complete calls."""
    parser = ToolCallParser()
    parser.feed(text, final=True)
    return parser.result()
