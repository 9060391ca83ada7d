"""The values and errors an `EngineClient` speaks in besides requests and outputs: its health, a structured spec's
check, and why a request was refused or ended. The API names them through `engine_client`."""

from __future__ import annotations

from dataclasses import dataclass


class EngineDeadError(RuntimeError):
    """The engine takes no requests: shutting down (the message says so) or failed."""


class StepFailedError(RuntimeError):
    """An engine step raised; the requests in its batch were aborted, the engine goes on."""


class ClientTooSlowError(RuntimeError):
    """A reader left more than `max_unread_outputs` outputs unread; its request was aborted."""


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_waiting_requests`; the caller should retry later."""


@dataclass(frozen=True)
class Health:
    alive: bool  # the engine thread runs and never failed
    closing: str | None = None  # why new requests are refused (shutting down)
    warming: str | None = None  # what is still starting (alive, but not ready: `/ready` says 503)

    @property
    def problem(self) -> str | None:
        """None when requests are taken; else what to tell a client."""
        if self.closing is not None:
            return self.closing
        return None if self.alive else "the engine failed; see the server log"


@dataclass(frozen=True)
class StructuredCheck:
    """A structured-output spec that compiles: the backend that took it, and the keywords a
    non-strict schema had to drop."""

    backend: str
    unenforced: tuple[str, ...] = ()
