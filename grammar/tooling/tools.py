"""Tool calls, in one place: the functions a request allows (`ToolCalls`), the grammar that
enforces their calls in the model family's format (grammar/tooling/tool_formats.py), the prompt that
asks for them where the chat template cannot, and the parser that reads them back, whole or
streamed (grammar/tooling/tool_parsing.py).

`required` (or a named function) constrains the whole output to calls; `auto` leaves text free
until the model starts a call, and from there constrains the call (llguidance's lazy lexeme is
the trigger). Inside a call the arguments follow their function's JSON Schema, under the same
exact-or-refused rules as `response_format`. The format is one of vLLM's `--tool-call-parser`
names, or `auto`: chosen from the chat template's text when the request is processed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.grammar.tooling.tool_formats import FORMATS, PARSERS, Markers, resolve, tool_format
from loraplex.grammar.tooling.tool_parsing import ToolCall, ToolCallError, ToolCallReader

__all__ = ["FORMATS", "PARSERS", "Function", "ToolCall", "ToolCallError", "ToolCallParser", "ToolCalls",
           "lark_rules", "parse_tool_calls", "plain_messages", "resolve", "template_takes_tools"]

OPEN, CLOSE = "<tool_call>", "\n</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_FUNCTIONS = 128


@dataclass(frozen=True)
class Function:
    name: str
    # none given: the function takes no arguments, so `{}` is the only call
    parameters: dict | bool = field(default_factory=lambda: {"type": "object", "properties": {},
                                                             "additionalProperties": False})
    strict: bool = True  # refuse what cannot be enforced exactly (false: drop it, and list it)
    openai_strict: bool = False  # `strict: true` given: only the formats OpenAI documents (grammar/schema/formats.py)

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
    text, under `auto`); several calls or one; in which family's `format` (grammar/tooling/tool_formats.py,
    or "auto" until the input processor reads the chat template)."""

    functions: tuple[Function, ...]
    required: bool = False
    parallel: bool = True
    format: str = "hermes"

    def __post_init__(self) -> None:
        if self.format != "auto":
            tool_format(self.format)
        if not self.functions:
            raise GrammarError("tool calls need at least one function")
        if len(self.functions) > MAX_FUNCTIONS:
            raise GrammarError(f"at most {MAX_FUNCTIONS} tools, got {len(self.functions)}")
        names = [f.name for f in self.functions]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise GrammarError(f"tool names must be unique; given twice: {twice}")

    def key_payload(self) -> dict:
        return {"functions": [[f.name, f.parameters, f.strict, f.openai_strict] for f in self.functions], "required": self.required,
                "parallel": self.parallel, "format": self.format}


def lark_rules(calls: ToolCalls, markers: Markers) -> list[str]:
    """llguidance Lark rules for `calls` in their format, entry rule `tool_calls`; each
    function's arguments an inline `%json` schema (`markers`: how the tokenizer holds the
    format's marker texts)."""
    if calls.format == "auto":
        raise GrammarError("the tool-call format auto must be resolved from the chat template first")
    return tool_format(calls.format).rules(calls, markers)


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

class ToolCallParser(ToolCallReader):
    """Reads an output in `format` as it streams (grammar/tooling/tool_parsing.py)."""

    def __init__(self, format: str = "hermes") -> None:
        super().__init__(tool_format(format).syntax)


def parse_tool_calls(text: str, format: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """A whole output's content and complete calls; ToolCallError for a malformed call."""
    parser = ToolCallParser(format)
    parser.feed(text, final=True)
    return parser.result()
