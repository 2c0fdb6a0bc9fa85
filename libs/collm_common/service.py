"""One way to start a service.

    def main() -> None:
        run_service("collm-replica", ReplicaSettings(), serve)

    async def serve(ctx: ServiceContext) -> None:
        bus = await ctx.stack.enter_async_context(await Bus.connect(ctx.settings, ctx.name))
        ...                      # enter store, engine, endpoints in order
        ctx.started()              # everything is up
        await ctx.stopping.wait()  # returns on SIGINT/SIGTERM

`run_service` sets up logging, tracing and the metrics endpoint, turns SIGINT/SIGTERM into the
`stopping` event, and unwinds everything `serve` entered on the exit stack in reverse order, whatever
happened. Exit codes: 0 clean stop, 1 failure during start or run, 2 invalid settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from collm_common.clock import Clock, WallClock
from collm_common.logs import setup_logging
from collm_common.metrics_http import start_metrics_server
from collm_common.settings import CommonSettings
from collm_common.tracing import setup_tracing, shutdown_tracing

S = TypeVar("S", bound=CommonSettings)
log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_SETTINGS = 2


@dataclass
class ServiceContext(Generic[S]):
    name: str
    settings: S
    stack: contextlib.AsyncExitStack
    stopping: asyncio.Event
    clock: Clock = field(default_factory=WallClock)
    instance_id: str | None = None
    freeze_heap: bool = False

    def started(self) -> None:
        """`serve` calls it once everything is up, before it waits for `stopping`. In a service process
        (`run_service` sets `freeze_heap`) it collects once and moves every object still alive (imported
        modules, the model, settings: some 420k in a replica) to the collector's permanent generation
        (`gc.freeze`), so that no later full collection walks them: walking them costs a replica
        hundreds of milliseconds with the GIL held (the engine's thread and the event loop stall
        alike), and the interpreter's last collection at exit would delay the process's end. In-process
        tests leave their own heap alone."""
        if self.freeze_heap:
            gc.collect()
            gc.freeze()


async def serve_until_stopped(
    name: str,
    settings: S,
    serve: Callable[[ServiceContext[S]], Awaitable[None]],
    stopping: asyncio.Event | None = None,
    clock: Clock | None = None,
    instance_id: str | None = None,
    freeze_heap: bool = False,
) -> None:
    """Run `serve` inside an exit stack; tests call this directly with their own `stopping` event."""
    stopping = stopping or asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        ctx = ServiceContext(name, settings, stack, stopping, clock or WallClock(), instance_id, freeze_heap)
        await serve(ctx)


def run_service(
    name: str,
    settings_factory: Callable[[], S],
    serve: Callable[[ServiceContext[S]], Awaitable[None]],
    instance_id: Callable[[S], str | None] | None = None,
) -> None:
    """Process entrypoint of a service (see module docstring). Never returns."""
    try:
        settings = settings_factory()
    except Exception as exc:  # pydantic ValidationError: print what to change, exit 2
        sys.stderr.write(f"{name}: invalid settings:\n{exc}\n")
        sys.exit(EXIT_BAD_SETTINGS)
    setup_logging(name, settings.log_level, settings.log_json)
    iid = instance_id(settings) if instance_id else None
    setup_tracing(name, iid)
    if settings.metrics_port is not None:
        start_metrics_server(settings.metrics_port)

    async def main() -> None:
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        await serve_until_stopped(name, settings, serve, stopping, instance_id=iid, freeze_heap=True)

    code = EXIT_OK
    try:
        asyncio.run(main())
        log.info("%s stopped", name)
    except Exception:
        log.exception("%s failed", name)
        code = EXIT_FAILED
    finally:
        shutdown_tracing()
    sys.exit(code)
