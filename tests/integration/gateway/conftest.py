"""Gateway integration fixtures: a real NATS and Redis, the gateway app, and replica doubles.

The app runs in-process (httpx's ASGITransport with the app's lifespan entered), or under a real uvicorn
on a free port when a test needs real connections (client disconnects). Replica doubles talk over their
own NATS connection, as separate processes would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from doubles.replica import ReplicaBehaviour, ReplicaDouble
from fastapi import FastAPI
from openai import AsyncOpenAI

from collm_common.bus import Bus
from collm_common.settings import CommonSettings
from collm_common.store import AdapterStore
from collm_gateway.app import GatewayState, build_app
from collm_gateway.settings import GatewaySettings
from collm_ops.servers import free_port

BASE_MODEL = "collm-test-base"


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not check():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class Gateway:
    app: FastAPI
    state: GatewayState
    http: httpx.AsyncClient
    openai: AsyncOpenAI
    base_url: str

    async def wait_replicas(self, *replica_ids: str) -> None:
        await eventually(
            lambda: set(replica_ids) <= set(self.state.cluster.fresh_replicas()),
            what=f"telemetry from {replica_ids}",
        )


@pytest.fixture
async def store(redis_server, redis_prefix) -> AsyncIterator[AdapterStore]:
    s = AdapterStore.from_url(redis_server.url, redis_prefix)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def replica_bus(nats_server) -> AsyncIterator[Bus]:
    bus = await Bus.connect(CommonSettings(nats_url=nats_server.url, nats_connect_timeout_s=5), "doubles")
    try:
        yield bus
    finally:
        await bus.close()


@pytest.fixture
async def replicas(replica_bus) -> AsyncIterator[Callable[..., Awaitable[ReplicaDouble]]]:
    """`await replicas("r0", ReplicaBehaviour(...), adapters={...})` starts a double; all stop afterwards."""
    made: list[ReplicaDouble] = []

    async def make(replica_id: str, behaviour: ReplicaBehaviour | None = None, **kw: Any) -> ReplicaDouble:
        double = await ReplicaDouble(replica_bus, replica_id, behaviour, **kw).start()
        made.append(double)
        return double

    try:
        yield make
    finally:
        for double in made:
            await double.stop()


def gateway_settings(nats_server, redis_server, redis_prefix, **overrides: Any) -> GatewaySettings:
    values: dict[str, Any] = {
        "nats_url": nats_server.url,
        "redis_url": redis_server.url,
        "redis_prefix": redis_prefix,
        "nats_connect_timeout_s": 5,
        "gateway_id": "gw-test",
        "base_model": BASE_MODEL,
        "first_event_timeout_s": 1.0,
        "models_cache_ttl_s": 0.0,
        "telemetry_stale_s": 2.0,
    }
    values.update(overrides)
    return GatewaySettings(**values)


@pytest.fixture
async def make_gateway(nats_server, redis_server, redis_prefix, store):
    """`async with make_gateway(**settings) as gw:` an in-process gateway with its lifespan running."""
    buses: list[Bus] = []

    @contextlib.asynccontextmanager
    async def make(**overrides: Any) -> AsyncIterator[Gateway]:
        settings = gateway_settings(nats_server, redis_server, redis_prefix, **overrides)
        bus = await Bus.connect(settings, "collm-gateway-test")
        buses.append(bus)
        app = build_app(settings, bus, store)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
                client = AsyncOpenAI(
                    base_url="http://gateway/v1", api_key="test-key", http_client=http, max_retries=0
                )
                yield Gateway(app, app.state.gateway, http, client, "http://gateway")

    try:
        yield make
    finally:
        for bus in buses:
            await bus.close()


@pytest.fixture
async def gateway(make_gateway) -> AsyncIterator[Gateway]:
    async with make_gateway() as gw:
        yield gw


@pytest.fixture
async def make_served_gateway(nats_server, redis_server, redis_prefix, store):
    """A gateway behind a real uvicorn on a free port (real sockets, real disconnects)."""
    buses: list[Bus] = []

    @contextlib.asynccontextmanager
    async def make(**overrides: Any) -> AsyncIterator[Gateway]:
        port = free_port()
        settings = gateway_settings(
            nats_server, redis_server, redis_prefix, host="127.0.0.1", port=port, **overrides
        )
        bus = await Bus.connect(settings, "collm-gateway-test")
        buses.append(bus)
        app = build_app(settings, bus, store)
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", log_config=None, access_log=False)
        )
        task = asyncio.create_task(server.serve())
        try:
            await eventually(lambda: server.started, what="uvicorn start")
            base_url = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
                client = AsyncOpenAI(
                    base_url=f"{base_url}/v1", api_key="test-key", http_client=http, max_retries=0
                )
                yield Gateway(app, app.state.gateway, http, client, base_url)
        finally:
            server.should_exit = True
            await task

    try:
        yield make
    finally:
        for bus in buses:
            await bus.close()
