"""The engine as a server sees it: `EngineClient` (modeled on vLLM's), the values and errors it
speaks in, and `build_engine_client`, which builds one from an `EngineConfig`.

The API imports this module, never the engine's: everything it may ask of the engine is a
method here (generate, abort, tokenize, compile-check a structured spec, adapters, stats,
health), so the input processor, registry and grammar manager can change behind it. The value
types and error classes the methods take, return and raise are re-exported here for the same
reason: the API names them without importing the modules that own them.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol, runtime_checkable

from loraplex.adapters.peft_format import AdapterError
from loraplex.adapters.registry import AdapterInfo, AdapterInUseError, AdapterStatus, UnknownAdapterError
from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.platform.adapter_mix import AdapterMix, parse_mix
from loraplex.platform.config import EngineConfig
from loraplex.platform.core.fair_share import TenantShare
from loraplex.platform.core.engine_core import EngineStats
from loraplex.platform.engine.values import (ClientTooSlowError, EngineDeadError, Health, QueueFullError,
                                             StepFailedError, StructuredCheck)
from loraplex.platform.engine.output_processor import accumulate
from loraplex.platform.request import RequestOutput, SamplingParams

__all__ = ["AdapterError", "AdapterInfo", "AdapterMix", "AdapterInUseError", "AdapterStatus", "ClientTooSlowError",
           "EngineClient", "EngineDeadError", "EngineStats", "GrammarError", "Health", "QueueFullError",
           "StepFailedError", "StructuredCheck", "TenantShare", "UnknownAdapterError", "accumulate",
           "build_engine_client", "parse_mix", "read_adapter_info"]


@runtime_checkable
class EngineClient(Protocol):
    """What a server may ask of the engine. A ValueError (GrammarError and AdapterError among
    them) is always the caller's input's fault; the other errors are the classes above."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_adapters_per_request(self) -> int: ...

    def generate_many(self, prompts: list, params: list[SamplingParams], request_ids: list[str | None],
                      adapter: str | AdapterMix | None = None,
                      tenant: TenantShare | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta output) for the prompts of one call until all finish; leaving
        early aborts what still runs. Validation (ValueError) happens before anything is queued.
        `adapter`: None (the base model), a name, or a mix of adapters with weights; `tenant`: whose
        requests they are, for the batch's fair share."""

    def abort(self, request_id: str) -> None: ...

    async def tokenize(self, text: str, add_special_tokens: bool = True, adapter: str | None = None) -> list[int]:
        """`adapter`: a request on it uses its own tokenizer where it brings one."""

    async def tokenize_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
                            adapter: str | None = None) -> list[int]:
        """A conversation through the model's chat template (tools rendered, or described); `adapter`'s tokenizer
        and template where it brings its own."""

    async def detokenize(self, ids: list[int], param: str = "tokens", adapter: str | None = None) -> str:
        """ValueError naming `param` for ids outside the vocabulary."""

    def default_max_tokens(self, prompt_ids: list[int]) -> int: ...

    async def validate_structured(self, spec: StructuredOutputs, tenant: TenantShare | None = None) -> StructuredCheck:
        """Compile `spec` as a request of `tenant` would (GrammarError naming what is refused)."""

    async def load_adapter(self, name: str, path: str, confined: bool = False) -> AdapterInfo: ...

    def unload_adapter(self, name: str) -> None:
        """UnknownAdapterError, or AdapterInUseError while requests hold it."""

    def list_adapters(self) -> list[AdapterInfo]: ...

    def adapter_status(self) -> dict[str, AdapterStatus]: ...

    def stats(self) -> EngineStats: ...

    def health(self) -> Health:
        """Liveness (`problem`) and readiness (`warming`: what is still starting)."""

    def fail_all(self, reason: str) -> None:
        """Take no more requests; end every one in flight with EngineDeadError(reason)."""

    def shutdown(self, timeout: float = 10.0) -> None: ...


def build_engine_client(config: EngineConfig, max_waiting_requests: int | None = None,
                        lora_modules: tuple[tuple[str, str], ...] = ()) -> EngineClient:
    """The engine for `config` on its own thread, with `lora_modules` (name, path) loaded first
    (a bad folder fails here, before anything is served)."""
    from loraplex.platform.engine.async_engine import AsyncEngine
    from loraplex.platform.engine.llm_engine import Engine

    engine = Engine(config)
    engine.grammars.warm_up()  # in the background, while the adapters load: ready means ready
    for name, path in lora_modules:
        engine.adapters.load(name, str(path))
    return AsyncEngine(engine, max_waiting_requests=max_waiting_requests)


def read_adapter_info(model: str, max_lora_rank: int, name: str, path: str) -> AdapterInfo:
    """A PEFT folder checked against `model` and described (rank, targets, content hash) without
    an engine: what a cluster lists before any replica has read it."""
    import torch

    from loraplex.adapters.registry import AdapterRegistry
    from loraplex.platform.models.registry import read_model_config

    registry = AdapterRegistry(read_model_config(model), 1, max_lora_rank, None, torch.float32, lora_memory=0)
    return registry.load(name, path)
