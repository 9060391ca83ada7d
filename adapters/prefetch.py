"""The prefetcher: a background thread that brings the adapters of queued requests into slots before the
scheduler reaches them, so that a step never waits on a copy it could have seen coming.

After each schedule the engine core hands it the waiting requests' adapters that hold no slot, in queue order
(`want`); the thread reads each into memory if the CPU cache dropped it (its prepared file, else its folder) and
fills a slot the running step does not use (`AdapterRegistry.preload`), never evicting another queued request's.
The list is bounded by `max_loras`, so what it brings in is bounded by the slots and the CPU cache's budget.
The scheduler admits a request once its adapters are ready (`AdapterRegistry.ready`).

The thread holds the registry weakly and ends when the prefetcher is dropped: an engine nobody closes is still
freed whole.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field

from loraplex.adapters.registry import AdapterRegistry

log = logging.getLogger(__name__)


@dataclass
class _Work:
    """What the engine thread and the prefetcher's share, under `changed`."""

    changed: threading.Condition = field(default_factory=threading.Condition)
    wanted: tuple[str, ...] = ()
    keep: frozenset[str] = frozenset()
    asked: int = 0  # lists handed in
    done: int = 0  # ... and handled
    stopped: bool = False

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            self.changed.notify_all()


class Prefetcher:
    def __init__(self, registry: AdapterRegistry) -> None:
        self._work = _Work()
        self._thread = threading.Thread(target=_run, args=(self._work, weakref.ref(registry)),
                                        name="loraplex-prefetch", daemon=True)
        self._thread.start()
        weakref.finalize(self, self._work.stop)

    def want(self, names: tuple[str, ...], keep: frozenset[str] = frozenset()) -> None:
        """The adapters queued requests wait for, most urgent first (replaces the last list; once a step: slots
        the last step used may be free now); `keep`: adapters of queued requests whose slots no fill may take
        (those already in theirs)."""
        if not names:
            return
        work = self._work
        with work.changed:
            work.wanted, work.keep, work.asked = names, keep, work.asked + 1
            work.changed.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Until every list handed in has been handled (tests); False on timeout."""
        work = self._work
        with work.changed:
            return work.changed.wait_for(lambda: work.done == work.asked or work.stopped, timeout)

    def close(self) -> None:
        self._work.stop()
        self._thread.join(5)


def _run(work: _Work, registry_ref: weakref.ref) -> None:
    while True:
        with work.changed:
            work.changed.wait_for(lambda: work.stopped or work.done < work.asked)
            if work.stopped:
                return
            wanted, keep, asked = work.wanted, work.keep, work.asked
        registry = registry_ref()
        if registry is None:
            return
        _bring_in(registry, wanted, keep)
        del registry
        with work.changed:
            work.done = asked
            work.changed.notify_all()


def _bring_in(registry: AdapterRegistry, wanted: tuple[str, ...], keep: frozenset[str]) -> None:
    """Fill slots for `wanted` in order, where one is free."""
    keep = keep.union(wanted)
    for name in wanted:
        try:
            registry.preload(name, keep)
        except Exception:  # noqa: BLE001  the engine thread meets the same error and answers its request
            log.warning("prefetching adapter %r failed", name, exc_info=True)
