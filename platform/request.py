"""Requests, sampling parameters and the outputs handed back to callers."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

import torch

from loraplex.grammar.backend import StructuredOutputs
from loraplex.grammar.tooling.reasoning import Reasoning


INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS = 64, 1024, 1024  # each step checks them all
MAX_LOGIT_BIAS = 1024  # token ids one request may bias
MAX_CACHE_SALT_CHARS = 1024
PRIORITY_MIN, PRIORITY_MAX = -2**31, 2**31 - 1  # what a user may give (vLLM's `priority`: lower runs earlier)
BATCH_PRIORITY = 2**31  # Batch API lines: less urgent than any user priority (the server sets it, never a user)


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives besides the sampled token
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt's tokens, with this many alternatives
    skip_special_tokens: bool = True
    structured: StructuredOutputs | None = None  # JSON Schema / json_object / regex / choice / EBNF
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> bias in [-100, 100], added to its logit
    include_stop_str_in_output: bool = False  # vLLM's: a matched stop string stays in the text
    # the output thinks first (--reasoning-parser): split into reasoning and content, `structured`
    # applied after the reasoning, its budget forced
    reasoning: Reasoning | None = None
    # vLLM's: enters the prefix cache's hashes, so only requests with the same salt (and the same
    # tenant namespace) share cached KV blocks; None adds nothing
    cache_salt: str | None = None
    # with --speculative-config: False keeps this request out of speculative decoding (no drafts verified)
    speculative: bool = True
    # vLLM's: lower is more urgent (--scheduling-policy priority; under fcfs only 0, or BATCH_PRIORITY)
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check()

    def _check(self) -> None:
        """Every field in range at submission, so nothing a request carries can raise inside an
        engine step (where it would fail the whole batch): integers are real ints within int64
        (bools refused), floats finite."""
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        def integer(name: str, lo: int, hi: int = INT64_MAX) -> None:
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi, name,
                 f"an integer in [{lo}, {hi}]")

        def real(name: str, ok, rule: str) -> None:
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                 and ok(value), name, f"a finite number {rule}")

        integer("n", 1, INT32_MAX)  # the engine's max_num_seqs bounds it at submission
        integer("max_tokens", 1)
        integer("min_tokens", 0, self.max_tokens)
        real("temperature", lambda v: v >= 0, ">= 0")
        real("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
        integer("top_k", -1, INT32_MAX)  # -1 or 0: off
        real("min_p", lambda v: 0 <= v <= 1, "in [0, 1]")
        real("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
        real("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
        real("repetition_penalty", lambda v: v > 0, "> 0")
        if self.seed is not None:
            integer("seed", INT64_MIN)
        need(all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in self.stop_token_ids),
             "stop_token_ids", "a list of token ids")
        need(all(isinstance(s, str) for s in self.stop), "stop", "a string or a list of strings")
        need(len(self.stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop), "stop",
             f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters")
        need(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        need(self.structured is None or isinstance(self.structured, StructuredOutputs), "structured",
             "a StructuredOutputs")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                       and 0 <= self.logprobs <= 20), "logprobs", "None or in [0, 20]")
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and not isinstance(
            self.prompt_logprobs, bool) and 0 <= self.prompt_logprobs <= 20), "prompt_logprobs", "None or in [0, 20]")
        need(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output", "a boolean")
        need(isinstance(self.speculative, bool), "speculative", "a boolean")
        priority = self.priority  # BATCH_PRIORITY too: the server's own, for Batch API lines
        need(isinstance(priority, int) and not isinstance(priority, bool) and (
            PRIORITY_MIN <= priority <= PRIORITY_MAX or priority == BATCH_PRIORITY), "priority",
             f"an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}]")
        need(self.reasoning is None or isinstance(self.reasoning, Reasoning), "reasoning", "a Reasoning")
        need(self.cache_salt is None or (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt)
                                         <= MAX_CACHE_SALT_CHARS), "cache_salt",
             f"None or a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
        bias = self.logit_bias or {}
        need(isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX
            and isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) and -100 <= b <= 100
            for t, b in bias.items()), "logit_bias", f"at most {MAX_LOGIT_BIAS} token ids, each to a bias in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    schema_violation: str | None = None  # a finished structured output its schema rejects (the backstop)
    reasoning_text: str = ""  # with a reasoning parser: the reasoning (`text` is then the content only)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    unenforced: tuple[str, ...] = ()  # schema keywords a non-strict request's grammar dropped
    # prompt_logprobs: per prompt token (None for the first, which nothing predicts); in the
    # request's first output only
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    tool_call_format: str | None = None  # the format tool calls are read in (the chat template's, under auto)
    queue_time_s: float | None = None  # arrival to first admission into the batch (once admitted)
    # the front end's wait for the request's grammar compile, (start, end) in seconds after arrival; None without one
    grammar_wait_s: tuple[float, float] | None = None


class Request:
    """One sequence being generated. A request with n > 1 is a group of sequences: the first
    prefills the prompt and the others fork from it, sharing its KV blocks."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, index: int = 0, extra_keys: tuple = (),
                 adapter: str | None = None, adapter_weights=None, compiled_grammar=None, mix=None,
                 tenant=None, tokenizer=None) -> None:
        self.request_id = request_id  # the group's id, shared by its n sequences
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.extra_keys = extra_keys  # salt for prefix-cache hashes (adapter content hash, grammar)
        self.adapter = adapter  # LoRA adapter name; None: the base model (or a mix)
        self.mix = mix  # an `AdapterMix` of two or more adapters (or one not at weight 1); None: `adapter` alone
        self.tenant = tenant  # a `TenantShare` (its name and weight in the batch's fair share); None: nobody's
        self.priority = params.priority  # lower is more urgent (the scheduler's order; forks inherit it)
        # prefetched by the input processor, handed to the registry's pin (a mix: one per adapter, in order)
        self.adapter_weights = adapter_weights
        self.tokenizer = tokenizer  # the adapter's own, where it brings one: its outputs decode with it; None: the base's
        self.compiled_grammar = compiled_grammar  # compiled spec, shared by the n sequences
        self.grammar = None  # this sequence's matcher
        self.output_token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        # filled as the prompt is computed; entry i is prompt token i's (the first has none)
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = \
            [None] if params.prompt_logprobs is not None and index == 0 else None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit on first admission
        self.arrival_time = time.monotonic()
        self.queue_time_s: float | None = None  # set on first admission
        self.queued_at_step: int | None = None  # the scheduler's step it was first queued at (its adapters' age)
        self.grammar_wait_s: tuple[float, float] | None = None  # set by the async front end (traces)
        self.pending_forks = params.n - 1 if index == 0 else 0
        self.stop_reason: str | int | None = None
        self.spec_token_ids: list[int] = []  # drafts computed (and verified) with its next token this step
        # --async-scheduling: tokens sampled on the device whose ids the host has not read yet (0 or 1); the
        # next step computes their position already, its input id gathered on the device
        self.num_pending = 0
        self.draft_state = None  # the drafter's: its n-gram index and recent acceptance (`speculative.py`)
        self.generator: torch.Generator | None = None
        if params.seed is not None:  # any int64 seed, any index: wraps into the generator's uint64 range
            self.generator = torch.Generator().manual_seed((params.seed + index) % 2**64)

    @property
    def cache_salt(self) -> tuple:
        """What keeps its prefix-cache blocks apart from other requests': its tenant's namespace (its
        own, or a group it shares with others) and its own `cache_salt`; empty for a request of nobody
        without a salt (the server-wide namespace)."""
        namespace = self.tenant.cache_namespace if self.tenant is not None else ""
        salt = self.params.cache_salt
        return ("salt", namespace, salt) if namespace or salt else ()

    def admit(self, extra_keys: tuple, grammar) -> None:
        """The engine took the request: its prefix-cache salt (the adapter's content hash) and
        its grammar matcher are set; the prefetched weights were handed to the registry."""
        self.extra_keys, self.grammar, self.adapter_weights = extra_keys, grammar, None

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The adapters it holds slots and pins of (a mix: each of them), for the scheduler and the engine."""
        if self.mix is not None:
            return self.mix.names
        return (self.adapter,) if self.adapter is not None else ()

    @property
    def seq_id(self) -> str:
        return f"{self.request_id}#{self.index}"

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, begin: int, end: int) -> list[int]:
        """all_token_ids[begin:end] without building the whole list (hot path)."""
        n = len(self.prompt_token_ids)
        if begin >= n:
            return self.output_token_ids[begin - n:end - n]
        return self.prompt_token_ids[begin:end] + self.output_token_ids[:max(0, end - n)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """The tokens a step may compute: the known ones and those sampled on the device not read back yet."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def ends_with_pending(self) -> bool:
        """Its pending token is its last (max_tokens): no step computes past it. (A max_model_len end is the
        scheduler's to see.)"""
        return self.num_pending > 0 and len(self.output_token_ids) + self.num_pending >= self.params.max_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def __repr__(self) -> str:
        return f"Request({self.seq_id}, {self.status.name}, computed={self.num_computed_tokens}/{self.num_tokens})"
