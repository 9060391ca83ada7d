"""Each model family's tool-call format (vLLM's `--tool-call-parser` names), one class each: how
`auto` recognizes it in a chat template, the llguidance Lark that writes its calls (entry rule
`tool_calls`), and the `Syntax` that reads them back (grammar/tooling/tool_parsing.py).

- hermes: `<tool_call>\\n{"name": f, "arguments": {...}}\\n</tool_call>`, "\\n" between; after any text
- llama3_json: `{"name": f, "parameters": {...}}` (`<|python_tag|>` first where it is a token), "; " between;
  at the output's start only
- mistral: `[TOOL_CALLS][{"name": f, "arguments": {...}}, ...]`; after any text
- mistral_v11 (templates that write `[ARGS]`): `[TOOL_CALLS]f[ARGS]{...}`, each after its own `[TOOL_CALLS]`
- pythonic: `[f(a=1, b="x"), g()]` (values as JSON); at the output's start only

Under `auto` (tool_choice) a format with a trigger leaves text free until the trigger and holds
the calls after it (llguidance's lazy lexeme); one without is either text or calls, decided by
the output's first characters, as its reader decides. A marker the tokenizer holds as one token
is written as that token (llguidance keeps such tokens out of text, so the text spelling would
make the model spell it out).
"""

from __future__ import annotations

import json
import keyword
import re
from typing import Protocol

from loraplex.grammar.backend import GrammarError
from loraplex.grammar.schema.json_schema import ANNOTATIONS, UnsupportedKeywordError
from loraplex.grammar.tooling.tool_parsing import NAME, Syntax

# what llguidance's %json is told: the same compact JSON as response_format, oneOf never as anyOf
JSON_OPTIONS = {"whitespace_flexible": False, "coerce_one_of": False}
PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")  # the flag's choices (and "auto")
ANY_TEXT = "/(.|\\n)*/"
PYTHON_TAG, TOOL_CALLS, ARGS = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"


class Markers(Protocol):
    """A tokenizer's view of marker texts (grammar/backends/llguidance_backend.py)."""

    def token(self, text: str) -> int | None: ...  # the one special token that is `text`, if any
    def __call__(self, text: str) -> str: ...  # `text` as a Lark expression


def _json(schema) -> str:
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def _str(text: str) -> str:
    return json.dumps(text)


def _head(name: str, key: str) -> str:
    return _str(f'{{"name": "{name}", "{key}": ')


def _json_head(keys: str) -> str:
    """A JSON call's head, up to its arguments (whitespace as models may write it)."""
    return rf'\s*\{{\s*"name"\s*:\s*"{NAME}"\s*,\s*"(?:{keys})"\s*:\s*'


class Format:
    name: str
    syntax: Syntax
    markers: tuple[str, ...] = ()  # texts that may be special tokens: kept in the output text

    def detect(self, template: str) -> bool:
        return False

    def rules(self, calls, lit: Markers) -> list[str]:
        raise NotImplementedError

    def arguments_schema(self, function) -> dict:
        """The schema the grammar holds the function's arguments to."""
        return function.object_schema()

    def refusal(self, schema: dict) -> GrammarError | None:
        """What this format cannot write of an arguments schema (an `UnsupportedKeywordError`
        when dropping that keyword would do, for `strict: false`)."""
        return None

    def _calls(self, calls, sep: str) -> str:
        return "tc_calls: tc_call" + (f" ({sep} tc_call)*" if calls.parallel else "")

    def _functions(self, calls, body) -> list[str]:
        """`tc_fn`: a call to one of the functions, each written by `body(index, function)`."""
        names = " | ".join(f"tc_f{i}" for i in range(len(calls.functions)))
        return [f"tc_fn: {names}", *(f"tc_f{i}: {body(i, f)}" for i, f in enumerate(calls.functions))]

    def _text_then(self, trigger: str, lit: Markers) -> list[str]:
        """`TC_TEXT` (any text) and `tc_head` (text up to the first trigger, which it includes)."""
        if lit.token(trigger) is not None:  # a special token cannot be inside text: it ends it
            return [f"TC_TEXT: {ANY_TEXT}", f"tc_head: TC_TEXT {lit(trigger)}"]
        return [f"TC_TEXT: {ANY_TEXT}", f"tc_head[lazy]: TC_TEXT {lit(trigger)}"]

    def _plain(self) -> str:
        """`TC_PLAIN`: any text that the reader does not take for calls (formats without a trigger)."""
        return f"TC_PLAIN: /(?s:.*)/ & ~/{self.syntax.lead}(?s:.*)/"


class Hermes(Format):
    name = "hermes"
    markers = ("<tool_call>", "</tool_call>")
    syntax = Syntax(name, trigger="<tool_call>", lead="", open="", head=_json_head("arguments"), args="json",
                    tail=r"\s*\}\s*</tool_call>", sep=None, close="")

    def detect(self, template: str) -> bool:
        return "<tool_call>" in template

    def rules(self, calls, lit: Markers) -> list[str]:
        start = (f"tool_calls: {lit('<tool_call>')} tc_calls" if calls.required
                 else "tool_calls: TC_TEXT | tc_head tc_calls")
        return [start, self._calls(calls, f'"\\n" {lit("<tool_call>")}'),
                f'tc_call: "\\n" tc_fn "\\n" {lit("</tool_call>")}',
                *self._functions(calls, lambda i, f: f'{_head(f.name, "arguments")} {_json(f.parameters)} "}}"'),
                *self._text_then("<tool_call>", lit)]


class Llama3Json(Format):
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    syntax = Syntax(name, trigger=None, lead=r"\s*(?:<\|python_tag\|>)?\s*\{", open=r"\s*(?:<\|python_tag\|>)?",
                    head=_json_head("parameters|arguments"), args="json", tail=r"\s*\}", sep=r"\s*;\s*", close="")

    def detect(self, template: str) -> bool:
        return PYTHON_TAG in template or '"parameters": dictionary of argument name' in template

    def rules(self, calls, lit: Markers) -> list[str]:
        tag = f"{lit(PYTHON_TAG)}? " if lit.token(PYTHON_TAG) is not None else ""
        start = f"tool_calls: {tag}tc_calls" if calls.required else f"tool_calls: TC_PLAIN | {tag}tc_calls"
        return [start, self._calls(calls, '"; "'), "tc_call: tc_fn",
                *self._functions(calls, lambda i, f: f'{_head(f.name, "parameters")} {_json(f.parameters)} "}}"'),
                self._plain()]


class Mistral(Format):
    name = "mistral"
    markers = (TOOL_CALLS,)
    syntax = Syntax(name, trigger=TOOL_CALLS, lead="", open=r"\s*\[", head=_json_head("arguments"), args="json",
                    tail=r"\s*\}", sep=r"\s*,\s*", close=r"\s*\]", short_ids=True)

    def detect(self, template: str) -> bool:
        return TOOL_CALLS in template or "[AVAILABLE_TOOLS]" in template

    def rules(self, calls, lit: Markers) -> list[str]:
        start = (f'tool_calls: {lit(TOOL_CALLS)} "[" tc_calls "]"' if calls.required
                 else 'tool_calls: TC_TEXT | tc_head "[" tc_calls "]"')
        return [start, self._calls(calls, '", "'), "tc_call: tc_fn",
                *self._functions(calls, lambda i, f: f'{_head(f.name, "arguments")} {_json(f.parameters)} "}}"'),
                *self._text_then(TOOL_CALLS, lit)]


class MistralV11(Mistral):
    """Mistral's tokenizers from v11 on (templates that write `[ARGS]`): name, then arguments."""

    name = "mistral_v11"
    markers = (TOOL_CALLS, ARGS)
    syntax = Syntax(name, trigger=TOOL_CALLS, lead="", open="", head=NAME + r"\[ARGS\]", args="json", tail="",
                    sep=None, close="", short_ids=True)

    def rules(self, calls, lit: Markers) -> list[str]:
        start = (f"tool_calls: {lit(TOOL_CALLS)} tc_calls" if calls.required
                 else "tool_calls: TC_TEXT | tc_head tc_calls")
        return [start, self._calls(calls, lit(TOOL_CALLS)), "tc_call: tc_fn",
                *self._functions(calls, lambda i, f: f"{_str(f.name)} {lit(ARGS)} {_json(f.parameters)}"),
                *self._text_then(TOOL_CALLS, lit)]


# what an arguments object may say and still be written as keyword arguments
KEYWORD_OBJECT = {"type", "properties", "required", "additionalProperties"} | ANNOTATIONS
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Pythonic(Format):
    """Llama 3.2 / 4's Python list of calls. Arguments are keywords, each value a JSON value
    under its property's schema (`true` / `null` as JSON spells them; the reader takes Python's
    spelling too); properties come in the schema's order, the optional ones where the model
    writes them. An object schema that says more than its properties (`minProperties`,
    `patternProperties`, ...) cannot be written as keywords: refused by name."""

    name = "pythonic"
    syntax = Syntax(name, trigger=None, lead=r"\s*\[", open=r"\s*\[", head=r"\s*" + NAME + r"\(", args="python",
                    tail="", sep=r"\s*,\s*", close=r"\s*\]")

    def detect(self, template: str) -> bool:
        return "[func_name1(" in template or "func_name1(params_name1=" in template

    def arguments_schema(self, function) -> dict:
        schema = function.parameters if isinstance(function.parameters, dict) else {}
        if "type" not in schema and "$ref" not in schema:  # the same constraint as object_schema's allOf
            return {**schema, "type": "object"}
        return function.object_schema()

    def refusal(self, schema: dict) -> GrammarError | None:
        extra = sorted(set(schema) - KEYWORD_OBJECT)
        if extra:
            return UnsupportedKeywordError(
                f"json schema keyword {extra[0]!r} at # is not supported by the pythonic tool-call format (it "
                f"writes arguments as keywords, one per property, so the request is refused)", extra[0], "#")
        properties = schema.get("properties", {})
        for name in properties:
            if not IDENTIFIER.fullmatch(name) or keyword.iskeyword(name):
                return GrammarError(f"property {name!r} cannot be a Python keyword argument "
                                    f"(pythonic tool-call format)")
        missing = sorted(set(schema.get("required", [])) - set(properties))
        if missing:
            return UnsupportedKeywordError(f"json schema keyword 'required' at # names {missing[0]!r}, which has no "
                                           f"schema under properties (pythonic tool-call format)", "required", "#")
        return None

    def rules(self, calls, lit: Markers) -> list[str]:
        for function in calls.functions:
            if not IDENTIFIER.fullmatch(function.name) or keyword.iskeyword(function.name):
                raise GrammarError(f"tool {function.name}: not a Python name (pythonic tool-call format)")
        start = 'tool_calls: "[" tc_calls "]"' if calls.required else 'tool_calls: TC_PLAIN | "[" tc_calls "]"'
        keywords = [rule for i, f in enumerate(calls.functions) for rule in _keywords(i, f.parameters)]
        return [start, self._calls(calls, '", "'), "tc_call: tc_fn",
                *self._functions(calls, lambda i, f: f'{_str(f.name + "(")} tc_a{i}_0 ")"'), *keywords, self._plain()]


def _keywords(i: int, schema: dict) -> list[str]:
    """Function i's keyword arguments: `tc_a{i}_{j}` writes properties j.. with none written
    before, `tc_b{i}_{j}` the same after some (each then after ", ")."""
    extra = sorted(set(schema) - KEYWORD_OBJECT)
    if extra:  # a rewrite that reached the object itself: never written loosely
        raise GrammarError(f"pythonic tool-call format: cannot write {extra} as keywords")
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    required = set(schema.get("required", []))
    rules, properties = [], [(k, v) for k, v in schema.get("properties", {}).items() if v is not False or k in required]
    for j, (name, sub) in enumerate(properties):
        if sub is False:
            raise GrammarError(f"pythonic tool-call format: required property {name!r} admits no value")
        value = f"{_str(name + '=')} {_json({**({} if sub is True else sub), **defs})}"
        after, skip = f"tc_b{i}_{j + 1}", "" if name in required else f" | tc_a{i}_{j + 1}"
        rules.append(f"tc_a{i}_{j}: {value} {after}{skip}")
        rules.append(f'tc_b{i}_{j}: ", " {value} {after}' + ("" if name in required else f" | {after}"))
    return [*rules, f'tc_a{i}_{len(properties)}: ""', f'tc_b{i}_{len(properties)}: ""']


FORMATS: dict[str, Format] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral(), MistralV11(), Pythonic())}
DETECT_ORDER = ("pythonic", "mistral", "llama3_json", "hermes")  # the most specific markers first


def template_text(chat_template) -> str:
    return "\n".join(chat_template.values()) if isinstance(chat_template, dict) else chat_template or ""


def resolve(requested: str, chat_template) -> str:
    """The format a request's calls take: `auto` from the markers in the chat template (Hermes
    when it has none: the form written for templates without tools), `mistral` in its v11 form
    where the template writes `[ARGS]`."""
    text = template_text(chat_template)
    if requested == "auto":
        requested = next((name for name in DETECT_ORDER if FORMATS[name].detect(text)), "hermes")
    if requested == "mistral" and ARGS in text:
        return "mistral_v11"
    return requested


def tool_format(name: str) -> Format:
    if name not in FORMATS:
        raise GrammarError(f"unknown tool-call format {name!r}; one of {sorted(FORMATS)}")
    return FORMATS[name]
