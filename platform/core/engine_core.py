"""The engine core: one step is schedule -> adapter slots -> the executor runs the batch -> sample (or verify
drafts) -> `Scheduler.update`, O(new tokens), then the next drafts. It takes validated `Request`s and returns
per-sequence deltas (`SeqDelta`): tokenizing, detokenizing and stop strings belong to the front ends
(`platform/engine/`), which talk to it only through values: `add`, `abort`, `step`, `stop`, `stats` and the
queries beside them (`has_unfinished`, `unfinished_request_ids`, `abort_running`, `close`).

It never asks how many ranks run the model: the executor (`platform/executor/`) answers the same calls for one or
several. Single-threaded by design: a front end runs it on one thread.

With --async-scheduling (`_step_ahead`) a step whose sequences are all `Sampler.plain` leaves its sampled ids on
the device (`InFlight`): the next step is scheduled, built and launched with those ids gathered on the device,
and only then are they read and appended, so the host's work hides behind the device's. A sequence that the
landed token ends has one more position computed, which is dropped. Any other step samples in order.
"""

from __future__ import annotations

import logging
from itertools import islice
from dataclasses import dataclass, field

import torch

from loraplex.adapters.prefetch import Prefetcher
from loraplex.adapters.registry import AdapterRegistry
from loraplex.grammar.manager import GrammarManager
from loraplex.kernels.dispatch import to_device
from loraplex.platform.core.in_flight import InFlight
from loraplex.platform.core.input_batch import InputBatch, PromptRows
from loraplex.platform.core.kv_cache_manager import KVCacheManager, reclaim_window
from loraplex.platform.core.scheduler import Scheduler, SeqDelta
from loraplex.platform.executor.abstract import Executor
from loraplex.platform.request import Request
from loraplex.platform.resolve import ResolvedConfig
from loraplex.platform.sample.sampler import Sampler, prompt_logprobs
from loraplex.platform.sample.verify import verify
from loraplex.platform.spec_decode.drafter import Drafter
from loraplex.platform.spec_decode.speculative import SpecCounters
from loraplex.platform.worker.cuda_graphs import Capture
from loraplex.platform.worker.model_runner import kv_bytes_per_block

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """A snapshot for metrics; taken on the engine thread, read by any."""

    num_running: int = 0  # sequences
    num_waiting: int = 0
    num_waiting_seqs: int = 0  # what the waiting requests will run (n each): the queue bound counts these
    kv_usage: float = 0.0  # blocks held by requests / all blocks (cached-free count as free)
    prefix_cache_queries: int = 0  # tokens looked up / found in the prefix cache
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    max_loras: int = 0
    adapter_prefetch_fills: int = 0  # adapter slots the prefetcher filled beside a step
    adapter_step_fills: int = 0  # ... and those a step filled itself (it waited on them)
    adapter_hits: int = 0  # adapter uses that found its weights in memory, over every adapter ever loaded
    adapter_misses: int = 0  # ... that read them (prepared file or folder)
    adapter_bytes_read: int = 0  # ... and the bytes those reads brought in
    structured_checked: int = 0  # finished JSON outputs checked against their schema (the output processor's)
    schema_violations_strict: int = 0  # ... and found breaking it (strict: a bug; not strict: dropped keywords)
    schema_violations_lenient: int = 0
    spec_decode: SpecCounters | None = None  # with --speculative-config: drafts, draft tokens, accepted tokens
    spec_decode_by_adapter: dict[str, SpecCounters] = field(default_factory=dict)  # the same per adapter


class EngineCore:
    def __init__(self, resolved: ResolvedConfig, executor: Executor, adapters: AdapterRegistry,
                 grammars: GrammarManager, tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        """`executor`: started, its model loaded (closed here if anything after fails); `adapters` and `grammars`:
        shared with the front end, which loads adapters and compiles grammars; the core pins slots and fills
        masks. `tokenizer`: for the grammar's forced text (the drafter's)."""
        try:
            self._build(resolved, executor, adapters, grammars, tokenizer, eos_token_ids)
        except BaseException:
            executor.close()
            raise

    def _build(self, resolved: ResolvedConfig, executor: Executor, adapters: AdapterRegistry,
               grammars: GrammarManager, tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        config, model = self.config, self.model_config = resolved.engine, resolved.model
        self.executor, self.adapters, self.grammars = executor, adapters, grammars
        self.max_model_len, self.max_loras = resolved.max_model_len, resolved.max_loras
        self.num_blocks = resolved.num_kv_blocks or executor.kv_blocks()
        executor.allocate_kv(self.num_blocks)
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching,
                                 reclaim_window(model.layer_windows))  # all layers sliding: old blocks freed
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   self.max_loras, config.lora_cycle_steps, eos_token_ids, grammars.new_grammar,
                                   adapters.ready if adapters.slots.stacked else None, config.lora_max_wait_steps)
        self.prefetcher = Prefetcher(adapters)
        self.batch = InputBatch(self.kv, executor.input_device)
        if resolved.device.type == "cuda" and not config.enforce_eager:
            self.enable_graphs()
        self.sampler = Sampler(model.vocab_size, eos_token_ids, config.seed, grammars, config.json_close_window,
                               resolved.device, self.max_model_len)
        self.drafter = Drafter(config.speculative, tokenizer, self.max_model_len, config.jump_forward)
        self._in_flight: InFlight | None = None
        # read at each step: may be switched between steps with nothing in flight (the GPU check times both)
        self.ahead = config.async_scheduling and executor.in_process and config.speculative is None
        if config.async_scheduling and not self.ahead:
            log.warning("--async-scheduling needs one rank in the engine's process and no --speculative-config: "
                        "steps run in order")
        self._log_kv_size()

    def enable_graphs(self, capture: Capture | None = None) -> None:
        """Every rank's decode graphs (`capture`: CUDA's unless given, as tests give the CPU stand-in); the block
        tables as wide as theirs."""
        self.batch.fix_width(self.config.max_num_seqs, self.max_model_len)
        self.executor.capture_graphs(capture)

    def close(self) -> None:
        """Stop what the executor started outside this process, and the prefetcher's thread."""
        self.prefetcher.close()
        self.executor.close()

    def _log_kv_size(self) -> None:
        config, tokens = self.config, self.num_blocks * self.config.block_size
        mib = self.num_blocks * kv_bytes_per_block(self.model_config, config.block_size, config.torch_kv_dtype) / 2**20
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB); max concurrency at max_model_len=%d: "
                 "%.2fx", self.num_blocks, config.block_size, tokens, mib, self.max_model_len,
                 tokens / self.max_model_len)

    # ---- requests in -------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """A validated request (the front end's input processor made it): its adapters pinned, its grammar's
        matcher made, queued."""
        if request.request_id in self.scheduler.groups:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        grammar = self.grammars.new_grammar(request.compiled_grammar) if request.compiled_grammar is not None else None
        extra_keys = request.extra_keys
        if request.mix is not None:  # last, as below; each adapter of the mix pinned, all or none
            infos = self.adapters.pin_all(request.mix.names, request.adapter_weights)
            # every adapter's content hash and its weight: another mix (or weight) never shares this KV
            extra_keys = ("lora-mix", *((info.content_hash, weight)
                                        for info, (_, weight) in zip(infos, request.mix.entries)))
        elif request.adapter is not None:  # last: nothing after it may fail and leak the pin
            # pinned until the group ends; the content hash keys its prefix cache, so a reloaded
            # adapter under the same name never sees the old one's KV
            extra_keys = ("lora", self.adapters.pin(request.adapter, request.adapter_weights).content_hash)
        # the tenant's namespace and the request's salt first: equal prompts of two tenants never share
        # KV blocks, so one cannot time another's cached prompts
        request.admit(request.cache_salt + extra_keys, grammar)
        self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id):
            self._release_finished()

    def stop(self, hits) -> None:
        """The stop strings the front end found in the text (`output_processor.StopHit`s): each ends its sequence
        here too."""
        for hit in hits:
            self.scheduler.stop(hit.request_id, hit.index, hit.stop)
        self._release_finished()

    def abort_running(self) -> list[str]:
        """After a step that raised: abort every request in the running batch (their state may be
        half-updated); waiting requests are untouched. Returns the aborted request ids."""
        ids = list(dict.fromkeys(r.request_id for r in self.scheduler.running))
        if self._in_flight is not None:  # its ids are lost with the step: none of its sequences waits on them
            for seq in self._in_flight.seqs:  # (a waiting one, preempted meanwhile, computes its token again)
                seq.num_pending = 0
            self._in_flight = None
        for request_id in ids:
            self.abort(request_id)
        return ids

    def _release_finished(self) -> None:
        for seqs in self.scheduler.pop_finished_groups():
            for name in seqs[0].adapter_names:  # a mix pinned each of its adapters
                self.adapters.unpin(name)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.groups)

    def stats(self, **front) -> EngineStats:
        """`front`: the front end's own fields (the output processor's schema checks), set in the same snapshot."""
        s, drafter = self.scheduler, self.drafter if self.config.speculative is not None else None
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting),
            num_waiting_seqs=sum(r.pending_forks + 1 for r in s.waiting), kv_usage=self.kv.pool.usage,
            prefix_cache_queries=self.kv.num_queries, prefix_cache_hits=self.kv.num_hits,
            num_preemptions=s.num_preemptions, running_adapters=tuple(sorted(s.running_adapters())),
            waiting_adapters=tuple(sorted({name for r in s.waiting for name in r.adapter_names})),
            max_loras=self.max_loras, adapter_prefetch_fills=self.adapters.num_preloads,
            adapter_step_fills=self.adapters.num_step_loads, adapter_hits=self.adapters.totals.hits,
            adapter_misses=self.adapters.totals.misses, adapter_bytes_read=self.adapters.totals.bytes_read, spec_decode=drafter.counters.copy() if drafter is not None else None,
            spec_decode_by_adapter={name: c.copy() for name, c in drafter.by_adapter.items()}
            if drafter is not None else {}, **front)

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list:
        """One step: the per-sequence deltas (`scheduler.SeqDelta`) of the sequences it advanced (--async-scheduling:
        those of the step before too, whose ids land now)."""
        deltas = self._step_ahead() if self.ahead else self._step()
        self._release_finished()
        return deltas

    def _step_ahead(self) -> list:
        """Schedule and launch this step with the previous one's ids still on the device, then land those. The
        previous step stays `_in_flight` until it has landed: a step that raises before leaves it for
        `abort_running`, which clears its sequences' pending ids."""
        prev = self._in_flight
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return self._land() if prev is not None else self._idle()
        running = self.scheduler.running_adapters()
        batch = self.batch.build(sched, self.adapters.assign_slots(running) if running else {},
                                 prev.rows if prev is not None else None)
        batch.inputs.previous_tokens = prev.tokens if prev is not None else None
        self._prefetch(running)
        logits, prompt_hidden = self.executor.execute(batch.inputs)
        for (req, first, slot), hidden in zip(batch.prompt_runs, prompt_hidden):
            self._add_prompt_logprobs(PromptRows(req, hidden, first, slot, self.executor.logits))
        rows, seqs = self.scheduler.sampling_batch(sched)
        if seqs and len(rows) == len(batch.sampled) and all(self.sampler.plain(seq) for seq in seqs):
            in_flight = InFlight.start(seqs, self.sampler.on_device(logits, seqs))
            deltas = self._land() if prev is not None else []
            for seq in seqs:
                seq.num_pending += 1
            self._in_flight = in_flight
            return deltas
        landed = self._land() if prev is not None else []
        live = [(row, seq) for row, seq in zip(rows, seqs) if not seq.status.finished]  # the landed ids ended some
        return merged(landed, self._sample(logits, [row for row, _ in live], [seq for _, seq in live],
                                           len(batch.sampled)))

    def _land(self) -> list:
        """Append the in-flight step's ids (a sequence that ended meanwhile drops its own)."""
        prev = self._in_flight
        tokens = prev.read()
        self._in_flight = None
        for seq in prev.seqs:
            seq.num_pending -= 1
        live = [(seq, token) for seq, token in zip(prev.seqs, tokens) if not seq.status.finished]
        return self.scheduler.update([seq for seq, _ in live], [token for _, token in live], [None] * len(live),
                                     self._accept_forced)

    def _idle(self) -> list:
        """Nothing scheduled: admission guarantees any one request fits an empty pool, so waiting requests with
        nothing running are a bug, and failing loudly beats spinning forever."""
        if self.scheduler.waiting and not self.scheduler.running:
            raise RuntimeError(f"scheduler made no progress with {len(self.scheduler.waiting)} waiting")
        return []

    def _step(self) -> list:
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return self._idle()
        running = self.scheduler.running_adapters()
        batch = self.batch.build(sched, self.adapters.assign_slots(running) if running else {})
        self._prefetch(running)  # beside the forward pass: the slots it fills are none of this step's
        logits, prompt_hidden = self.executor.execute(batch.inputs)
        for (req, first, slot), hidden in zip(batch.prompt_runs, prompt_hidden):
            self._add_prompt_logprobs(PromptRows(req, hidden, first, slot, self.executor.logits))
        rows, seqs = self.scheduler.sampling_batch(sched)
        return self._sample(logits, rows, seqs, len(batch.sampled))

    def _sample(self, logits: torch.Tensor, rows: list[int], seqs: list[Request], num_rows: int) -> list:
        """Sample (or verify the drafts of) `seqs` from their `rows` of the step's `num_rows` logits, append, then
        the next drafts."""
        if not seqs:
            return []
        if any(seq.spec_token_ids for seq in seqs):
            deltas = self._verify(logits, rows, seqs)
        else:
            # forks repeat their parent's row; without them the logits are already one row each
            if len(rows) != num_rows:
                logits = logits[to_device(torch.tensor(rows, dtype=torch.long, device="cpu"), logits.device)]
            sampled = self.sampler(logits, seqs)
            deltas = self.scheduler.update(seqs, sampled.token_ids, sampled.logprobs, self._accept_forced)
        self.drafter.propose(self.scheduler.running)
        return deltas

    def _accept_forced(self, req: Request) -> list[int]:
        """What the scheduler appends after a sequence's tokens: the grammar-forced drafts accepted as proposed
        (none where the drafter verifies them, by the batch as it is now)."""
        return self.drafter.accept_forced(req, len(self.scheduler.running))

    def _verify(self, logits: torch.Tensor, rows: list[int], seqs: list[Request]):
        """Sample with drafts (`verify.py`): each sequence's accepted drafts and next token appended, the KV of
        its rejected drafts given back."""
        deltas = [self.scheduler.new_delta(seq) for seq in seqs]
        accepted = verify(self.sampler, logits, rows, seqs,
                          lambda i, token, lp: self.scheduler.append(seqs[i], token, lp, deltas[i]))
        for seq, delta, num_accepted in zip(seqs, deltas, accepted):
            self.drafter.record(seq, len(seq.spec_token_ids), num_accepted)
            self.scheduler.reject_drafts(seq, num_accepted)
            self.scheduler.close_delta(seq, delta, self._accept_forced)
        return deltas

    def _add_prompt_logprobs(self, rows: PromptRows) -> None:
        """The logprobs of the prompt tokens these rows predict; after a preemption the prompt
        is computed again, and what is known already is skipped."""
        req = rows.request
        skip = len(req.prompt_logprobs) - rows.first
        targets = req.prompt_token_ids[rows.first + max(skip, 0):rows.first + len(rows.hidden)]
        if targets and skip >= 0:
            req.prompt_logprobs += prompt_logprobs(rows.compute_logits, rows.hidden[skip:], targets,
                                                   req.params.prompt_logprobs)

    def _prefetch(self, running: set[str]) -> None:
        """Hand the prefetcher the adapters the first waiting requests need that hold no slot, in queue order (at
        most `max_loras` of them, from at most 4 x `max_num_seqs` requests: bounded work per step)."""
        names: dict[str, None] = {}
        for req in islice(self.scheduler.waiting, 4 * self.config.max_num_seqs):
            names.update((n, None) for n in req.adapter_names if n not in running)
            if len(names) >= self.max_loras:
                break
        wanted = tuple(n for n in names if self.adapters.needs_slot(n))[:self.max_loras]
        self.prefetcher.want(wanted, frozenset(names))


def merged(landed: list[SeqDelta], sampled: list[SeqDelta]) -> list[SeqDelta]:
    """One delta per sequence and step, as the front end reads them: a sequence whose landed id and this step's
    pick both came now gets them in one delta, in order, with the later finish."""
    by_seq = {(d.request_id, d.index): d for d in landed}
    out = list(landed)
    for delta in sampled:
        first = by_seq.get((delta.request_id, delta.index))
        if first is None:
            out.append(delta)
            continue
        first.new_token_ids += delta.new_token_ids
        if first.new_logprobs is not None and delta.new_logprobs is not None:
            first.new_logprobs += delta.new_logprobs
        first.finish_reason, first.stop_reason = delta.finish_reason, delta.stop_reason
    return out
