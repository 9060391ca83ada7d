"""Each tenant's limits: sequences per minute, tokens per minute, sequences at once.

Limits count the work, not the HTTP call: a call holding three prompts with `n: 2` is six sequences,
against `requests_per_minute` and `max_concurrent` alike. Rates are token buckets holding a minute's
worth, refilled continuously. A call takes its sequences from the request bucket when it arrives (before
any tokenizing), then, once its prompts are tokenized, reserves its prompt tokens plus `max_tokens` for
each sequence from the token bucket, and at its end gives back what it did not generate: what stays
taken is exactly what it is billed (`/v1/usage`). Past a limit, `RateLimited` says which and for how long
(`Retry-After`); a call that no wait would let through (more than the limit itself) is `TooLarge`.
Buckets live by tenant name, so a reload keeps what a tenant has used.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from loraplex.api.tenancy.tenants import Tenant


class TooLarge(ValueError):
    """The call needs more than the tenant's limit itself: no wait would let it through."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class RateLimited(Exception):
    def __init__(self, message: str, retry_after_s: float, limit: str) -> None:
        super().__init__(message)
        self.retry_after_s, self.limit = retry_after_s, limit  # the setting's name

    @property
    def retry_after(self) -> str:
        """Whole seconds, at least one (the header's form)."""
        return str(max(1, math.ceil(self.retry_after_s)))


@dataclass
class _Bucket:
    level: float
    at: float

    def refill(self, per_minute: int, now: float) -> None:
        self.level = min(float(per_minute), self.level + (now - self.at) * per_minute / 60.0)
        self.at = now

    def wait_for(self, amount: float, per_minute: int) -> float:
        """Seconds until the level reaches `amount`."""
        return max(0.0, (amount - self.level) * 60.0 / per_minute)


@dataclass
class _Usage:
    requests: _Bucket | None = None
    tokens: _Bucket | None = None
    running: int = 0  # sequences


@dataclass
class Lease:
    """One admitted call of `sequences` sequences: reserve its tokens once they are known, count what it
    used, and release it once it ends (what was reserved and not used goes back)."""

    limits: "TenantLimits"
    tenant: Tenant  # with this server's share of each limit
    sequences: int
    whole: Tenant  # the limits as the file gives them
    reserved: int = 0
    used: int = 0
    released: bool = field(default=False)

    def reserve(self, tokens: int, param: str | None = "max_tokens") -> None:
        """Take `tokens` from the token bucket now; past the limit the call ends here with RateLimited
        or TooLarge (its sequences stay counted this minute: its prompts were read and tokenized)."""
        try:
            self.limits._reserve(self, tokens, param)
        except (RateLimited, TooLarge):
            self.limits._release(self.tenant, self.sequences)
            self.released = True
            raise
        self.reserved += tokens

    def use(self, tokens: int) -> None:
        """Tokens billed to the call (its prompts, each token generated)."""
        self.used += tokens

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.limits._settle(self.tenant, self.reserved - self.used)
            self.limits._release(self.tenant, self.sequences)


class TenantLimits:
    """`share`: the part of each limit this server enforces (1 / replicas behind a Ray ingress, each
    replica holding its share of every tenant's limits)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, share: float = 1.0) -> None:
        self.clock, self.share = clock, share
        self._usage: dict[str, _Usage] = {}
        self._lock = threading.Lock()

    def admit(self, tenant: Tenant, sequences: int = 1) -> Lease:
        """A lease for a call of `tenant` running `sequences` sequences; RateLimited past a limit,
        TooLarge for more sequences than a limit allows at all. Behind a Ray ingress a call larger
        than this replica's share of a limit (but not than the limit) waits for a full bucket, or
        for no other sequence running, and then runs."""
        whole, tenant = tenant, self._shared(tenant)
        _check_size(whole, sequences)
        with self._lock:
            now, usage = self.clock(), self._usage.setdefault(tenant.name, _Usage())
            limit = tenant.max_concurrent
            if limit is not None and usage.running and usage.running + sequences > limit:
                raise RateLimited(f"tenant {tenant.name!r} has {usage.running} sequences running; {sequences} more "
                                  f"would pass its limit (max_concurrent {limit})", 1.0, "max_concurrent")
            requests = self._bucket(usage, "requests", tenant.requests_per_minute, now)
            tokens = self._bucket(usage, "tokens", tenant.tokens_per_minute, now)
            if requests is not None and requests.level < min(sequences, tenant.requests_per_minute):
                raise RateLimited(f"tenant {tenant.name!r} is past {tenant.requests_per_minute} requests per minute",
                                  requests.wait_for(min(sequences, tenant.requests_per_minute),
                                                    tenant.requests_per_minute), "requests_per_minute")
            if tokens is not None and tokens.level <= 0:  # in debt: nothing new until the refill
                raise RateLimited(f"tenant {tenant.name!r} is past {tenant.tokens_per_minute} tokens per minute",
                                  tokens.wait_for(1, tenant.tokens_per_minute), "tokens_per_minute")
            if requests is not None:
                requests.level -= sequences
            usage.running += sequences
        return Lease(self, tenant, sequences, whole)

    def _shared(self, tenant: Tenant) -> Tenant:
        if self.share == 1.0:
            return tenant
        part = lambda limit: None if limit is None else max(1, math.ceil(limit * self.share))  # noqa: E731
        return dataclasses.replace(tenant, requests_per_minute=part(tenant.requests_per_minute),
                                   tokens_per_minute=part(tenant.tokens_per_minute),
                                   max_concurrent=part(tenant.max_concurrent))

    def _bucket(self, usage: _Usage, kind: str, per_minute: int | None, now: float) -> _Bucket | None:
        if per_minute is None:
            setattr(usage, kind, None)
            return None
        bucket = getattr(usage, kind)
        if bucket is None:
            bucket = _Bucket(float(per_minute), now)
            setattr(usage, kind, bucket)
        bucket.refill(per_minute, now)
        return bucket

    def _reserve(self, lease: "Lease", tokens: int, param: str | None) -> None:
        tenant, whole = lease.tenant, lease.whole
        if whole.tokens_per_minute is not None and tokens > whole.tokens_per_minute:
            raise TooLarge(f"this call needs {tokens} tokens (its prompts, and max_tokens for each sequence), more "
                           f"than tenant {tenant.name!r} may use in a minute (tokens_per_minute "
                           f"{whole.tokens_per_minute}): lower max_tokens", param)
        limit = tenant.tokens_per_minute
        if limit is None:
            return
        with self._lock:
            bucket, needed = self._bucket(self._usage[tenant.name], "tokens", limit, self.clock()), min(tokens, limit)
            if bucket.level < needed:
                raise RateLimited(f"tenant {tenant.name!r} is past {limit} tokens per minute: this call needs "
                                  f"{tokens}", bucket.wait_for(needed, limit), "tokens_per_minute")
            bucket.level -= tokens

    def _settle(self, tenant: Tenant, unused: int) -> None:
        """Give back what a call reserved and did not use (or take what it used beyond its reservation)."""
        with self._lock:
            bucket = self._usage[tenant.name].tokens
            if bucket is not None and tenant.tokens_per_minute is not None and unused:
                bucket.refill(tenant.tokens_per_minute, self.clock())
                bucket.level = min(float(tenant.tokens_per_minute), bucket.level + unused)

    def _release(self, tenant: Tenant, sequences: int) -> None:
        with self._lock:
            self._usage[tenant.name].running -= sequences

    def running(self, name: str) -> int:
        """Sequences of tenant `name` running now."""
        usage = self._usage.get(name)
        return 0 if usage is None else usage.running


def _check_size(tenant: Tenant, sequences: int) -> None:
    """TooLarge for a call of more sequences than the tenant's limits allow at all."""
    for limit, name, what in ((tenant.max_concurrent, "max_concurrent", "may run at once"),
                              (tenant.requests_per_minute, "requests_per_minute", "may start in a minute")):
        if limit is not None and sequences > limit:
            raise TooLarge(f"this call runs {sequences} sequences (prompts x n), more than tenant {tenant.name!r} "
                           f"{what} ({name} {limit})", "n")
