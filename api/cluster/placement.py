"""Which engine replica takes a request: adapters placed by load, routed with bounded loads.

Ray Serve's multiplexing keeps adapters on replicas (each replica's LRU, the ids it reports);
what it cannot express is where a new adapter should go and when a holder is too busy. That is
`Placement`, a plain class the ingress's Ray request router asks (`api/cluster/ray_serve.py`):
- an adapter no replica holds goes to the least-loaded replica (running requests, their tokens,
  held adapters, tokens served so far), which reads it;
- a held adapter goes to its least-loaded holder, unless every holder is above its bound
  (consistent hashing with bounded loads: at most ceil((1 + epsilon) x the mean) running
  requests, counting this one); then to the least-loaded replica, which becomes a holder too.
A hot adapter thus spreads over several replicas and a cold one stays on one. Loads are what
this router sent and has not seen finish: with one ingress that is every request.

A request for a held adapter is offered to its holder alone for its first `HOLDER_TRIES`
choices. Ray probes the replica it is offered (a queue-length call with a 0.1 s deadline, doubled
on each retry) and goes to the next one offered when the probe is late; a holder busy for a moment
would otherwise send the request to a replica that must read the adapter, and make it a holder.
Past those tries (the holder full, or not answering) every replica is offered. A choice places
its adapter at once, so that loads sent together spread; one Ray asks about again, or sent to
another replica, takes that placement back (nothing was read there).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Callable

LOAD_EPSILON = 0.5  # the default of `--load-epsilon` (ClusterConfig.load_epsilon)
PLACED_GRACE_S = 30.0  # a placement counts as held until Ray reports it (later on a busy machine) or this passes
UNDISPATCHED_S = 30.0  # a choice never dispatched (its client left first) stops counting after this
BYTES_PER_TOKEN = 4  # a prompt's tokens, estimated from its body's length
DEFAULT_OUTPUT_TOKENS = 16  # a request's output without max_tokens, for its estimate
PARSED_BODY_BYTES = 1 << 16  # longer bodies are estimated by length alone, not parsed again
HOLDER_TRIES = 3  # choices that offer a held adapter's holder alone (Ray probes it for 0.1, 0.2, 0.4 s)


@dataclass
class ReplicaLoad:
    running: int = 0  # requests sent there and not finished
    tokens: int = 0  # their estimated tokens
    adapters: int = 0  # adapters it holds
    served: int = 0  # estimated tokens of every request sent there

    def key(self) -> tuple[int, int, int, int]:
        return (self.running, self.tokens, self.adapters, self.served)


@dataclass
class _Flight:
    replica: str
    tokens: int
    since: float
    dispatched: bool = False
    tries: int = 1  # how often Ray has asked where to send it
    placed: str | None = None  # the adapter this choice placed on its replica (held there from then on)
    ended: bool = False  # an end came before the dispatch: a refused attempt's, or this run's own


class Placement:
    def __init__(self, epsilon: float | None = LOAD_EPSILON, clock: Callable[[], float] = time.monotonic) -> None:
        """`epsilon` None: plain affinity (a holder takes every request of its adapter)."""
        self.epsilon, self.clock = epsilon, clock
        self.reported: dict[str, set[str]] = {}  # replica -> adapters Ray says it holds
        self.placed: dict[tuple[str, str], float] = {}  # (adapter, replica) -> when sent there unheld
        self.flights: dict[str, _Flight] = {}  # request id -> where it runs
        self.served: dict[str, int] = {}

    def sync(self, held: dict[str, set[str]]) -> None:
        """The live replicas and the adapters each holds, as Ray reports them."""
        self.reported = {replica: set(names) for replica, names in held.items()}
        now = self.clock()
        self.placed = {(a, r): t for (a, r), t in self.placed.items()
                       if r in held and a not in held[r] and now - t < PLACED_GRACE_S}
        self.flights = {rid: f for rid, f in self.flights.items() if f.replica in held}

    def holders(self, adapter: str) -> set[str]:
        now = self.clock()
        recent = {r for (a, r), t in self.placed.items() if a == adapter and now - t < PLACED_GRACE_S}
        return {r for r, names in self.reported.items() if adapter in names} | recent

    def loads(self) -> dict[str, ReplicaLoad]:
        loads = {r: ReplicaLoad(adapters=len(names), served=self.served.get(r, 0)) for r, names in self.reported.items()}
        now = self.clock()
        for (_, replica), t in self.placed.items():
            if replica in loads and now - t < PLACED_GRACE_S:
                loads[replica].adapters += 1
        for flight in self.flights.values():
            if flight.replica in loads and (flight.dispatched or now - flight.since < UNDISPATCHED_S):
                loads[flight.replica].running += 1
                loads[flight.replica].tokens += flight.tokens
        return loads

    def choose(self, request_id: str, adapter: str | None, tokens: int) -> list[str]:
        """The replicas to try for a request, best first (the rest least-loaded first, for when
        the best cannot take it); only the best while it holds the adapter and tries are left.
        Ray asks again for a request none of them took: its earlier choice is no load then."""
        self._forget_undispatched()
        earlier = self.flights.pop(request_id, None)
        if earlier is not None:
            self._unplace(earlier)  # nothing was sent there: it holds nothing for this choice
        loads = self.loads()
        order = sorted(loads, key=lambda r: (loads[r].key(), r))
        if not order:
            return []
        best = self._pick(adapter, loads, order)
        held = adapter is not None and best in self.holders(adapter)
        flight = self.flights[request_id] = _Flight(best, tokens, self.clock(),
                                                    tries=earlier.tries + 1 if earlier is not None else 1)
        flight.placed = adapter if self._note_placed(adapter, best) else None
        if held and flight.tries <= HOLDER_TRIES:
            return [best]
        return [best, *(r for r in order if r != best)]

    def _pick(self, adapter: str | None, loads: dict[str, ReplicaLoad], order: list[str]) -> str:
        if adapter is None:
            return order[0]
        holders = self.holders(adapter)
        within = [r for r in order if r in holders and self._within_bound(loads, r)]
        return within[0] if within else order[0]  # the least-loaded replica is always within the bound

    def _within_bound(self, loads: dict[str, ReplicaLoad], replica: str) -> bool:
        if self.epsilon is None:
            return True
        total = sum(load.running for load in loads.values())
        bound = math.ceil((1 + self.epsilon) * (total + 1) / len(loads))
        return loads[replica].running + 1 <= bound

    def dispatched(self, request_id: str, replica: str, adapter: str | None) -> None:
        """Ray sent the request to `replica` (the chosen one, or a later one when it was full)."""
        flight = self.flights.get(request_id)
        if flight is None:
            return
        if flight.replica != replica:
            self._unplace(flight)
        flight.replica, flight.dispatched = replica, True
        self.served[replica] = self.served.get(replica, 0) + flight.tokens
        self._note_placed(adapter, replica)
        if flight.ended:
            del self.flights[request_id]

    def finished(self, request_id: str, replica: str | None = None) -> None:
        """The request ended (or was refused) on `replica`; a retry meanwhile on another replica
        keeps counting. An end before the dispatch (Ray ends a refused attempt, maybe after it
        asked again for the same replica) ends the flight when it is dispatched: its tries count
        on, and it cannot be left running forever."""
        flight = self.flights.get(request_id)
        if flight is None or (replica is not None and flight.replica != replica):
            return
        if flight.dispatched or replica is None:
            del self.flights[request_id]
        else:
            flight.ended = True

    def _note_placed(self, adapter: str | None, replica: str) -> bool:
        """Whether this placed `adapter` on `replica` (not held there, nor placed before)."""
        if adapter is None or adapter in self.reported.get(replica, ()) or (adapter, replica) in self.placed:
            return False
        self.placed[(adapter, replica)] = self.clock()
        return True

    def _unplace(self, flight: _Flight) -> None:
        if flight.placed is not None:
            self.placed.pop((flight.placed, flight.replica), None)
            flight.placed = None

    def _forget_undispatched(self) -> None:
        """Choices never dispatched (their client left while Ray routed them) stop counting after
        `UNDISPATCHED_S`; they are dropped here."""
        now = self.clock()
        self.flights = {rid: f for rid, f in self.flights.items() if f.dispatched or now - f.since < UNDISPATCHED_S}

    def holds(self, replica: str) -> set[str]:
        """The adapters `replica` holds: as Ray reports them, and placed there since."""
        now = self.clock()
        recent = {a for (a, r), t in self.placed.items() if r == replica and now - t < PLACED_GRACE_S}
        return self.reported.get(replica, set()) | recent


def request_tokens(body: bytes) -> int:
    """A request's size in tokens, estimated: its body's length, plus the output it asks for."""
    prompt = len(body) // BYTES_PER_TOKEN
    if len(body) > PARSED_BODY_BYTES:
        return prompt + DEFAULT_OUTPUT_TOKENS
    try:
        fields = json.loads(body)
        output = fields.get("max_completion_tokens") or fields.get("max_tokens") or DEFAULT_OUTPUT_TOKENS
        n = fields.get("n") or 1
        return prompt + int(output) * int(n)
    except (ValueError, TypeError, AttributeError, OverflowError):  # the replica's app refuses it
        return prompt
