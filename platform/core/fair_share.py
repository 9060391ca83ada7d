"""Tenants' fair share of the running batch: seats (running sequences) in proportion to their weights.

Without tenants every request is the default tenant's and the scheduler stays FCFS. With several
tenants in flight, a waiting request is admitted from the tenant with the fewest seats per weight
(FCFS within a tenant, the adapter-slot rules unchanged), and when the batch is full while a tenant
waits below its share, the newest sequences of the tenant furthest above its share are preempted
(recomputed later, mostly from the prefix cache) to make room: one tenant's flood cannot hold the
batch while another's requests wait (weighted fair queueing over seats, as a gateway cannot do).

Priorities order a tenant's own work, never another's (`outranks`), but Batch API lines (`BATCH_PRIORITY`) yield
to everyone's: a tenant's first admissible waiting request is its most urgent (the scheduler keeps `waiting` in
priority order), batch lines are admitted after every tenant's other work, seats are taken from a tenant's worst
priority first, and batch lines waiting below their share take seats only from batch lines.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import chain
from dataclasses import dataclass
from typing import Callable, Iterable

from loraplex.platform.request import BATCH_PRIORITY, Request


@dataclass(frozen=True)
class TenantShare:
    """Whose request it is, that tenant's weight in the share of the batch, and its prefix-cache namespace."""

    name: str
    weight: float = 1.0
    # its prefix-cache namespace: requests of one namespace may share cached KV blocks, others never
    cache_namespace: str = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.weight, (int, float)) and math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"tenant {self.name!r}: weight must be a positive number, got {self.weight!r}")


DEFAULT_TENANT = TenantShare("")


def tenant_of(req: Request) -> TenantShare:
    return req.tenant or DEFAULT_TENANT


def seats(running: Iterable[Request]) -> Counter:
    """Running sequences per tenant name."""
    return Counter(tenant_of(r).name for r in running)


def outranks(a: Request, b: Request) -> bool:
    """Whether `a` goes before `b` (sits it out, preempts it): more urgent (a lower priority), and of the same
    tenant, or `b` a Batch API line, which yields to everyone's work."""
    return a.priority < b.priority and (b.priority == BATCH_PRIORITY or tenant_of(a).name == tenant_of(b).name)


def several_tenants(waiting: Iterable[Request], running: Iterable[Request]) -> bool:
    names = set()
    for req in chain(waiting, running):
        names.add(tenant_of(req).name)
        if len(names) > 1:
            return True
    return False


def next_to_admit(waiting: Iterable[Request], held: Counter, admissible: Callable[[Request], bool]) -> int | None:
    """Index in `waiting` of the next request to admit: each tenant's first admissible request (its most
    urgent), from the tenant with the fewest seats per weight (the earlier one on a tie), batch lines after
    every other; None if none is admissible."""
    best, seen = None, set()
    for i, req in enumerate(waiting):
        tenant = tenant_of(req)
        if tenant.name in seen or not admissible(req):
            continue
        seen.add(tenant.name)
        key = (req.priority == BATCH_PRIORITY, held[tenant.name] / tenant.weight, i)
        if best is None or key < best:
            best = key
    return None if best is None else best[-1]


def fair_seats(requests: Iterable[Request], max_num_seqs: int) -> dict[str, float]:
    """Each tenant in flight's share of `max_num_seqs` seats, by weight."""
    weights = {}
    for req in requests:
        tenant = tenant_of(req)
        weights[tenant.name] = tenant.weight
    total = sum(weights.values())
    return {name: max_num_seqs * w / total for name, w in weights.items()}


def preemption_victims(waiting: list[Request], running: list[Request], max_num_seqs: int,
                       admissible: Callable[[Request], bool]) -> list[Request]:
    """Running sequences to preempt so that tenants waiting below their share get seats: as many as they
    can take beyond the free seats, each from the tenant then furthest above its share (its worst priority,
    newest first), batch lines first of all when interactive work waits; batch lines alone waiting take seats only
    from batch lines."""
    fair = fair_seats(chain(waiting, running), max_num_seqs)
    held = seats(running)
    ready = [r for r in waiting if admissible(r)]
    wanting = Counter(tenant_of(r).name for r in ready)
    short = {name: max(0, min(math.floor(fair[name]) - held[name], count)) for name, count in wanting.items()}
    need = sum(short.values()) - max(0, max_num_seqs - len(running))
    if need <= 0:
        return []
    batch_only = all(r.priority == BATCH_PRIORITY for r in ready if short[tenant_of(r).name])
    candidates = [r for r in running if not batch_only or r.priority == BATCH_PRIORITY]
    victims: list[Request] = []
    if not batch_only:  # interactive work waits below its share: batch lines give up their seats first, anyone's
        victims = [r for r in reversed(candidates) if r.priority == BATCH_PRIORITY][:need]
        for victim in victims:
            candidates.remove(victim)
            held[tenant_of(victim).name] -= 1
    for _ in range(need - len(victims)):
        over = [n for n in dict.fromkeys(tenant_of(r).name for r in candidates) if held[n] - 1 >= fair[n]]
        if not over:
            break
        name = max(over, key=lambda n: held[n] / fair[n])
        victim = max((r for r in reversed(candidates) if tenant_of(r).name == name), key=lambda r: r.priority)
        candidates.remove(victim)
        victims.append(victim)
        held[name] -= 1
    return victims
