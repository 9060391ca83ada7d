"""Prompt -> validated `Request`, in the caller's thread (vLLM V1's input processor).

Everything slow or fallible about a request happens here, before the engine sees it: the
chat template and tokenizing, the default `max_tokens`, the vocabulary and capacity checks,
reading the adapter's weights from disk (prefetch) and compiling its grammar. What depends on the
model is settled here too: the tool-call format under `auto` (from the chat template) and where
a reasoning output starts (from the prompt's end). A failure is a `ValueError` naming the field
and the limit. It reads only immutable engine facts, so any thread may call it; the server calls
it off the event loop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loraplex.adapters.registry import AdapterRegistry
from loraplex.grammar.backend import StructuredOutputs
from loraplex.grammar.manager import GrammarManager
from loraplex.grammar.tooling.reasoning import prompt_start
from loraplex.grammar.tooling.tools import plain_messages, resolve, template_takes_tools
from loraplex.platform.adapter_mix import AdapterMix, parse_mix
from loraplex.platform.core.fair_share import TenantShare
from loraplex.platform.core.kv_cache_manager import cdiv
from loraplex.platform.request import BATCH_PRIORITY, Request, SamplingParams


PROMPT_TAIL_TOKENS = 8  # the prompt's last tokens, read for an open or closed reasoning tag


@dataclass(frozen=True)
class Limits:
    """What a request must fit: the engine's sizes, fixed at start-up."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_kv_blocks: int
    max_adapters_per_request: int = 8  # adapters in one mix
    max_loras: int = 8  # distinct adapters in a batch: a mix of more could never run
    scheduling_policy: str = "fcfs"  # under fcfs a request's priority is 0 (or the server's BATCH_PRIORITY)

    @property
    def token_capacity(self) -> int:
        """Tokens one sequence can hold: the context limit or the whole KV pool, whichever is less."""
        return min(self.max_model_len, self.num_kv_blocks * self.block_size)


# what takes one adapter per token, or has no meaning as a weighted sum (DoRA rescales by its own norm)
_UNMIXABLE = ((lambda w: w.tokenizer is not None, "brings a tokenizer of its own"),
              (lambda w: w.embedding is not None or w.head is not None or w.replacements or w.tokens,
               "adapts embed_tokens / lm_head"),
              (lambda w: w.moe, "adapts a mixture-of-experts layer (router, experts)"),
              (lambda w: w.norms, "brings norms of its own (modules_to_save)"),
              (lambda w: any(t.replacement is not None for t in w.terms.values()),
               "brings projections or biases of its own (modules_to_save, bias)"),
              (lambda w: w.dora, "is a DoRA adapter (a weight other than 1 too)"))


class InputProcessor:
    def __init__(self, tokenizer, limits: Limits, adapters: AdapterRegistry, grammars: GrammarManager) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.adapters = adapters
        self.grammars = grammars

    # ---- text <-> token ids -------------------------------------------------------------------

    def tokenizer_for(self, adapter: str | None):
        """The tokenizer of a request on `adapter` (a name; None: the base model): the adapter's own where it
        brings one (adapters/tokenizer_overlay.py), else the base model's."""
        if adapter is None:
            return self.tokenizer
        return self.adapters.prefetch(adapter).tokenizer or self.tokenizer

    def chat_token_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                       template_kwargs: dict | None = None, tools: list[dict] | None = None,
                       adapter: str | None = None) -> list[int]:
        """`template_kwargs`: extra variables for the chat template (vLLM's `chat_template_kwargs`,
        e.g. `enable_thinking`); they cannot override what the template is given already.
        `tools` (OpenAI's shape) go to a template that renders them; for one that does not, they
        are described in the system message and tool turns written out (grammar/tooling/tools.py).
        `adapter`: the adapter whose tokenizer (and template) the prompt is for."""
        tokenizer = self.tokenizer_for(adapter)
        extra = dict(template_kwargs or {})
        clash = sorted(extra.keys() & {"messages", "tokenize", "add_generation_prompt", "conversation", "tools",
                                        "chat_template", "documents", "return_dict", "continue_final_message"})
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {clash}")
        uses_tools = tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        if uses_tools and template_takes_tools(tokenizer.chat_template):
            extra["tools"] = tools
        elif uses_tools:
            messages = plain_messages(messages, tools)
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **extra)
        except Exception as exc:  # a template's own raise_exception(): the conversation's fault
            raise ValueError(f"the chat template refused these messages: {exc}") from None
        return tokenizer(text, add_special_tokens=False).input_ids

    def token_ids(self, text: str, add_special_tokens: bool = True, adapter: str | None = None) -> list[int]:
        return self.tokenizer_for(adapter)(text, add_special_tokens=add_special_tokens).input_ids

    def detokenize(self, ids: list[int], param: str, adapter: str | None = None) -> str:
        self.check_token_ids(ids, param)
        return self.tokenizer_for(adapter).decode(ids)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.limits.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{param} must be integers in [0, {vocab}); got {bad[:3]}")

    def default_max_tokens(self, prompt_ids: list[int]) -> int:
        return max(1, self.limits.token_capacity - len(prompt_ids))

    # ---- requests -------------------------------------------------------------------------------

    def process(self, request_id: str, prompt: str | dict | list[int], params: SamplingParams,
                adapter: str | AdapterMix | dict | list | None = None, tenant: TenantShare | None = None,
                compile: bool = True) -> Request:
        """Tokenize and validate; raises ValueError naming the field and the limit (an unknown
        adapter too). `adapter`: a name, None (the base model) or a mix (`AdapterMix`, a dict name ->
        weight or a list of (name, weight) pairs). The adapters' weights are read here if the LRU
        dropped them, and the grammar compiled here, never on the engine thread (`compile=False`:
        the caller compiles `grammar_spec` itself, awaiting it without holding a thread)."""
        adapter, mix = self._adapter_or_mix(adapter)
        if mix is not None:
            weights = tuple(self._mixable(name, f"{mix.field}[{i}].name") for i, name in enumerate(mix.names))
        else:
            weights = self.adapters.prefetch(adapter) if adapter is not None else None
        text = None
        tokenizer = getattr(weights, "tokenizer", None) or self.tokenizer  # a mix holds no adapter's own
        if isinstance(prompt, str):
            text, ids = prompt, tokenizer(prompt).input_ids
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
        elif isinstance(prompt, list):
            ids = prompt
        else:
            raise ValueError("prompt must be a string or {'prompt_token_ids': [...]}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        self._check(ids, params)
        params = self._for_this_model(params, ids, tokenizer)
        spec = self._grammar_spec(params)
        compiled = self.grammars.compile(spec) if spec is not None and compile else None
        request = Request(request_id, ids, params, prompt=text, adapter=adapter, adapter_weights=weights,
                          compiled_grammar=compiled, mix=mix, tenant=tenant,
                          tokenizer=None if tokenizer is self.tokenizer else tokenizer)
        self.check_budget(request)
        return request

    def check_budget(self, request: Request) -> None:
        """A guarded output (grammar/budget.py) whose shortest answer cannot fit in max_tokens is refused before
        it runs: it could only end cut off. (max_tokens never exceeds what max_model_len leaves: `_check`.)"""
        compiled = request.compiled_grammar
        need = self.grammars.shortest(compiled) if compiled is not None else None
        if need is not None and need > request.params.max_tokens:
            raise ValueError(f"max_tokens={request.params.max_tokens} is too few for this {compiled.spec.kind}: its "
                             f"shortest valid answer takes {need} tokens (raise max_tokens; a server started with "
                             f"--no-finish-within-budget would cut the answer off instead)")

    def grammar_spec(self, request: Request) -> StructuredOutputs | None:
        """The spec the request's grammar compiles (after its reasoning, if any); None without one."""
        return self._grammar_spec(request.params)

    def _adapter_or_mix(self, spec) -> tuple[str | None, AdapterMix | None]:
        """(name, None) for one adapter at weight 1 (the plain path), (None, mix) for a mix; the mix
        validated against `max_adapters_per_request` and `max_loras`."""
        if spec is None or isinstance(spec, str):
            return spec, None
        mix = parse_mix(spec, self.limits.max_adapters_per_request)
        if len(mix.entries) > self.limits.max_loras:
            raise ValueError(f"{mix.field}: a mix of {len(mix.entries)} adapters needs as many slots, "
                             f"max_loras is {self.limits.max_loras}")
        if mix.plain is not None:
            return mix.plain, None
        return None, mix

    def _mixable(self, name: str, field: str):
        """An adapter of a mix, prefetched; one whose effect is not a delta that weights add up is refused."""
        weights = self.adapters.prefetch(name)
        why = next((reason for test, reason in _UNMIXABLE if test(weights)), None)
        if why is not None:
            raise ValueError(f"{field}: {name!r} {why}, which a mix cannot combine; name it alone")
        return weights

    def _for_this_model(self, params: SamplingParams, ids: list[int], tokenizer) -> SamplingParams:
        """`params` with the tool-call format read from the chat template (`auto`, mistral's
        form), the reasoning's start read from the prompt's end, and the end token of an adapter's own tokenizer."""
        changes = {}
        spec = params.structured
        if spec is not None and spec.kind == "tools":
            format = resolve(spec.tools.format, tokenizer.chat_template)
            if format != spec.tools.format:
                changes["structured"] = dataclasses.replace(spec, tools=dataclasses.replace(spec.tools, format=format))
        if params.reasoning is not None:
            tail = tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
            changes["reasoning"] = dataclasses.replace(params.reasoning, start=prompt_start(tail))
        eos = tokenizer.eos_token_id  # an adapter's own end token (its tokenizer's) ends its outputs too
        if eos is not None and eos != self.tokenizer.eos_token_id and not params.ignore_eos \
                and eos not in params.stop_token_ids:
            changes["stop_token_ids"] = [*params.stop_token_ids, eos]
        return dataclasses.replace(params, **changes) if changes else params

    @staticmethod
    def _grammar_spec(params: SamplingParams) -> StructuredOutputs | None:
        """What the grammar holds the output to: the request's spec, after the reasoning where the
        output may reason (a budget alone makes a grammar of its own: free text after it)."""
        reasoning, spec = params.reasoning, params.structured
        if reasoning is None or not reasoning.active or (spec is None and reasoning.max_tokens is None):
            return spec
        if spec is None:
            return StructuredOutputs(reasoning=reasoning)
        return dataclasses.replace(spec, reasoning=reasoning)

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        lim = self.limits
        if lim.scheduling_policy == "fcfs" and params.priority not in (0, BATCH_PRIORITY):
            raise ValueError(f"priority={params.priority} needs a server started with --scheduling-policy priority "
                             "(this one schedules fcfs: priority must be 0)")
        if params.n > lim.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={lim.max_num_seqs}")
        if len(ids) == 0:
            raise ValueError("prompt must not be empty (0 tokens)")
        self.check_token_ids(ids, "prompt_token_ids")
        if len(ids) > lim.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, longer than max_model_len={lim.max_model_len}")
        if len(ids) + params.max_tokens > lim.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} plus the prompt's {len(ids)} tokens exceeds "
                             f"max_model_len={lim.max_model_len}")
        need = cdiv(len(ids) + params.max_tokens, lim.block_size)
        if need > lim.num_kv_blocks:
            raise ValueError(f"prompt + max_tokens needs {need} KV blocks, the cache has "
                             f"{lim.num_kv_blocks} (num_kv_blocks)")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < lim.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids must be in [0, {lim.vocab_size}); got {bad_stop[:3]}")
        bad_bias = [t for t in params.logit_bias or {} if not 0 <= t < lim.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias token ids must be in [0, {lim.vocab_size}); got {bad_bias[:3]}")
