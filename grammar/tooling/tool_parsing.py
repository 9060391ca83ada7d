"""Reading tool calls back from an output, whole or as it streams, in any format: one reader,
driven by each format's `Syntax` (grammar/tooling/tool_formats.py).

An output is text and runs of calls. A run opens at a trigger (`<tool_call>`, `[TOOL_CALLS]`)
wherever the text has one, or, for formats without a trigger (llama3_json, pythonic), only at
the very start of the output. Inside a run each call is a head (up to its arguments, naming the
function), its arguments (a JSON object, or Python keyword arguments), a tail, then a
separator before the next call or the run's close.

The grammar writes only what this reader reads, so under it a call is never malformed; a call
that breaks its format anyway raises `ToolCallError` (never dropped, never passed off as text).
A call cut off by `max_tokens` or a stop string is not a call: its text comes back as content.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import secrets
import string
import uuid
import warnings
from dataclasses import dataclass, field

import regex

NAME = r"(?P<name>[A-Za-z0-9_-]{1,64})"  # a function's name, as `Function` admits it


class ToolCallError(ValueError):
    """An output whose tool call breaks its format (a bug under the grammar: reported, not hidden)."""


@dataclass(frozen=True)
class Syntax:
    """One format's calls, as regular expressions (`regex` syntax, matched partially while the
    output streams)."""

    name: str
    trigger: str | None  # text that opens a run anywhere; None: a run only opens the output
    lead: str  # what makes an output without a trigger a run of calls (matched at its start)
    open: str  # at the start of a run (after its trigger)
    head: str  # before each call's arguments; group `name`
    args: str  # "json": a JSON object; "python": keyword arguments up to the closing parenthesis
    tail: str  # after the arguments
    sep: str | None  # between the calls of a run; None: one call per run
    close: str  # after the last call of a run
    short_ids: bool = False  # call ids of 9 letters and digits (Mistral's templates refuse others)

    def new_id(self) -> str:
        if self.short_ids:
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"


@functools.lru_cache(maxsize=64)
def _re(pattern: str) -> regex.Pattern:
    return regex.compile(pattern)


@dataclass
class ToolCall:
    name: str
    arguments: str = ""
    complete: bool = False
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallReader:
    """`feed` takes the output piece by piece and returns the content text and OpenAI's
    `tool_calls` delta entries that are certain so far (a name once its head is read, then the
    arguments as they come); `final=True` flushes the rest. `result` gives the whole message."""

    def __init__(self, syntax: Syntax) -> None:
        self.syntax = syntax
        self.calls: list[ToolCall] = []
        self.content = ""
        self._buffer = ""
        self._pending = ""  # text read since the last complete call: content again if the output is cut off
        self._state = "text" if syntax.trigger else "lead"
        self._scan: _Scan | None = None
        self._out: tuple[list[str], list[dict]] = ([], [])

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self._buffer += text
        self._out = ([], [])
        while getattr(self, f"_{self._state}")(final):
            pass
        if final:
            self._flush()
        return "".join(self._out[0]), self._out[1]

    def result(self) -> tuple[str | None, list[ToolCall]]:
        """The message's content (None when empty) and its complete calls."""
        content = self.content.strip() if self.calls else self.content
        return content or None, [c for c in self.calls if c.complete]

    # ---- one state each: True when it moved on (the loop goes on), False to wait for text ---------

    def _lead(self, final: bool) -> bool:
        found = _re(self.syntax.lead).match(self._buffer, partial=True)
        if found is not None and found.partial and not final:
            return False
        self._state = "open" if found is not None and not found.partial else "plain"
        return True

    def _plain(self, final: bool) -> bool:
        self._emit(self._buffer)
        self._buffer = ""
        return False

    def _text(self, final: bool) -> bool:
        trigger = self.syntax.trigger
        at = self._buffer.find(trigger)
        if at < 0:
            keep = 0 if final else held(self._buffer, trigger)
            self._emit(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        self._emit(self._buffer[:at])
        self._buffer = self._buffer[at:]
        self._take(len(trigger))
        self._state = "open"
        return True

    def _open(self, final: bool) -> bool:
        return self._expect(self.syntax.open, "head")

    def _head(self, final: bool) -> bool:
        found = self._match(self.syntax.head)
        if found is None:
            return False
        call = ToolCall(found.group("name"), id=self.syntax.new_id())
        self.calls.append(call)
        self._out[1].append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": ""}})
        self._take(found.end())
        self._scan, self._state = _Scan(self.syntax.args), "args"
        return True

    def _args(self, final: bool) -> bool:
        if not self._scan.started:  # the whitespace before a JSON object is not part of it
            self._take(len(self._buffer) - len(self._buffer.lstrip()))
            if not self._buffer:
                return False
        used, done = self._scan.feed(self._buffer)
        piece, call = self._buffer[:used], self.calls[-1]
        self._take(used)
        if self.syntax.args == "json":
            self._arguments(call, piece)
        else:
            call.arguments += piece
        if not done:
            return False
        if self.syntax.args == "python":
            call.arguments = ""
            self._arguments(call, python_arguments(self._scan.text, self.syntax.name))
        elif not isinstance(_loads(call.arguments, self.syntax.name), dict):
            raise ToolCallError(f"{self.syntax.name} tool call {call.name}: arguments are not a JSON object")
        self._state = "tail"
        return True

    def _tail(self, final: bool) -> bool:
        if not self._expect(self.syntax.tail, "next"):
            return False
        self.calls[-1].complete, self._pending = True, ""
        return True

    def _next(self, final: bool) -> bool:
        syntax = self.syntax
        sep = _re(syntax.sep).match(self._buffer, partial=True) if syntax.sep is not None else None
        if sep is not None and not sep.partial:
            self._take(sep.end())
            self._state = "head"
            return True
        if sep is not None and not final:
            return False
        return self._expect(syntax.close, "text" if syntax.trigger else "after", reset=True)

    def _after(self, final: bool) -> bool:
        if self._buffer.strip():
            raise ToolCallError(f"{self.syntax.name}: text after the tool calls: {self._buffer[:60]!r}")
        self._buffer = ""
        return False

    # ---- helpers ------------------------------------------------------------------------------------

    def _match(self, pattern: str):
        """The full match of `pattern` at the buffer's start; None to wait for more text (at the
        end: a cut-off call); a malformed call raises."""
        found = _re(pattern).match(self._buffer, partial=True)
        if found is not None and found.partial:
            return None  # complete or not, only more text (or the end) tells
        if found is None:
            raise ToolCallError(f"{self.syntax.name}: malformed tool call at {self._buffer[:60]!r}")
        return found

    def _expect(self, pattern: str, then: str, reset: bool = False) -> bool:
        found = self._match(pattern)
        if found is None:
            return False
        self._take(found.end())
        self._state = then
        if reset:
            self._pending = ""
        return True

    def _take(self, size: int) -> None:
        self._pending += self._buffer[:size]
        self._buffer = self._buffer[size:]

    def _arguments(self, call: ToolCall, piece: str) -> None:
        if not piece:
            return
        call.arguments += piece
        deltas, index = self._out[1], len(self.calls) - 1
        if deltas and deltas[-1]["index"] == index:  # one entry per call and chunk
            deltas[-1]["function"]["arguments"] += piece
        else:
            deltas.append({"index": index, "function": {"arguments": piece}})

    def _emit(self, text: str) -> None:
        """Content text; the whitespace between calls is not content."""
        if not text or (self.calls and not text.strip()):
            return
        self.content += text
        self._out[0].append(text)

    def _flush(self) -> None:
        """The end of the output: a run cut off mid-call is content again."""
        if self._state in ("text", "plain", "after", "lead"):
            return
        if self._state == "next" and not self._buffer.strip():
            return  # complete calls, only their run's close missing: the calls stand
        if self.calls and not self.calls[-1].complete:
            self.calls.pop()
        text, self._pending, self._buffer = self._pending + self._buffer, "", ""
        self.content += text
        self._out[0].append(text)
        self._state = "text" if self.syntax.trigger else "plain"


class _Scan:
    """Where a call's arguments end: a JSON object's closing brace, or the parenthesis that
    closes Python keyword arguments (brackets counted outside strings)."""

    def __init__(self, kind: str) -> None:
        self.python = kind == "python"
        self.started = self.python  # a JSON object starts at its brace
        self.depth = 1 if self.python else 0
        self.quote: str | None = None
        self.escaped = False
        self.text = ""  # python: the arguments without their closing parenthesis

    def feed(self, text: str) -> tuple[int, bool]:
        """Characters of `text` that belong to the arguments, and whether they ended."""
        for i, ch in enumerate(text):
            if not self.started and ch != "{":
                raise ToolCallError(f"tool call arguments must be a JSON object, got {text[i:i + 40]!r}")
            self.started = True
            if self._step(ch):
                self.text += text[:i]
                return i + 1, True
        self.text += text
        return len(text), False

    def _step(self, ch: str) -> bool:
        """Whether `ch` ends the arguments."""
        if self.quote is not None:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == self.quote:
                self.quote = None
        elif ch == '"' or (ch == "'" and self.python):
            self.quote = ch
        elif ch in "{[(":
            self.depth += 1
        elif ch in "}])":
            self.depth -= 1
            return self.depth == 0
        return False


def _loads(text: str, fmt: str):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ToolCallError(f"{fmt} tool call arguments are not JSON: {exc}") from None


# ---- Python keyword arguments (pythonic) -> a JSON object -------------------------------------------

LITERAL_NAMES = {"true": True, "false": False, "null": None}  # JSON's spelling, which the grammar writes


def python_arguments(text: str, fmt: str = "pythonic") -> str:
    """`a=1, b="x"` as the JSON object `{"a": 1, "b": "x"}`. Each value is read as JSON where it
    is JSON (what the grammar writes) and as a Python literal otherwise (what models write
    unconstrained: `True`, `'x'`)."""
    source = f"f({text})"
    try:
        with warnings.catch_warnings():  # Python's view of JSON escapes (`\/`) is moot: values read as JSON first
            warnings.simplefilter("ignore")
            call = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ToolCallError(f"{fmt} tool call arguments are not Python keyword arguments: {exc}") from None
    if call.args or any(k.arg is None for k in call.keywords):
        raise ToolCallError(f"{fmt} tool call arguments must all be keyword arguments: {text[:60]!r}")
    values = {k.arg: _value(k.value, source, fmt) for k in call.keywords}
    return json.dumps(values, ensure_ascii=False)


def _value(node: ast.expr, source: str, fmt: str):
    try:
        return json.loads(ast.get_source_segment(source, node))
    except ValueError:
        return _literal(node, fmt)


def _literal(node: ast.expr, fmt: str):
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ToolCallError(f"{fmt} tool call argument {node.value} is not a JSON number")
        return node.value
    if isinstance(node, ast.Name) and node.id in LITERAL_NAMES:
        return LITERAL_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand, fmt)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item, fmt) for item in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                          for k in node.keys):
        return {k.value: _literal(v, fmt) for k, v in zip(node.keys, node.values)}
    raise ToolCallError(f"{fmt} tool call argument is not a literal: {ast.unparse(node)[:60]!r}")
