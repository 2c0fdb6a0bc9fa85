"""Dashboard fixtures: the gateway under its own uvicorn server (`GatewayServer`) on a free port, with a
real NATS and Redis, and a reader of server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from collm_common.bus import Bus
from collm_common.settings import CommonSettings
from collm_common.store import AdapterStore
from collm_gateway.app import GatewayState, build_app
from collm_gateway.service import GatewayServer
from collm_gateway.settings import GatewaySettings
from collm_ops.servers import free_port

BASE_MODEL = "collm-test-base"


@dataclass
class Event:
    name: str
    data: dict[str, Any]


class EventReader:
    """Parses a `text/event-stream` body into events (comments and `retry:` lines are skipped)."""

    def __init__(self, resp: httpx.Response) -> None:
        self.resp = resp
        self._lines = resp.aiter_lines()

    async def next(self, timeout_s: float = 10.0) -> Event:
        async def read() -> Event:
            name, data = "message", ""
            async for line in self._lines:
                if line == "":
                    if data:
                        return Event(name, json.loads(data))
                    name = "message"
                elif line.startswith("event: "):
                    name = line[len("event: ") :]
                elif line.startswith("data: "):
                    data += line[len("data: ") :]
            raise EOFError("the event stream ended")

        return await asyncio.wait_for(read(), timeout_s)

    async def until(self, pred: Any, timeout_s: float = 10.0) -> tuple[Event, list[Event]]:
        """The first event for which `pred(event)` holds, and every event before it."""
        seen: list[Event] = []
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while True:
            ev = await self.next(max(0.01, end - loop.time()))
            if pred(ev):
                return ev, seen
            seen.append(ev)


@dataclass
class Served:
    base_url: str
    state: GatewayState
    server: uvicorn.Server
    task: asyncio.Task[None]
    bus: Bus  # another connection, publishing as the services would


@pytest.fixture
async def store(redis_server, redis_prefix) -> AsyncIterator[AdapterStore]:
    s = AdapterStore.from_url(redis_server.url, redis_prefix)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def serve(nats_server, redis_server, redis_prefix, store):
    """`async with serve(**settings) as gw:` a gateway on a free port, stopped (streams ended) on exit."""
    pub = await Bus.connect(CommonSettings(nats_url=nats_server.url, nats_connect_timeout_s=5), "publisher")

    @contextlib.asynccontextmanager
    async def make(**overrides: Any) -> AsyncIterator[Served]:
        port = free_port()
        settings = GatewaySettings(
            nats_url=nats_server.url,
            redis_url=redis_server.url,
            redis_prefix=redis_prefix,
            nats_connect_timeout_s=5,
            gateway_id="gw-dashboard",
            base_model=BASE_MODEL,
            host="127.0.0.1",
            port=port,
            **overrides,
        )
        bus = await Bus.connect(settings, "collm-gateway-test")
        app = build_app(settings, bus, store)
        state: GatewayState = app.state.gateway
        assert state.dashboard is not None
        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, lifespan="on", log_config=None, access_log=False
        )
        server = GatewayServer(config, state.dashboard.close_streams)
        task = asyncio.create_task(server.serve())
        try:
            loop = asyncio.get_running_loop()
            end = loop.time() + 10
            while not server.started:
                assert loop.time() < end, "uvicorn did not start"
                await asyncio.sleep(0.02)
            yield Served(f"http://127.0.0.1:{port}", state, server, task, pub)
        finally:
            server.should_exit = True
            await task
            await bus.close()

    try:
        yield make
    finally:
        await pub.close()
