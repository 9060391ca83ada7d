"""Which requests run this step, and how many tokens each (vLLM V1's model).

There are no prefill and decode phases: every request has `num_computed_tokens` catching up
with its token count. Running requests go first (oldest first), then waiting ones in arrival
order, under a token budget and a sequence cap; a long prompt is cut into chunks. When blocks
run out the newest running request is preempted: its blocks are freed and it is recomputed
later from the front of the queue, so no request starves. (With priorities: most urgent first,
then as said; see below.)

Adapter slots never block the queue: a waiting request whose adapter has no slot (`max_loras`
distinct adapters already run) is skipped, and base requests and requests of resident adapters
behind it go on (vLLM V1 does the same). So that no adapter starves, a resident adapter that
has held its slot `lora_cycle_steps` steps while others wait stops admitting new requests; its
slot frees when its running requests finish and goes to the oldest waiting adapter (LoRAX's
adapter cycling). Within one adapter, and for KV blocks, admission stays FCFS.

Residency: where slots are copies (the GPU's layout), a request is admitted once its adapters are ready
(`ready`: the prefetcher filled their slots beside the last step), so a step never waits on a copy and base
requests never wait behind one; requests whose adapters are ready overtake those still coming in. So that no
request starves, one that has waited `lora_max_wait_steps` steps is admitted ready or not (its step fills the
slot itself: the prefetcher failed or fell behind), as are requests of a step that began with nothing running
(nothing would wait with them).

Requests of several tenants share the batch by weight (`fair_share.py`): admission takes the next
request from the tenant with the fewest seats per weight, and a tenant waiting below its share gets
seats preempted from the one furthest above its own.

Priority (vLLM's `priority`, lower first): `waiting` is kept in (priority, arrival) order, a preempted
request back at the front of its class, and `running` in (priority, admission) order. A request outranks
another of its tenant with a higher value, and any Batch API line (`BATCH_PRIORITY`; `fair_share.outranks`):
priorities order a tenant's own work, batch lines yield to everyone's. A running request outranked by an
urgent one (a running one still in its prompt, or a waiting one admissible now) sits the step out, keeping
its blocks and seat, so the urgent prefill has the step to itself; when the waiting one cannot get a seat
or blocks, the running requests it outranks are preempted, worst priority (newest) first, and when it waits for
an adapter slot whose every holder it outranks, those holders are preempted (no inversion through slots); in a
step where nothing more urgent could run nobody sits out. Blocks running short preempt the worst priority, newest
among equals. All priorities equal: exactly FCFS as above, the extra work an O(1) check.
"""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from itertools import takewhile
from typing import Callable, Iterable

from loraplex.platform.core import fair_share
from loraplex.platform.core.kv_cache_manager import KVCacheManager
from loraplex.platform.request import BATCH_PRIORITY, Logprob, Request, RequestStatus


@dataclass
class SeqDelta:
    """What one step did to one sequence: the core's output, O(new tokens)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num new tokens)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class _Urgent:
    """The most urgent priority, per tenant and over all, of some requests: whether one of them outranks
    another (`fair_share.outranks`) in O(1)."""

    def __init__(self, requests: Iterable[Request]) -> None:
        self.best: dict[str, int] = {}
        self.overall = BATCH_PRIORITY
        for r in requests:
            name = fair_share.tenant_of(r).name
            self.best[name] = min(r.priority, self.best.get(name, r.priority))
            self.overall = min(self.overall, r.priority)

    def outranks(self, req: Request) -> bool:
        p = req.priority
        return self.best.get(fair_share.tenant_of(req).name, p) < p or (p == BATCH_PRIORITY and self.overall < p)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, max_loras: int = 1, lora_cycle_steps: int = 32,
                 eos_token_ids: tuple[int, ...] = (), new_grammar: Callable | None = None,
                 ready: Callable[[tuple[str, ...]], bool] | None = None, lora_max_wait_steps: int = 64) -> None:
        """`ready(adapter names)`: whether a step may use those adapters without waiting on them (None: always)."""
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.new_grammar = new_grammar  # compiled grammar -> a fresh matcher, for forked sequences
        self.groups: dict[str, list[Request]] = {}  # request id -> its sequences (n > 1: forks)
        self._finished_groups: list[list[Request]] = []
        self.max_loras = max_loras
        self.lora_cycle_steps = lora_cycle_steps
        self.ready = ready
        self.lora_max_wait_steps = lora_max_wait_steps
        self._idle = True
        self._step = 0
        self._resident_since: dict[str, int] = {}  # running adapter -> step it took its slot
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.tenanted = False  # a request named its tenant: the fair share applies while several are in flight

    def add(self, request: Request) -> None:
        if request.request_id in self.groups:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.groups[request.request_id] = [request]
        request.queued_at_step = self._step
        # after the last waiting request of its priority or a more urgent one
        self.waiting.insert(bisect_right(self.waiting, request.priority, key=_priority), request)
        self.tenanted = self.tenanted or request.tenant is not None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        self._idle = not self.running  # a slot filled in this step delays no running request
        out = SchedulerOutput()
        fair = self.tenanted and fair_share.several_tenants(self.waiting, self.running)
        if fair:
            self._make_room_for_tenants(out)
        made_room = len(out.preempted)
        sitting, displaced = self._sitting_out()
        budget = self._schedule_running(out, self.max_num_batched_tokens, sitting)
        if len(out.preempted) == made_room:  # else blocks ran short above: nothing new this step
            budget = self._admit_waiting(out, budget, fair, displaced)
        if sitting and not out.scheduled:  # nothing more urgent could run: nobody sits out
            budget = self._schedule_running(out, budget, set())
        self._add_drafts(out, budget)
        out.block_copies = self.kv.take_copies()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, sitting: set[Request]) -> int:
        """Running requests first, in `running`'s order, but those `sitting` out; when blocks run short the last
        one (the worst priority, newest among equals) is preempted. The budget left."""
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < self.max_num_seqs:
            req = self.running[i]
            if req in sitting or self._ends_with_pending(req):
                i += 1
                continue
            num_new = min(req.num_tokens_with_pending - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self.running.pop()  # worst priority, newest first
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, num_new))
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: nothing less urgent or newer is left to schedule
        return budget

    def _ends_with_pending(self, req: Request) -> bool:
        """--async-scheduling: the token the device sampled for it ends it (max_tokens, max_model_len) once read:
        nothing more to compute."""
        return req.ends_with_pending or (req.num_pending > 0 and req.num_tokens_with_pending >= self.max_model_len)

    def _sitting_out(self) -> tuple[set[Request], list[Request]]:
        """The running requests that sit this step out, each outranked by an urgent one (running, still in its
        prompt; or waiting, admissible now); and those of them a waiting one outranks, worst priority (newest)
        last: preempted in that order when admission blocks."""
        worst = self._outranked_priority()
        if worst is None:
            return set(), []
        adapters = self.running_adapters()
        admissible = partial(self._admissible, resident=adapters, yielding=self._yielding_adapters(adapters))
        by_waiting = _Urgent(r for r in takewhile(lambda r: r.priority < worst, self.waiting)
                             if admissible(r) or self._ready(r) and self._slot_holders(r, adapters))
        by_prompt = _Urgent(r for r in self.running if r.num_computed_tokens < len(r.prompt_token_ids))
        displaced = [r for r in self.running if by_waiting.outranks(r)]
        return set(displaced).union(r for r in self.running if by_prompt.outranks(r)), displaced

    def _outranked_priority(self) -> int | None:
        """The running requests' least urgent priority; None while none of them is less urgent than another
        request, so that nobody can sit out (all priorities equal). O(1): both queues are in priority order."""
        if not self.running:
            return None
        worst = self.running[-1].priority
        best = min(self.running[0].priority, self.waiting[0].priority if self.waiting else worst)
        return worst if best < worst else None

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Last, from what the step has left (budget, blocks): each scheduled running request's drafts, computed
        after its own tokens and verified; drafts never take what a running or waiting request's own tokens would
        (so they cause no preemption and delay no admission)."""
        for n, (req, num_new) in enumerate(out.scheduled):
            drafts = req.spec_token_ids
            if not drafts:
                continue
            del drafts[max(budget, 0):]
            # a chunk short of its known tokens samples nothing to verify against; no block left: no drafts
            if not drafts or num_new != req.num_tokens - req.num_computed_tokens or \
                    self.kv.allocate_slots(req, num_new + len(drafts)) is None:
                req.spec_token_ids = []
                continue
            out.scheduled[n] = (req, num_new + len(drafts))
            budget -= len(drafts)

    def running_adapters(self) -> set[str]:
        return {name for r in self.running for name in r.adapter_names}

    def _make_room_for_tenants(self, out: SchedulerOutput) -> None:
        """Preempt the seats that tenants waiting below their share can take (before anything runs)."""
        adapters = self.running_adapters()
        admissible = partial(self._admissible, resident=adapters, yielding=self._yielding_adapters(adapters))
        for victim in fair_share.preemption_victims(list(self.waiting), self.running, self.max_num_seqs, admissible):
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, fair: bool = False,
                       displaced: list[Request] | None = None) -> int:
        adapters = self.running_adapters()  # grows as requests are admitted: `admissible` sees it
        admissible = partial(self._admissible, resident=adapters, yielding=self._yielding_adapters(adapters))
        held = fair_share.seats(self.running) if fair else None
        i = 0
        while i < len(self.waiting) and budget > 0:
            if fair:  # the next from the tenant with the fewest seats per weight
                i = fair_share.next_to_admit(self.waiting, held, admissible)
                if i is None:
                    break
            req = self.waiting[i]
            group = req.pending_forks + 1
            if self.running and len(self.running) + group > self.max_num_seqs:
                if not admissible(req) and displaced:
                    i += 1  # a more urgent one behind it may take a seat from what it outranks
                    continue
                if self._displace(req, displaced, out, held):
                    i = self.waiting.index(req)
                    continue
                break
            if not admissible(req):  # no slot, or its adapters still coming in
                if self._ready(req) and self._free_slot(req, adapters, displaced, out, held):
                    i = self.waiting.index(req)
                    continue
                i += 1  # no slot for it now: base requests and resident adapters behind it go on
                continue
            hits, num_hit = ([], 0)
            if req.num_computed_tokens == 0 and req.prompt_logprobs is None:  # those need every position
                hits, num_hit = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit, budget)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                if self._displace(req, displaced, out, held):
                    i = self.waiting.index(req)
                    continue
                break  # FCFS for KV blocks: nobody overtakes the first request that fits no slot
            del self.waiting[i]
            self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_hit
                req.queue_time_s = time.monotonic() - req.arrival_time
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self._run(req)
            adapters.update(req.adapter_names)
            out.scheduled.append((req, num_new))
            budget -= num_new
            if held is not None:
                held[fair_share.tenant_of(req).name] += 1
        return budget

    def _displace(self, req: Request, displaced: list[Request] | None, out: SchedulerOutput, held) -> bool:
        """`req`'s admission blocks (seats, blocks): preempt the worst (newest among equals) running request it
        outranks (sitting out this step); False when there is none."""
        for k in range(len(displaced or ()) - 1, -1, -1):
            victim = displaced[k]
            if victim.status == RequestStatus.RUNNING and fair_share.outranks(req, victim):
                del displaced[k]
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if held is not None:
                    held[fair_share.tenant_of(victim).name] -= 1
                return True
        return False

    def _slot_holders(self, req: Request, resident: set[str]) -> list[Request]:
        """The running requests holding the adapter slot `req` waits for, when all of them are outranked by it
        (batch lines holding every slot): the adapter with the fewest such requests; [] when there is none."""
        if not req.adapter_names:
            return []
        best: list[Request] = []
        for name in resident.difference(req.adapter_names):
            holders = [r for r in self.running if name in r.adapter_names]
            if all(fair_share.outranks(req, r) for r in holders) and (not best or len(holders) < len(best)) and \
                    self._slots_for(req.adapter_names, resident - {name}, set()):
                best = holders
        return best

    def _free_slot(self, req: Request, resident: set[str], displaced: list[Request] | None, out: SchedulerOutput,
                   held) -> bool:
        """`req` waits for a slot its outranked holders sit on (sitting out this step): preempt them, so the slot
        frees for it (priority inversion through adapter slots); False when there are none."""
        holders = self._slot_holders(req, resident) if displaced else []
        if not holders or not all(h in displaced for h in holders):
            return False
        for victim in holders:
            displaced.remove(victim)
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)
            if held is not None:
                held[fair_share.tenant_of(victim).name] -= 1
        resident.clear()
        resident.update(self.running_adapters())  # `admissible` reads this set
        return True

    def _run(self, req: Request) -> None:
        """Into `running`, kept in (priority, admission) order: the most urgent run first, the last is preempted
        first."""
        self.running.insert(bisect_right(self.running, req.priority, key=_priority), req)

    def _ready(self, req: Request) -> bool:
        """Whether a step may run `req` without waiting on its adapters, or nothing would wait with it (the step
        began with nothing running), or it has waited long enough for them."""
        return not req.adapter_names or self.ready is None or self._idle or self.ready(req.adapter_names) or \
            self._step - (req.queued_at_step or 0) >= self.lora_max_wait_steps

    def _admissible(self, req: Request, resident: set[str], yielding: set[str]) -> bool:
        """Whether `req` may be admitted now as far as adapters go: a slot for each, and in it (`_ready`); the base
        model always may. Every admission path asks this (fair share, sitting out, displacing), so a request
        whose adapters are still coming in neither takes nor frees a seat."""
        return not req.adapter_names or (self._slots_for(req.adapter_names, resident, yielding) and self._ready(req))

    def _slots_for(self, names: tuple[str, ...], resident: set[str], yielding: set[str]) -> bool:
        """Whether a request's adapters (a mix: each of them, counted once however many mixes share it) all
        fit in `max_loras` beside the resident ones, none of them yielding its slot."""
        if any(name in yielding for name in names):
            return False
        return len(resident.union(names)) <= self.max_loras

    def _yielding_adapters(self, resident: set[str]) -> set[str]:
        """Resident adapters that stop admitting so that waiting ones get a slot: while adapters
        wait for a slot, the longest-resident ones past `lora_cycle_steps`, one per waiting adapter."""
        for name in [n for n in self._resident_since if n not in resident]:
            del self._resident_since[name]
        for name in resident:
            self._resident_since.setdefault(name, self._step)
        if len(resident) < self.max_loras:
            return set()
        starved = {name for r in self.waiting for name in r.adapter_names if name not in resident}
        overdue = sorted((since, name) for name, since in self._resident_since.items()
                         if self._step - since >= self.lora_cycle_steps)
        return {name for _, name in overdue[:len(starved)]}

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        # first of its priority class: before the first waiting request as urgent or less
        self.waiting.insert(bisect_left(self.waiting, req.priority, key=_priority), req)
        self.num_preemptions += 1

    # ---- after the forward pass ---------------------------------------------------------------

    def sampling_batch(self, out: SchedulerOutput) -> tuple[list[int], list[Request]]:
        """Count the scheduled tokens as computed; return the sequences to sample and the first row of
        the step's logits each samples from (rows: the requests whose chunk reached their last
        known token, in scheduled order; a request with drafts has a row more for each). A request of
        n > 1 forks here, at its first token: its children share its prompt blocks (copy-on-write) and
        sample from its row."""
        rows, batch = [], []
        row = 0
        for req, num_new in out.scheduled:
            req.num_computed_tokens += num_new
            if req.num_computed_tokens == req.num_tokens_with_pending + len(req.spec_token_ids):
                for seq in [req, *self._fork(req)]:
                    rows.append(row)
                    batch.append(seq)
                row += 1 + len(req.spec_token_ids)
        return rows, batch

    def reject_drafts(self, seq: Request, num_accepted: int) -> None:
        """After verification: the KV of the drafts after the accepted ones is not the sequence's (their
        positions are computed again), and blocks that held only those go back to the pool."""
        seq.num_computed_tokens -= len(seq.spec_token_ids) - num_accepted
        seq.spec_token_ids = []
        if not seq.status.finished:
            self.kv.trim(seq)

    def _fork(self, parent: Request) -> list[Request]:
        if not parent.pending_forks:
            return []
        children = []
        for index in range(1, parent.params.n):
            child = Request(parent.request_id, parent.prompt_token_ids, parent.params, parent.prompt, index=index,
                            extra_keys=parent.extra_keys, adapter=parent.adapter,
                            compiled_grammar=parent.compiled_grammar, mix=parent.mix, tenant=parent.tenant,
                            tokenizer=parent.tokenizer)
            child.priority = parent.priority
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            if parent.compiled_grammar is not None:  # forks happen before any token: a fresh matcher
                child.grammar = self.new_grammar(parent.compiled_grammar)
            self.kv.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self._run(child)
            self.groups[parent.request_id].append(child)
            children.append(child)
        parent.pending_forks = 0
        return children

    def update(self, batch: list[Request], token_ids: list[int], logprobs: list[dict[int, Logprob] | None],
               forced: Callable[[Request], list[int]] | None = None) -> list[SeqDelta]:
        """Append each sequence's sampled token (and the tokens its grammar forces next, from
        `forced`), finish what ended (grammar end, EOS, stop token, max_tokens, max_model_len),
        free finished sequences' blocks. One delta per sequence: only the new tokens."""
        deltas = []
        for seq, token, lp in zip(batch, token_ids, logprobs):
            delta = self.new_delta(seq)
            self.append(seq, token, lp, delta)
            self.close_delta(seq, delta, forced)
            deltas.append(delta)
        return deltas

    @staticmethod
    def new_delta(seq: Request) -> SeqDelta:
        return SeqDelta(seq.request_id, seq.index, [], [] if seq.logprobs is not None else None,
                        num_cached_tokens=seq.num_cached_tokens)

    def close_delta(self, seq: Request, delta: SeqDelta, forced: Callable[[Request], list[int]] | None = None) -> None:
        """After a step's tokens: the tokens its grammar forces next (from `forced`), then the finish."""
        if not seq.status.finished and forced is not None:
            for extra in forced(seq):
                self.append(seq, extra, {extra: Logprob(0.0, 1)} if seq.logprobs is not None else None, delta)
                if seq.status.finished:
                    break
        delta.finish_reason, delta.stop_reason = seq.finish_reason, seq.stop_reason

    def append(self, seq: Request, token: int, logprobs: dict[int, Logprob] | None, delta: SeqDelta) -> bool:
        """Append one token (its grammar advanced, its finish checked); whether the sequence still runs."""
        seq.output_token_ids.append(token)
        delta.new_token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            delta.new_logprobs.append(logprobs)
        p = seq.params
        grammar_done = False
        if seq.grammar is not None:
            if not seq.grammar.accept_token(token):  # cannot happen with a sane mask: end this one only
                seq.stop_reason = f"grammar rejected token {token}"
                self.finish(seq, RequestStatus.FINISHED_ABORTED)
                return False
            grammar_done = seq.grammar.is_terminated()
        if grammar_done or (token in self.eos_token_ids and not p.ignore_eos):
            self.finish(seq, RequestStatus.FINISHED_STOPPED)
        elif token in p.stop_token_ids:
            seq.stop_reason = token
            self.finish(seq, RequestStatus.FINISHED_STOPPED)
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            # an output kept inside its budget (grammar/budget.py) ends complete there: stopped, not cut off
            complete = seq.grammar is not None and seq.grammar.guard is not None and seq.grammar.is_complete(
                seq.compiled_grammar.ends_in_json)
            self.finish(seq, RequestStatus.FINISHED_STOPPED if complete else RequestStatus.FINISHED_LENGTH)
        return not seq.status.finished

    def stop(self, request_id: str, index: int, reason: str) -> None:
        """A stop string ended sequence `index` (the output processor found it in the text)."""
        seq = self.groups.get(request_id, [])[index:index + 1]
        if seq and not seq[0].status.finished:
            seq[0].stop_reason = reason
            self.finish(seq[0], RequestStatus.FINISHED_STOPPED)

    def abort(self, request_id: str) -> bool:
        """End every unfinished sequence of a request; False if it is unknown (or already over)."""
        seqs = self.groups.get(request_id)
        if seqs is None:
            return False
        seqs[0].pending_forks = 0
        for seq in seqs:
            if not seq.status.finished:
                self.finish(seq, RequestStatus.FINISHED_ABORTED)
        return True

    def pop_finished_groups(self) -> list[list[Request]]:
        """Requests whose every sequence finished since the last call (their adapter pins go)."""
        done, self._finished_groups = self._finished_groups, []
        return done

    def finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.forget(req)
        seqs = self.groups.get(req.request_id)
        if seqs is not None and not seqs[0].pending_forks and all(s.status.finished for s in seqs):
            self._finished_groups.append(self.groups.pop(req.request_id))


def _priority(req: Request) -> int:
    return req.priority
