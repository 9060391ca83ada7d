"""A tenant's call against its limits (api/tenancy/quotas.py), as the API answers it: a lease, or a 429 with
Retry-After (counted and audited), or a 400 for a call larger than the limit itself. Every endpoint that
costs compute goes through here: generation calls for their sequences and tokens, /tokenize, /detokenize
and /v1/validate_schema as one sequence each. Callers other than tenants have no limits (no lease)."""

from __future__ import annotations

import contextlib
from typing import Iterator

from loraplex.api.tenancy.callers import Caller
from loraplex.api.errors import APIError
from loraplex.api.tenancy.quotas import Lease, RateLimited, TooLarge
from loraplex.api.state import ServerState


def admit(state: ServerState, caller: Caller, sequences: int) -> Lease | None:
    """A lease for `sequences` sequences of `caller`'s (None for a caller without limits)."""
    if caller.tenant is None:
        return None
    with refusals(state, caller):
        return state.limits.admit(caller.tenant, max(1, sequences))


def reserve(state: ServerState, caller: Caller, lease: Lease | None, tokens: int) -> None:
    """`tokens` taken from the lease's token bucket; past the limit the lease ends (a 429 or a 400)."""
    if lease is not None:
        with refusals(state, caller):
            lease.reserve(tokens)


@contextlib.contextmanager
def admitted(state: ServerState, caller: Caller, sequences: int) -> Iterator[Lease | None]:
    """The lease for a call, released if the body raises (a call that returns hands it on: a response
    that streams releases it when the stream ends)."""
    lease = admit(state, caller, sequences)
    try:
        yield lease
    except BaseException:
        if lease is not None:
            lease.release()
        raise


@contextlib.contextmanager
def one_call(state: ServerState, caller: Caller) -> Iterator[None]:
    """A short call (tokenize, detokenize, a schema check) held as one sequence while it runs."""
    lease = admit(state, caller, 1)
    try:
        yield
    finally:
        if lease is not None:
            lease.release()


@contextlib.contextmanager
def refusals(state: ServerState, caller: Caller) -> Iterator[None]:
    """RateLimited as a 429 (counted, audited), TooLarge as a 400 naming the field to lower."""
    try:
        yield
    except RateLimited as refused:
        name = caller.tenant.name if caller.tenant is not None else caller.label
        state.metrics.count_rate_limited(name, refused.limit)
        state.audit.write("rate_limited", tenant=name, limit=refused.limit, why=str(refused))
        raise APIError(429, str(refused), retry_after=refused.retry_after) from None
    except TooLarge as refused:
        raise APIError(400, str(refused), refused.param) from None
