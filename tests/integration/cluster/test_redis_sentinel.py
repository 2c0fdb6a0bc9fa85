"""The adapter store through Redis Sentinel (COLLM_REDIS_SENTINELS): real redis-server processes, a
primary, a replica and three Sentinels on loopback ports.

The store finds the primary through the Sentinels; when the primary is SIGKILLed, the Sentinels promote
the replica and the same store object reads every version written before (blobs verified against their
digests) and publishes new ones on the new primary.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from collm_common.settings import CommonSettings
from collm_common.store import AdapterStore, StoreError
from collm_ops.servers import ServerProcess, start_redis, start_redis_sentinel

pytestmark = pytest.mark.integration

T = TypeVar("T")
MASTER = "collm"
ADAPTER = "sentineled"


@dataclass
class SentinelSet:
    primary: ServerProcess
    replica: ServerProcess
    sentinels: list[ServerProcess]

    @property
    def addresses(self) -> str:
        return ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)

    async def master_port(self) -> int:
        """The primary's port as the first Sentinel names it now."""
        client = aioredis.Redis(host="127.0.0.1", port=self.sentinels[0].port, decode_responses=True)
        try:
            _host, port = await client.sentinel_get_master_addr_by_name(MASTER)
        finally:
            await client.aclose()
        return int(port)


@pytest.fixture
def sentinel_set(tmp_path: Path) -> Iterator[SentinelSet]:
    started: list[ServerProcess] = []
    try:
        primary = start_redis(workdir=tmp_path / "primary")
        started.append(primary)
        replica = start_redis(
            workdir=tmp_path / "replica", extra_args=["--replicaof", "127.0.0.1", str(primary.port)]
        )
        started.append(replica)
        sentinels = []
        for i in range(3):
            sentinels.append(start_redis_sentinel(primary.port, tmp_path / f"sentinel{i}", MASTER))
            started.append(sentinels[-1])
        yield SentinelSet(primary, replica, sentinels)
    finally:
        for srv in started:
            srv.stop()


async def wait_until(probe: Callable[[], Awaitable[T]], timeout_s: float, what: str) -> T:
    """`probe()` once it returns something truthy (Redis errors count as not yet)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            value = await probe()
        except (RedisError, StoreError, OSError):
            pass
        else:
            if value:
                return value
        assert time.monotonic() < end, f"timed out after {timeout_s:.0f}s waiting for {what}"
        await asyncio.sleep(0.1)


async def test_the_store_follows_a_sentinel_failover(sentinel_set: SentinelSet, redis_prefix: str) -> None:
    s = sentinel_set
    settings = CommonSettings(
        redis_url="redis://127.0.0.1:1/0",  # only its database counts: the Sentinels name the primary
        redis_sentinels=s.addresses,
        redis_sentinel_master=MASTER,
        redis_prefix=redis_prefix,
    )
    store = AdapterStore.connect(settings)
    try:
        assert await s.master_port() == s.primary.port
        v1 = await store.publish(ADAPTER, b"first", expected_current=None, base_model="tiny", source="test")
        v2 = await store.publish(
            ADAPTER, b"second", expected_current=v1.version, base_model="tiny", source="test"
        )
        # Wait until the replica holds both writes (WAIT: acknowledged by one replica), then lose the primary.
        assert await store.r.execute_command("WAIT", 1, 5000) == 1
        s.primary.kill()
        t_kill = time.monotonic()

        async def promoted() -> bool:
            return await s.master_port() == s.replica.port

        await wait_until(promoted, 30, "the Sentinels to promote the replica")
        t_promoted = time.monotonic()
        # The same store object: reads what was written before the failover ...
        assert await wait_until(lambda: store.current(ADAPTER), 10, "a read after the failover") == v2.version
        assert await store.get_blob(ADAPTER, v1.version) == b"first"
        assert await store.get_blob(ADAPTER, v2.version) == b"second"
        # ... and writes on the new primary.
        v3 = await store.publish(
            ADAPTER, b"third", expected_current=v2.version, base_model="tiny", source="test"
        )
        assert v3.version == v2.version + 1
        assert await store.current(ADAPTER) == v3.version
        direct = AdapterStore.from_url(s.replica.url, redis_prefix)
        try:
            assert await direct.get_blob(ADAPTER, v3.version) == b"third"  # it is the replica that took it
        finally:
            await direct.close()
        print(f"failover: promoted {t_promoted - t_kill:.2f}s after the kill")  # noqa: T201
    finally:
        await store.close()


def test_sentinel_addresses_are_validated() -> None:
    with pytest.raises(ValueError, match="host:port"):
        CommonSettings(redis_sentinels="127.0.0.1")
    assert CommonSettings(redis_sentinels=" a:1, b:2 ").redis_sentinels == " a:1, b:2 "
