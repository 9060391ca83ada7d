"""The Responses API's request body (POST /v1/responses) and its translation into the chat request the
engine already serves: input items become chat messages, `text.format` becomes `response_format`, flat
function tools become chat tools. So adapters, mixes, structured outputs, tools and reasoning behave
exactly as through /v1/chat/completions, with the same checks and the same errors.

Every field the `openai` client sends is implemented, refused with a 400 naming it unless given its no-op
value (`REFUSED`), or taken without effect on purpose (`IGNORED`); tests/api/test_responses.py walks the
client's own parameter list."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from loraplex.api.openai.protocol import AdapterWeight, ChatCompletionRequest, OneOf, _Body, without_refused
from loraplex.api.openai.protocol import _arguments as chat_arguments

IGNORED = {"user": "an end-user id for OpenAI's abuse monitoring",
           "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
           "prompt_cache_key": "our prefix cache needs no key",
           "prompt_cache_retention": "our prefix cache has no retention setting",
           "service_tier": "one tier here", "stream_options": "no obfuscation padding is sent",
           "prompt_cache_options": "our prefix cache has no options",
           "truncation": "only \"disabled\": an input longer than the model's context is a 400"}
REFUSED = {"background": ("background responses are not supported (use the Batch API)", (False,)),
           "conversation": ("the Conversations API is not supported (use previous_response_id)", ()),
           "prompt": ("stored prompt templates are not supported", ()),
           "include": ("no extra output fields can be included", ([],)),
           "max_tool_calls": ("max_tool_calls is not supported (parallel_tool_calls: false allows one)", ()),
           "top_logprobs": ("logprobs are not supported on /v1/responses (use /v1/chat/completions)", (0,)),
           "context_management": ("context management is not supported", ()),
           "partial_images": ("image output is not supported", ()),
           "image": ("image output is not supported", ()),
           "moderation": ("moderation is not supported", ()),
           "access_programs": ("access programs are not supported", ())}
TRUNCATION = ("disabled", None)


class _Part(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # a replayed output_text part's (empty) extras
    logprobs: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in ("input_text", "output_text", "text", None):
            raise PydanticCustomError("refused_field", "{field}: {why}", {
                "field": "input.content.type", "why": f"content parts of type {data.get('type')!r} are not "
                                                     "supported (text only: input_text, output_text)"})
        return data


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[str | list[_Part], OneOf]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: Annotated[str | list[_Part], OneOf]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(_Body):
    """A reasoning item a client replays from an earlier output: taken, and left out of the next prompt (chat
    templates drop an earlier turn's reasoning)."""
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
         "reasoning": ReasoningItem}
Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


def parse_items(raw: list) -> list[Item]:
    """Each input item by its `type` (a message may leave it out); an unknown type is a 400 naming it."""
    items = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ValueError(f"input[{i}] must be an object (an input item)")
        kind = item.get("type", "message")
        if kind not in ITEMS:
            raise ValueError(f"input[{i}].type: items of type {kind!r} are not supported "
                             f"(one of {', '.join(ITEMS)})")
        try:
            items.append(ITEMS[kind].model_validate(item))
        except ValueError as exc:
            raise ValueError(f"input[{i}]: {_first_error(exc)}") from None
    return items


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    e = errors()[0]
    where = ".".join(str(p) for p in e.get("loc", ()))
    message = str(e.get("msg")).removeprefix("Value error, ")
    if e.get("type") == "extra_forbidden":
        message = "unknown field"
    return f"{where}: {message}" if where else message


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: Annotated[dict[str, Any] | bool | None, OneOf] = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None  # the models served have no verbosity setting: taken without effect


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            raise PydanticCustomError("refused_field", "{field}: {why}", {
                "field": "tools", "why": f"tools of type {data.get('type')!r} are not supported (function tools only)"})
        return data


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class ReasoningConfig(_Body):
    effort: str | None = None  # no model here takes an effort level
    summary: str | None = None  # no summaries are written: reasoning items carry the reasoning text
    generate_summary: str | None = None


class ResponsesRequest(_Body):
    model: str
    input: Annotated[str | list[Any], OneOf]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | FunctionChoice | None, OneOf] = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    stream: bool = False
    # ours and vLLM's, as on the other endpoints
    adapters: list[AdapterWeight] | None = None
    max_reasoning_tokens: int | None = None
    priority: int = Field(default=0, ge=-2**31, le=2**31 - 1)  # BATCH_PRIORITY, above it, is the server's own
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    cache_salt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # taken without effect (IGNORED)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    truncation: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        data = without_refused(data, REFUSED)
        if isinstance(data, dict) and data.get("truncation") not in TRUNCATION:
            raise PydanticCustomError("refused_field", "{field}: {why}", {
                "field": "truncation", "why": "only \"disabled\" is supported (an input longer than the context is "
                                              "a 400, never cut silently)"})
        return data

    def items(self) -> list[Item]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        if not self.input:
            raise ValueError("input must not be empty")
        return parse_items(self.input)

    def chat_request(self, messages: list[dict]) -> ChatCompletionRequest:
        """The chat request this turn is: `messages` (the conversation so far and this input, as chat messages
        with the instructions first) and this request's sampling, format and tools."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream,
                                "max_completion_tokens": self.max_output_tokens}
        for name in ("temperature", "top_p", "seed", "parallel_tool_calls", "max_reasoning_tokens", "top_k", "min_p",
                     "repetition_penalty", "presence_penalty", "frequency_penalty", "cache_salt",
                     "chat_template_kwargs", "priority"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.adapters is not None:
            body["adapters"] = [a.model_dump() for a in self.adapters]
        if self.text is not None and self.text.format is not None:
            body["response_format"] = _response_format(self.text.format)
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                             for t in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            body["tool_choice"] = choice if isinstance(choice, str) else \
                {"type": "function", "function": {"name": choice.name}}
        return ChatCompletionRequest.model_validate(body)


def _response_format(fmt: TextFormat) -> dict:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.schema_ is None:
        raise ValueError("text.format: a json_schema format needs its schema")
    schema = {"name": fmt.name or "response", "schema": fmt.schema_}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}


def chat_messages(items: list[Item]) -> list[dict]:
    """Input items as chat messages (HF's shape): consecutive function calls are one assistant message's
    tool calls, a call's output a tool message; replayed reasoning items are left out."""
    out: list[dict] = []
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _arguments(item.arguments, i)}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            elif out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def _arguments(text: str, i: int) -> str:
    """A call's arguments as given, once known to be a JSON object (the chat request takes them as text)."""
    chat_arguments(text, f"input[{i}]")
    return text
