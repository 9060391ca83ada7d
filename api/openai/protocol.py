"""OpenAI request bodies (pydantic, so /openapi.json describes them) and their translation into
the engine's `SamplingParams`.

Nothing a client sends is dropped without a word: every field is implemented, refused with a
400 naming it (`REFUSED`, and any field we do not know), or taken on purpose without effect
(`IGNORED`, listed in README). tests/api/test_fields.py walks OpenAI's own request schema."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, model_validator
from pydantic_core import PydanticCustomError

from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.grammar.tooling.reasoning import Reasoning
from loraplex.grammar.tooling.tools import Function, ToolCalls
from loraplex.platform.request import MAX_CACHE_SALT_CHARS, SamplingParams


MAX_PROMPTS = 128  # prompts in one completions request (each is queued as its own request)


class _Body(BaseModel):
    # an unknown field is a 400 naming it, not a silent drop; strict: a value of the wrong JSON type
    # is a 400 naming its field, never coerced ("2" is no integer, true no number, 1 no boolean);
    # a float field still takes a JSON integer, as OpenAI's own schema allows
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """JSON can carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer, log or response
        can encode: refuse them here, naming where."""
        _no_surrogates(data, "")
        return data


def _no_surrogates(value: Any, where: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where or 'a string'} is not valid Unicode (a lone surrogate)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _no_surrogates(key, where)
            _no_surrogates(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _no_surrogates(item, f"{where}[{i}]")


def _closest_member(value: Any, handler) -> Any:
    """A union field's refusal as its closest member's: pydantic reports every member's errors,
    each under the member's type name ("prompt.list[int].1"), which names no field of the request.
    The member with the fewest errors (then the deepest: the input had its shape) is the one meant;
    when no member took the input's shape, one error lists what each would have taken."""
    try:
        return handler(value)
    except ValidationError as exc:
        errors = exc.errors()
        if not all(e["loc"] for e in errors):  # not a member's: as it is
            raise
        members: dict = {}
        for error in errors:
            members.setdefault(error["loc"][0], []).append(error)
        meant = min(members.values(), key=lambda errors: (len(errors), -max(len(e["loc"]) for e in errors)))
        if all(len(e["loc"]) == 1 for e in meant):
            taken = dict.fromkeys(e["msg"].removeprefix("Input should be ") for m in members.values() for e in m
                                  if len(e["loc"]) == 1)
            raise PydanticCustomError("union_type", "Input should be {taken}", {"taken": " or ".join(taken)}) from None
        raise ValidationError.from_exception_data(exc.title, [_inside(e) for e in meant]) from None


def _inside(error: dict) -> dict:
    """`error` located inside its union member, without the member's name; its message as it was
    (a message template without placeholders is the message itself)."""
    kind = PydanticCustomError(error["type"], error["msg"], error.get("ctx"))
    return {"type": kind, "loc": error["loc"][1:], "input": error["input"]}


OneOf = WrapValidator(_closest_member)  # on every union field: its errors name it, not its members


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    name: str = "response"
    schema_: Annotated[dict[str, Any] | bool | None, OneOf] = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    json_: Annotated[dict[str, Any] | str | None, OneOf] = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    any_whitespace: bool = False
    strict: bool = True  # json: refuse what cannot be enforced exactly (false: drop it, and list it)


class AdapterWeight(_Body):
    """One adapter of a request's mix: y = W x + sum_i weight_i * (alpha_i / r_i) * B_i A_i x."""
    name: str
    weight: float = 1.0


# OpenAI fields taken on purpose without effect: bookkeeping for OpenAI's own platform, or knobs
# of models these are not (reasoning, verbosity).
IGNORED = {"user": "an end-user id for OpenAI's abuse monitoring", "metadata": "stored-completion tags",
           "store": "OpenAI's stored completions", "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
           "prompt_cache_key": "our prefix cache needs no key", "prompt_cache_retention": "our prefix cache has no "
           "retention setting", "prompt_cache_options": "our prefix cache has no options",
           "service_tier": "one tier here", "reasoning_effort": "no model here takes an effort level "
           "(max_reasoning_tokens bounds the reasoning under --reasoning-parser)",
           "verbosity": "the models served have no verbosity setting"}
# OpenAI fields not implemented: refused with a 400 naming them, unless given their no-op value
# (of its own type: true is not best_of's 1).
REFUSED = {"functions": ("the deprecated functions field is not supported (send tools)", ([],)),
           "function_call": ("the deprecated function_call field is not supported (send tool_choice)", ("none",)),
           "audio": ("audio output is not supported", ()),
           "modalities": ("only text output is supported", (["text"],)),
           "prediction": ("predicted outputs are not supported", ()),
           "web_search_options": ("web search is not supported", ()),
           "moderation": ("moderation is not supported", ()),
           "best_of": ("best_of is not supported (use n)", (1,)),
           "suffix": ("suffix (insertion) is not supported", ("",))}


def _no_op(value: Any, no_ops: tuple) -> bool:
    return any(type(value) is type(no_op) and value == no_op for no_op in no_ops)


def without_refused(data: Any, refused: dict) -> Any:
    """A body's refused fields: a 400 naming the first given a value other than its no-op; the no-ops dropped."""
    if not isinstance(data, dict):
        return data
    for name, (why, no_ops) in refused.items():
        if name in data and data[name] is not None and not _no_op(data[name], no_ops):
            raise PydanticCustomError("refused_field", "{field}: {why}", {"field": name, "why": why})
    return {k: v for k, v in data.items() if k not in refused}  # what is left is a no-op


class _SamplingFields(_Body):
    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Annotated[str | list[str] | None, OneOf] = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's: a matched stop string stays in the text
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    # vLLM's older names for the same thing
    guided_json: Annotated[dict[str, Any] | str | None, OneOf] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt's tokens (and this many alternatives)
    adapters: list[AdapterWeight] | None = None  # ours: adapters mixed with weights on the base model (`model`)
    # vLLM's: enters the prefix cache's hashes, so only requests with the same salt share cached blocks
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # ours: false keeps this request out of speculative decoding (a server with --speculative-config)
    speculative: bool = True
    # vLLM's: lower runs sooner (--scheduling-policy priority; under fcfs only 0); a tenant's orders its own work
    priority: int = Field(default=0, ge=-2**31, le=2**31 - 1)  # BATCH_PRIORITY, above it, is the server's own
    # taken and ignored (IGNORED); refused unless a no-op value (REFUSED)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        return without_refused(data, REFUSED)

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        tool_format: str = "hermes", reasoning_parser: str | None = None) -> SamplingParams:
        """Raises ValueError naming the field for out-of-range values. `tool_format` and
        `reasoning_parser`: the server's (chat only)."""
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                                "frequency_penalty", "repetition_penalty")
                 if getattr(self, k) is not None}
        return SamplingParams(n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed,
                              stop=self.stop, stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
                              logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                              structured=self.structured(tool_format), logit_bias=self._logit_bias(),
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              prompt_logprobs=prompt_logprobs, reasoning=self.reasoning(reasoning_parser),
                              cache_salt=self.cache_salt, speculative=self.speculative, priority=self.priority,
                              **given)

    def adapter_weights(self) -> list[tuple[str, float]] | None:
        """`adapters` as (name, weight) pairs, None when the request names no mix."""
        return None if self.adapters is None else [(a.name, a.weight) for a in self.adapters]

    def reasoning(self, parser: str | None) -> Reasoning | None:
        return None

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI sends token ids as JSON object keys, so strings: of decimal digits only (int()
        would also read " 7", "7_0" and other scripts' digits)."""
        if not self.logit_bias:
            return None
        if not all(token.isascii() and token.isdigit() for token in self.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids, got {list(self.logit_bias)[:3]}")
        return {int(token): bias for token, bias in self.logit_bias.items()}

    def structured(self, tool_format: str = "hermes") -> StructuredOutputs | None:
        specs = []
        if self.response_format is not None and self.response_format.type != "text":
            if self.response_format.type == "json_object":
                specs.append(StructuredOutputs(json_object=True))
            else:
                fmt = self.response_format.json_schema
                if fmt is None or fmt.schema_ is None:
                    raise ValueError("response_format json_schema needs json_schema.schema")
                specs.append(StructuredOutputs(json=fmt.schema_, strict=fmt.strict is not False,
                                               openai_strict=fmt.strict is True))
        if self.structured_outputs is not None:
            body = self.structured_outputs
            specs.append(StructuredOutputs(json=body.json_, json_object=bool(body.json_object), regex=body.regex,
                                           choice=body.choice, grammar=body.grammar,
                                           any_whitespace=body.any_whitespace, strict=body.strict))
        legacy = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        specs += [StructuredOutputs(**{k: v}) for k, v in legacy.items() if v is not None]
        if len(specs) > 1:
            raise ValueError("give one of response_format, structured_outputs or guided_*, not several")
        return specs[0] if specs else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], OneOf]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def num_prompt_logprobs(self) -> int | None:
        """vLLM's `prompt_logprobs`; OpenAI's `echo` with `logprobs` needs them too."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | dict]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if len(p) > MAX_PROMPTS and not all(isinstance(x, int) for x in p):
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(p)}")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": p}]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) for x in p):
            return [{"prompt_token_ids": x} for x in p]
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of those")


MESSAGE_EXTRAS = {"refusal", "annotations", "audio", "function_call"}
MESSAGE_EXTRAS_WHY = "audio, refusals and the deprecated function_call in messages are not supported"


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


class ToolCallMessage(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Annotated[str | list[TextPart] | None, OneOf] = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="before")
    @classmethod
    def _empty_extras(cls, data: Any) -> Any:
        """A client replaying an assistant message sends its empty extras (`refusal: null`,
        `audio: null`, ...): taken as the no-ops they are; a non-empty one is refused."""
        if not isinstance(data, dict):
            return data
        for key in MESSAGE_EXTRAS & data.keys():
            if data[key] not in (None, [], ""):
                raise PydanticCustomError("refused_field", "{field}: {why}",
                                          {"field": f"messages.{key}", "why": MESSAGE_EXTRAS_WHY})
        return {k: v for k, v in data.items() if k not in MESSAGE_EXTRAS}

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the call it answers)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


def chat_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as chat templates take them (HF's shape: a call's arguments as an object);
    "developer" is OpenAI's newer name for "system"."""
    out = []
    for i, m in enumerate(messages):
        d: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name,
                                             "arguments": _arguments(c.function.arguments, f"messages[{i}]")}}
                               for c in m.tool_calls]
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
        if m.name and m.role == "tool":
            d["name"] = m.name
        out.append(d)
    return out


def _arguments(text: str, where: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"{where}.tool_calls: function.arguments must be a JSON object, got {text[:80]!r}")
    return value


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema of the arguments; none: no arguments
    strict: bool | None = None  # false: what cannot be enforced is dropped and listed (default: refused)


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
    tools: list[Tool] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None, OneOf] = None
    parallel_tool_calls: bool | None = None
    max_reasoning_tokens: int | None = None  # ours: the reasoning's budget, then its close tag is forced

    def chat_messages(self) -> list[dict]:
        return chat_dicts(self.messages)

    def _tool_choice(self) -> str | NamedToolChoice:
        choice = self.tool_choice if self.tool_choice is not None else "auto" if self.tools else "none"
        if choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        return choice

    def prompt_tools(self) -> list[dict] | None:
        """The tools the chat template is given (none under tool_choice "none", as vLLM's
        --exclude-tools-when-tool-choice-none: a model told of tools it may not call calls them)."""
        if self._tool_choice() == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_calls(self, format: str = "hermes") -> ToolCalls | None:
        """The calls the grammar allows, in `format`: `required` / a named function constrain
        the whole output, `auto` the call once the model starts one."""
        choice = self._tool_choice()
        if choice == "none":
            return None
        functions = []
        for t in self.tools:
            f = t.function
            try:
                given = {"parameters": f.parameters} if f.parameters is not None else {}
                functions.append(Function(f.name, strict=f.strict is not False, openai_strict=f.strict is True,
                                          **given))
            except GrammarError as exc:
                raise ValueError(str(exc)) from None
        parallel = self.parallel_tool_calls is not False
        if isinstance(choice, NamedToolChoice):
            named = [f for f in functions if f.name == choice.function.name]
            if not named:
                raise ValueError(f"tool_choice names {choice.function.name!r}, which is not one of the tools "
                                 f"({[f.name for f in functions]})")
            return ToolCalls(tuple(named), required=True, parallel=False, format=format)
        try:
            return ToolCalls(tuple(functions), required=choice == "required", parallel=parallel, format=format)
        except GrammarError as exc:
            raise ValueError(str(exc)) from None

    def structured(self, tool_format: str = "hermes") -> StructuredOutputs | None:
        calls = self.tool_calls(tool_format)
        spec = super().structured()
        if calls is None:
            return spec
        if spec is not None:
            raise ValueError("response_format / structured_outputs cannot be combined with tools "
                             "unless tool_choice is \"none\"")
        return StructuredOutputs(tools=calls)

    def reasoning(self, parser: str | None) -> Reasoning | None:
        """The server's reasoning parser, with this request's budget."""
        if parser is None:
            if self.max_reasoning_tokens is not None:
                raise ValueError("max_reasoning_tokens needs a reasoning parser (loraplex serve --reasoning-parser)")
            return None
        return Reasoning(parser, self.max_reasoning_tokens)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None  # rendered as a chat completion would render them
    chat_template_kwargs: dict[str, Any] | None = None

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class ValidateSchemaRequest(_Body):
    schema_: Annotated[dict[str, Any] | bool, OneOf] = Field(alias="schema")
    strict: bool = True

    def structured(self) -> StructuredOutputs:
        return StructuredOutputs(json=self.schema_, strict=self.strict)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class LoadAdapterRequest(_Body):
    lora_name: str
    lora_path: str


class UnloadAdapterRequest(_Body):
    lora_name: str
