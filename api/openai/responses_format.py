"""Engine outputs -> the Responses API's objects: output items (`reasoning`, `message` with `output_text`,
`function_call`), the Response object with its status and usage, and the typed stream's events. The engine's
outputs are deltas; `ResponseOutput` accumulates them, `ResponseEvents` turns each into events as it comes.
Pure functions of the outputs; no engine access."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from loraplex.api.openai.openai_format import split_reasoning
from loraplex.grammar.tooling.tools import ToolCallParser, parse_tool_calls
from loraplex.platform.request import RequestOutput

INCOMPLETE = {"length": "max_output_tokens"}  # finish reasons that leave a response incomplete, and why


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseOutput:
    """One response's generation so far: text, reasoning, token counts and how it finished. Tokens count
    as reasoning until the content starts (as the chat endpoint bills them)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    undecided: int = 0  # tokens whose text is held back (a partial character, a marker)
    text: str = ""
    reasoning_text: str = ""
    finish_reason: str | None = None
    tool_format: str = "hermes"
    unenforced: tuple[str, ...] = ()

    def feed(self, delta: RequestOutput) -> None:
        self.prompt_tokens = len(delta.prompt_token_ids)
        self.cached_tokens = delta.num_cached_tokens
        self.unenforced = delta.unenforced or self.unenforced
        if delta.tool_call_format is not None:
            self.tool_format = delta.tool_call_format
        for o in delta.outputs:
            self.output_tokens += len(o.token_ids)
            self.text += o.text
            self.reasoning_text += o.reasoning_text
            self.finish_reason = o.finish_reason or self.finish_reason
            reasoning, self.undecided = split_reasoning(self.undecided, o)
            self.reasoning_tokens += reasoning

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason in INCOMPLETE else "completed"

    def usage(self) -> dict:
        return {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": self.prompt_tokens + self.output_tokens}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(out: ResponseOutput, tools: bool) -> list[dict]:
    """A whole output's items: its reasoning, its text as a message, its calls."""
    items = [reasoning_item(new_id("rs"), out.reasoning_text)] if out.reasoning_text else []
    status = "incomplete" if out.status == "incomplete" else "completed"
    if not tools:
        return [*items, message_item(new_id("msg"), out.text, status)]
    content, calls = parse_tool_calls(out.text, out.tool_format)
    if content is not None or not calls:
        items.append(message_item(new_id("msg"), content or "", status))
    return items + [call_item(new_id("fc"), c.id, c.name, c.arguments) for c in calls]


def output_text(items: list[dict]) -> str:
    """The SDK's `output_text`: every output_text part of the message items, joined."""
    return "".join(p["text"] for item in items if item["type"] == "message" for p in item["content"]
                   if p["type"] == "output_text")


@dataclass
class Envelope:
    """What a Response object repeats of its request."""

    id: str
    model: str
    request: dict  # instructions, max_output_tokens, temperature, top_p, tools, tool_choice, ...
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, items: list[dict], out: ResponseOutput | None = None) -> dict:
        incomplete = {"reason": INCOMPLETE[out.finish_reason]} if out is not None and status == "incomplete" else None
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": incomplete, "model": self.model, "output": items,
                "output_text": output_text(items), "usage": out.usage() if out is not None else None,
                **self.request}
        if out is not None and out.unenforced:
            body["unenforced_keywords"] = list(out.unenforced)
        return body


class ResponseEvents:
    """The typed stream's events for one response: created and in_progress first, then per delta the
    items' added / delta events (reasoning text, output text, function-call arguments), and at the end each
    open item's done events and `response.completed` (or `response.incomplete`). The concatenated deltas of
    each item equal its final text."""

    def __init__(self, envelope: Envelope, tools: bool) -> None:
        self.envelope, self.tools = envelope, tools
        self.out = ResponseOutput()
        self.items: list[dict] = []
        self.sequence = 0
        self._reasoning: dict | None = None
        self._message: dict | None = None
        self._calls: dict[int, dict] = {}  # parser's call index -> its item
        self._parser = ToolCallParser() if tools else None
        self._held = ""

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict]:
        created = self.envelope.response("in_progress", [])
        return [self.event("response.created", response=created),
                self.event("response.in_progress", response=created)]

    def feed(self, delta: RequestOutput) -> list[dict]:
        if self._parser is not None and delta.tool_call_format is not None and not self.out.text:
            self._parser = ToolCallParser(delta.tool_call_format)
        self.out.feed(delta)
        events: list[dict] = []
        for o in delta.outputs:
            if o.reasoning_text:
                events += self._reasoning_delta(o.reasoning_text)
            if o.text or (o.finish_reason and self._parser is not None):
                events += self._content(o.text, o.finish_reason is not None)
        return events

    def finish(self) -> list[dict]:
        events = self._close_reasoning()
        if self._message is None and not self._calls:
            events += self._open_message()
        events += self._close_message()
        for item in self._calls.values():
            events += self._close_call(item)
        status = self.out.status
        final = self.envelope.response(status, self.items, self.out)
        return events + [self.event(f"response.{status}", response=final)]

    # ---- items -----------------------------------------------------------------------------------

    def _open(self, item: dict) -> dict:
        self.items.append(item)
        return self.event("response.output_item.added", output_index=len(self.items) - 1,
                          item={**item, "content": []} if "content" in item else dict(item))

    def _index(self, item: dict) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)

    def _reasoning_delta(self, text: str) -> list[dict]:
        events = []
        if self._reasoning is None:
            self._reasoning = reasoning_item(new_id("rs"), "", "in_progress")
            self._reasoning["content"] = [{"type": "reasoning_text", "text": ""}]
            events.append(self._open(self._reasoning))
        self._reasoning["content"][0]["text"] += text
        return events + [self.event("response.reasoning_text.delta", item_id=self._reasoning["id"],
                                    output_index=self._index(self._reasoning), content_index=0, delta=text)]

    def _close_reasoning(self) -> list[dict]:
        item, self._reasoning = self._reasoning, None
        if item is None or item["status"] == "completed":
            return []
        item["status"] = "completed"
        index, text = self._index(item), item["content"][0]["text"]
        return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _content(self, text: str, final: bool) -> list[dict]:
        events = self._close_reasoning()
        if self._parser is None:
            return events + self._text_delta(text)
        content, calls = self._parser.feed(text, final=final)
        content, self._held = self._held + content, ""
        if self._message is None and not content.strip():
            self._held = content  # whitespace before or between calls is no message (as the whole answer reads it)
        elif content:
            events += self._text_delta(content)
        for call in calls:
            events += self._call_delta(call)
        return events

    def _open_message(self) -> list[dict]:
        self._message = message_item(new_id("msg"), None, "in_progress")
        index = len(self.items)
        return [self._open(self._message),
                self.event("response.content_part.added", item_id=self._message["id"], output_index=index,
                           content_index=0, part=text_part(""))]

    def _text_delta(self, text: str) -> list[dict]:
        events = self._open_message() if self._message is None else []
        item = self._message
        if not item["content"]:
            item["content"].append(text_part(""))
        item["content"][0]["text"] += text
        return events + [self.event("response.output_text.delta", item_id=item["id"], output_index=self._index(item),
                                    content_index=0, delta=text, logprobs=[])]

    def _close_message(self) -> list[dict]:
        item = self._message
        if item is None or item["status"] != "in_progress":
            return []
        if not item["content"]:
            item["content"].append(text_part(""))
        item["status"] = "incomplete" if self.out.status == "incomplete" else "completed"
        index, part = self._index(item), item["content"][0]
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _call_delta(self, call: dict) -> list[dict]:
        """A chat `tool_calls` delta entry (its index, then id and name once, arguments as they come)."""
        events = []
        item = self._calls.get(call["index"])
        function = call.get("function", {})
        if item is None:
            item = call_item(new_id("fc"), call.get("id") or new_id("call"), function.get("name", ""), "",
                             "in_progress")
            self._calls[call["index"]] = item
            events.append(self._open(item))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self._index(item), delta=function["arguments"]))
        return events

    def _close_call(self, item: dict) -> list[dict]:
        complete = {c.id for c in self._parser.calls if c.complete} if self._parser is not None else set()
        item["status"] = "completed" if item["call_id"] in complete else "incomplete"
        index = self._index(item)
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]
