"""Injectable time.

Services take a `Clock` instead of calling `time.time()`, `time.monotonic()` or `asyncio.sleep`, so
round deadlines, control ticks and telemetry windows are testable without sleeping: tests pass a
`VirtualClock` and move it with `advance()`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Wall time, seconds since the Unix epoch (for timestamps that cross processes)."""
        ...

    def monotonic(self) -> float:
        """Monotonic seconds (for durations and scheduling inside one process)."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class WallClock:
    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class VirtualClock:
    """A clock that moves only when told; sleepers wake in deadline order as time passes them."""

    def __init__(self, start_s: float = 1_700_000_000.0) -> None:
        self._start = start_s
        self._elapsed = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._start + self._elapsed

    def monotonic(self) -> float:
        return self._elapsed

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._elapsed + seconds, next(self._seq), fut))
        await fut

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has passed."""
        self._elapsed += seconds
        while self._sleepers and self._sleepers[0][0] <= self._elapsed:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    async def run_for(self, seconds: float, step_s: float = 0.01) -> None:
        """Advance in steps, yielding to the event loop between steps so woken tasks can run."""
        end = self._elapsed + seconds
        while self._elapsed < end:
            self.advance(min(step_s, end - self._elapsed))
            for _ in range(5):
                await asyncio.sleep(0)
