"""Which requests run this step, and how many tokens each (vLLM V1's model).

There are no prefill and decode phases: every request has `num_computed_tokens` catching up
with its token count. Running requests go first (oldest first), then waiting ones in arrival
order, under a token budget and a sequence cap; a long prompt is cut into chunks. When blocks
run out the newest running request is preempted: its blocks are freed and it is recomputed
later from the front of the queue, so no request starves.

Adapter slots never block the queue: a waiting request whose adapter has no slot (`max_loras`
distinct adapters already run) is skipped, and base requests and requests of resident adapters
behind it go on (vLLM V1 does the same). So that no adapter starves, a resident adapter that
has held its slot `lora_cycle_steps` steps while others wait stops admitting new requests; its
slot frees when its running requests finish and goes to the oldest waiting adapter (LoRAX's
adapter cycling). Within one adapter, and for KV blocks, admission stays FCFS.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from loraplex.platform.kv_cache_manager import KVCacheManager
from loraplex.platform.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num new tokens)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, max_loras: int = 1, lora_cycle_steps: int = 32) -> None:
        self.kv = kv
        self.max_loras = max_loras
        self.lora_cycle_steps = lora_cycle_steps
        self._step = 0
        self._resident_since: dict[str, int] = {}  # running adapter -> step it took its slot
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < self.max_num_seqs:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self.running.pop()  # newest first
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, num_new))
                scheduled_ids.add(req.seq_id)
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: nothing newer is left to schedule
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        out.block_copies = self.kv.take_copies()
        return out

    def running_adapters(self) -> set[str]:
        return {r.adapter for r in self.running if r.adapter is not None}

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        adapters = self.running_adapters()
        yielding = self._yielding_adapters(adapters)
        i = 0
        while i < len(self.waiting) and budget > 0:
            req = self.waiting[i]
            group = req.pending_forks + 1
            if self.running and len(self.running) + group > self.max_num_seqs:
                break
            if req.adapter is not None and (req.adapter in yielding or
                                            (req.adapter not in adapters and len(adapters) >= self.max_loras)):
                i += 1  # no slot for it now: base requests and resident adapters behind it go on
                continue
            hits, num_hit = ([], 0)
            if req.num_computed_tokens == 0:
                hits, num_hit = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit, budget)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break  # FCFS for KV blocks: nobody overtakes the first request that fits no slot
            del self.waiting[i]
            self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_hit
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.adapter is not None:
                adapters.add(req.adapter)
            out.scheduled.append((req, num_new))
            budget -= num_new
        return budget

    def _yielding_adapters(self, resident: set[str]) -> set[str]:
        """Resident adapters that stop admitting so that waiting ones get a slot: while adapters
        wait for a slot, the longest-resident ones past `lora_cycle_steps`, one per waiting adapter."""
        for name in [n for n in self._resident_since if n not in resident]:
            del self._resident_since[name]
        for name in resident:
            self._resident_since.setdefault(name, self._step)
        if len(resident) < self.max_loras:
            return set()
        starved = {r.adapter for r in self.waiting if r.adapter is not None and r.adapter not in resident}
        overdue = sorted((since, name) for name, since in self._resident_since.items()
                         if self._step - since >= self.lora_cycle_steps)
        return {name for _, name in overdue[:len(starved)]}

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def add_running(self, req: Request) -> None:
        """A forked sequence joins the running set right after its parent."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.forget(req)
