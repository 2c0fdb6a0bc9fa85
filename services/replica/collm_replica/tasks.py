"""The replica's background tasks: one set, owned by the worker, cancelled together when it stops."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any


class Tasks:
    """Tasks spawned on the service's event loop (handlers, loops, uploads) until `cancel_all`.

    `spawn_threadsafe` is the way in from other threads (the engine's): after `cancel_all` has begun it
    spawns nothing, so nothing outlives the stop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.stopping = False

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def spawn_threadsafe(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Spawn `make()` (a coroutine factory) on the loop from any thread, unless stopping."""
        if not self.stopping:
            self.loop.call_soon_threadsafe(lambda: self.spawn(make()))

    async def cancel_all(self) -> None:
        self.stopping = True
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t
