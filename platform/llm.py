"""`LLM`: the offline, vLLM-shaped front of the engine."""

from __future__ import annotations

import itertools
from dataclasses import fields

from loraplex.platform.config import EngineConfig
from loraplex.platform.engine import Engine
from loraplex.platform.request import RequestOutput, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        known = {f.name for f in fields(EngineConfig)} - {"model"}
        unknown = set(engine_args) - known
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}; known: {sorted(known)}")
        if model is None:
            from loraplex.platform.model_store import materialize_default_model

            model = str(materialize_default_model())
        self.engine = Engine(EngineConfig(model=str(model), **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Invalid input raises ValueError before any
        request is queued."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        requests = [self.engine.make_request(f"llm-{next(self._ids)}", p, sp) for p, sp in zip(prompts, per_prompt)]
        for req in requests:
            self.engine.add(req)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r.request_id] for r in requests]
