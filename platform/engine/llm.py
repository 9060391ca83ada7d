"""`LLM`: the offline, vLLM-shaped front of the engine."""

from __future__ import annotations

import itertools
import json
from dataclasses import fields

from loraplex.platform.adapter_mix import AdapterMix
from loraplex.platform.config import EngineConfig
from loraplex.platform.engine.llm_engine import Engine
from loraplex.platform.engine.output_processor import accumulate
from loraplex.platform.request import RequestOutput, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, lora_modules: dict[str, str] | None = None, **engine_args) -> None:
        known = {f.name for f in fields(EngineConfig)} - {"model"}
        unknown = set(engine_args) - known
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}; known: {sorted(known)}")
        if isinstance(engine_args.get("speculative_config"), dict):  # vLLM's LLM takes a dict
            engine_args["speculative_config"] = json.dumps(engine_args["speculative_config"])
        if model is None:
            from loraplex.platform.model_store import materialize_default_model

            model = str(materialize_default_model())
        self.engine = Engine(EngineConfig(model=str(model), **engine_args))
        self._ids = itertools.count()
        for name, path in (lora_modules or {}).items():
            self.load_adapter(name, path)

    def close(self) -> None:
        """Stop what the engine started outside this process (tensor parallelism's workers); also on `with`'s exit
        and, failing both, when the engine is collected or the interpreter exits."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def load_adapter(self, name: str, path: str, replace: bool = False):
        """Register a PEFT LoRA folder under `name`; refused with a ValueError naming the reason."""
        return self.engine.adapters.load(name, str(path), replace=replace)

    def unload_adapter(self, name: str) -> None:
        self.engine.adapters.unload(name)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None,
             adapter: str | list[str | None] | None = None, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of OpenAI-style message dicts) or a list of
        them, through the chat template; `tools` (OpenAI's shape) are rendered into the prompt
        (grammar/tooling/tools.py). To constrain the output to calls, give `params` a
        `StructuredOutputs(tools=ToolCalls(...))`; `parse_tool_calls` reads them back."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        adapters = adapter if isinstance(adapter, list) else [adapter] * len(conversations)
        if len(adapters) != len(conversations):
            raise ValueError(f"got {len(adapters)} adapters for {len(conversations)} conversations")
        prompts = [{"prompt_token_ids": self.engine.inputs.chat_token_ids(  # an adapter's own tokenizer where it has one
            [_template_message(m) for m in conversation], add_generation_prompt, chat_template_kwargs, tools,
            name if isinstance(name, str) else None)} for conversation, name in zip(conversations, adapters)]
        return self.generate(prompts, params, adapter)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 adapter: str | AdapterMix | dict | list | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. `adapter`: one for all prompts or a list of one per
        prompt, each a name, None (the base model) or a mix of adapters: an `AdapterMix`, a dict
        name -> weight, or (per prompt only, since a list stands for the prompts) a list of
        (name, weight) pairs. Invalid input raises ValueError before any request is queued."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        adapters = adapter if isinstance(adapter, list) else [adapter] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"got {len(adapters)} adapters for {len(prompts)} prompts")
        requests = [self.engine.inputs.process(f"llm-{next(self._ids)}", p, sp, a)
                    for p, sp, a in zip(prompts, per_prompt, adapters)]
        for req in requests:
            self.engine.add(req)
        totals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():  # deltas: added up per request
                totals[out.request_id] = accumulate(totals.get(out.request_id), out)
        return [totals[r.request_id] for r in requests]


def _template_message(message: dict) -> dict:
    """OpenAI sends a call's arguments as a JSON string; chat templates take an object."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])
                           if isinstance(c["function"]["arguments"], str) else c["function"]["arguments"]}}
        for c in calls]}
