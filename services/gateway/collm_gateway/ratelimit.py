"""Per-key rate limits: a token bucket per API key (pure; the caller passes the time).

A bucket holds at most `burst` tokens and refills at `rate_per_s`; each request takes one. A request
that finds no token is refused and told how long until one is there (`Retry-After`). Time is a
monotonic reading in seconds handed in by the caller, so tests drive it without sleeping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class TokenBucket:
    rate_per_s: float
    burst: int
    tokens: float
    updated_s: float

    @classmethod
    def full(cls, rate_per_s: float, burst: int, now_s: float) -> TokenBucket:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("a token bucket needs rate_per_s > 0 and burst >= 1")
        return cls(rate_per_s, burst, float(burst), now_s)

    def take(self, now_s: float, cost: float = 1.0) -> float:
        """Take `cost` tokens. Returns 0.0 when taken, else the seconds until they would be there."""
        elapsed_s = max(0.0, now_s - self.updated_s)  # a clock that steps back never mints tokens
        self.tokens = min(float(self.burst), self.tokens + elapsed_s * self.rate_per_s)
        self.updated_s = max(self.updated_s, now_s)
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.rate_per_s


def default_burst(rate_per_s: float) -> int:
    """One second's worth of requests, at least one."""
    return max(1, math.ceil(rate_per_s))


class RateLimiter:
    """One bucket per key id; a key's limits may change (a reloaded key file) and its bucket follows."""

    def __init__(self) -> None:
        self._buckets: dict[str, TokenBucket] = {}

    def take(self, key_id: str, rate_per_s: float, burst: int, now_s: float) -> float:
        bucket = self._buckets.get(key_id)
        if bucket is None or bucket.rate_per_s != rate_per_s or bucket.burst != burst:
            fresh = TokenBucket.full(rate_per_s, burst, now_s)
            if bucket is not None:  # new limits, but no fresh burst for a key that had used its tokens
                bucket.take(now_s, 0.0)
                fresh.tokens = min(fresh.tokens, bucket.tokens)
            bucket = self._buckets[key_id] = fresh
        return bucket.take(now_s)

    def forget_except(self, key_ids: set[str]) -> None:
        """Drop the buckets of keys that no longer exist (bounded memory across key reloads)."""
        for k in [k for k in self._buckets if k not in key_ids]:
            del self._buckets[k]


def retry_after_s(wait_s: float) -> int:
    """`Retry-After` is whole seconds: round up, at least 1."""
    return max(1, math.ceil(wait_s))
