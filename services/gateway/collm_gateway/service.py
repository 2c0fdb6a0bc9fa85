"""The gateway process: bus, store, then uvicorn serving the app until SIGINT/SIGTERM.

uvicorn runs inside `run_service`'s exit stack: it takes the signals while it serves (and re-raises
them when it returns, which sets `stopping`), drains open connections, runs the app's lifespan
shutdown, and only then are the store and the bus closed, in reverse order of opening. Open dashboard
event streams never end on their own, so they are ended as the shutdown begins (`GatewayServer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable

import uvicorn

from collm_common.bus import Bus
from collm_common.service import ServiceContext
from collm_common.store import AdapterStore
from collm_gateway.app import build_app
from collm_gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


class GatewayServer(uvicorn.Server):
    """uvicorn, calling `on_shutdown` before it waits for open responses to finish."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.on_shutdown()
        await super().shutdown(sockets)


async def serve(ctx: ServiceContext[GatewaySettings]) -> None:
    s = ctx.settings
    bus = await ctx.stack.enter_async_context(await Bus.connect(s, f"{ctx.name}-{s.gateway_id}"))
    store = AdapterStore.connect(s)
    ctx.stack.push_async_callback(store.close)
    app = build_app(s, bus, store, clock=ctx.clock)
    config = uvicorn.Config(
        app,
        host=s.host,
        port=s.port,
        lifespan="on",
        log_config=None,  # keep CoLLM's JSON logging
        access_log=False,  # one structured line per completion comes from the gateway itself
        timeout_graceful_shutdown=10,
    )
    dashboard = app.state.gateway.dashboard
    server = GatewayServer(config, dashboard.close_streams if dashboard is not None else lambda: None)

    async def run_server() -> None:
        try:
            await server.serve()
        except SystemExit as exc:  # uvicorn exits the process when it cannot start (port taken, ...)
            raise RuntimeError(
                f"HTTP server failed to start on {s.host}:{s.port} (exit {exc.code})"
            ) from None

    server_task = asyncio.create_task(run_server(), name="uvicorn")
    stop_task = asyncio.create_task(ctx.stopping.wait(), name="stopping")
    ctx.started()
    try:
        await asyncio.wait({server_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        server.should_exit = True
        stop_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stop_task
    await server_task
    if not server.started:
        raise RuntimeError(f"HTTP server on {s.host}:{s.port} did not start")
