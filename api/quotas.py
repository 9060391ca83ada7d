"""Each tenant's limits: requests per minute, tokens per minute, requests at once.

Rates are token buckets holding a minute's worth, refilled continuously. A request takes one from
the request bucket and needs the token bucket above zero; its tokens (prompt at admission, completion
as generated) are charged as they come, so a long answer can take the bucket below zero and the
tenant's next requests wait for the refill. Past a limit, `RateLimited` says which and for how long
(`Retry-After`). Buckets live by tenant name, so a reload keeps what a tenant has used.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from loraplex.api.tenants import Tenant


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
    running: int = 0


@dataclass
class Lease:
    """One admitted request: charge its tokens as they come, release it once it ends."""

    limits: "TenantLimits"
    tenant: Tenant
    released: bool = field(default=False)

    def charge(self, tokens: int) -> None:
        self.limits._charge(self.tenant, tokens)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.limits._release(self.tenant)


class TenantLimits:
    """`share`: the part of each limit this server enforces (1 / replicas behind a Ray ingress, each
    replica holding its share of every tenant's limits)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, share: float = 1.0) -> None:
        self.clock, self.share = clock, share
        self._usage: dict[str, _Usage] = {}
        self._lock = threading.Lock()

    def admit(self, tenant: Tenant, prompt_tokens: int = 0) -> Lease:
        """A lease for one request of `tenant`, its prompt charged; RateLimited past a limit."""
        tenant = self._shared(tenant)
        with self._lock:
            now, usage = self.clock(), self._usage.setdefault(tenant.name, _Usage())
            if tenant.max_concurrent is not None and usage.running >= tenant.max_concurrent:
                raise RateLimited(f"tenant {tenant.name!r} has {usage.running} requests running, its limit "
                                  f"(max_concurrent)", 1.0, "max_concurrent")
            requests = self._bucket(usage, "requests", tenant.requests_per_minute, now)
            tokens = self._bucket(usage, "tokens", tenant.tokens_per_minute, now)
            if requests is not None and requests.level < 1:
                raise RateLimited(f"tenant {tenant.name!r} is past {tenant.requests_per_minute} requests per "
                                  f"minute", requests.wait_for(1, tenant.requests_per_minute), "requests_per_minute")
            if tokens is not None and tokens.level <= 0:
                raise RateLimited(f"tenant {tenant.name!r} is past {tenant.tokens_per_minute} tokens per minute",
                                  tokens.wait_for(1, tenant.tokens_per_minute), "tokens_per_minute")
            if requests is not None:
                requests.level -= 1
            if tokens is not None:
                tokens.level -= prompt_tokens
            usage.running += 1
        return Lease(self, tenant)

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

    def _charge(self, tenant: Tenant, tokens: int) -> None:
        with self._lock:
            bucket = self._usage[tenant.name].tokens
            if bucket is not None and tenant.tokens_per_minute is not None:
                bucket.refill(tenant.tokens_per_minute, self.clock())
                bucket.level -= tokens

    def _release(self, tenant: Tenant) -> None:
        with self._lock:
            self._usage[tenant.name].running -= 1

    def running(self, name: str) -> int:
        usage = self._usage.get(name)
        return 0 if usage is None else usage.running
