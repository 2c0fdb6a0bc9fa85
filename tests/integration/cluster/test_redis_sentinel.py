"""The adapter store through Redis Sentinel (COLLM_REDIS_SENTINELS), on real redis-server processes with
the shipped cluster configuration: a primary and a replica with the ACL users of deploy/redis/users.acl
and deploy/cluster/users-cluster.acl (rendered by deploy/redis/render-acl.sh) and the replication
login, and three Sentinels configured by deploy/cluster/redis-sentinel.sh's template (with loopback
addresses and a log file each). The shipped 5 s before a primary counts as down is kept: with 1 s,
one traced failure on a loaded machine ended with the old primary, back with its stale data, as the
primary again and the promoted replica following it, so that the version published after the failover
was gone.

The store, logged in as the aggregator's Redis user, finds the primary through the Sentinels. When the
primary is SIGKILLed, the Sentinels promote the replica, and the same store object reads every version
written before (blobs verified against their digests) and publishes a new one on the new primary. The
old primary, started again, is turned into a replica of the new one.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from collm_common.settings import CommonSettings
from collm_common.store import AdapterStore, StoreError
from collm_ops.servers import ServerProcess, free_port, start_redis, start_redis_sentinel

pytestmark = pytest.mark.integration

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[3]
MASTER = "collm"
# A returning old primary is converted by the Sentinels only when their INFO poll sees it as a master
# (every 10 s for an instance whose master is healthy), and the new primary then waits
# repl-diskless-sync-delay (5 s by default) before streaming the full sync: up to 15 s by protocol, plus
# time for the transfer on a loaded machine.
CATCH_UP_S = 10 + 5 + 15
ADAPTER = "sentineled"
PASSWORDS = {
    "REDIS_PASSWORD": "p-default",
    "REDIS_PASSWORD_AGGREGATOR": "p-aggregator",
    "REDIS_PASSWORD_REPLICA": "p-replica",
    "REDIS_PASSWORD_GATEWAY": "p-gateway",
    "REDIS_PASSWORD_READER": "p-reader",
    "REDIS_PASSWORD_REPLICATION": "p-replication",
    "REDIS_PASSWORD_SENTINEL": "p-sentinel-user",
    "REDIS_SENTINEL_PASSWORD": "p-sentinels",
}


def render_acl(prefix: str, out: Path) -> Path:
    """users.acl + users-cluster.acl rendered as the compose overlay renders them."""
    env = {**os.environ, **PASSWORDS, "COLLM_REDIS_PREFIX": prefix}
    render = ROOT / "deploy/redis/render-acl.sh"
    parts = [
        subprocess.run(
            ["sh", str(render), str(ROOT / f)], env=env, check=True, capture_output=True, text=True
        ).stdout
        for f in ("deploy/redis/users.acl", "deploy/cluster/users-cluster.acl")
    ]
    out.write_text("".join(parts))
    return out


def sentinel_config(d: Path, port: int, primary_port: int) -> Path:
    """deploy/cluster/redis-sentinel.sh's configuration with loopback addresses and `port`."""
    script = (ROOT / "deploy/cluster/redis-sentinel.sh").read_text()
    template = script.split("<<CONF\n", 1)[1].split("\nCONF\n", 1)[0]
    text = (
        template.replace("port 26379", f"port {port}\nbind 127.0.0.1")
        .replace("dir /data", f"dir {d}")
        .replace("$1", "127.0.0.1")
        .replace("$REDIS_SENTINEL_PASSWORD", PASSWORDS["REDIS_SENTINEL_PASSWORD"])
        .replace("$REDIS_PASSWORD_SENTINEL", PASSWORDS["REDIS_PASSWORD_SENTINEL"])
        .replace(f"{MASTER} $primary 6379", f"{MASTER} 127.0.0.1 {primary_port}")
    )
    assert f"127.0.0.1 {primary_port} 2" in text and "$" not in text, text
    d.mkdir(parents=True, exist_ok=True)
    conf = d / "sentinel.conf"
    conf.write_text(text + f"\nlogfile {d / 'sentinel.log'}\n")
    return conf


@dataclass
class SentinelSet:
    primary: ServerProcess
    replica: ServerProcess
    sentinels: list[ServerProcess]

    @property
    def addresses(self) -> str:
        return ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)

    def sentinel(self) -> aioredis.Redis:
        return aioredis.Redis(
            host="127.0.0.1",
            port=self.sentinels[0].port,
            password=PASSWORDS["REDIS_SENTINEL_PASSWORD"],
            decode_responses=True,
        )

    async def master_port(self) -> int:
        """The primary's port as the first Sentinel names it now."""
        client = self.sentinel()
        try:
            _host, port = await client.sentinel_get_master_addr_by_name(MASTER)
        finally:
            await client.aclose()
        return int(port)

    async def healthy_replicas(self) -> list[int]:
        """Ports of the replicas the first Sentinel sees up."""
        client = self.sentinel()
        try:
            replicas = await client.sentinel_slaves(MASTER)
        finally:
            await client.aclose()
        return sorted(int(r["port"]) for r in replicas if not r.get("is_sdown") and not r.get("is_odown"))


@pytest.fixture
def sentinel_set(tmp_path: Path, redis_prefix: str) -> Iterator[SentinelSet]:
    acl = render_acl(redis_prefix, tmp_path / "users.acl")
    login = [
        "--aclfile", str(acl),
        "--masteruser", "collm-replication",
        "--masterauth", PASSWORDS["REDIS_PASSWORD_REPLICATION"],
        "--replica-announce-ip", "127.0.0.1",
    ]  # fmt: skip
    started: list[ServerProcess] = []
    try:
        primary = start_redis(workdir=tmp_path / "primary", extra_args=login)
        started.append(primary)
        replica = start_redis(
            workdir=tmp_path / "replica", extra_args=[*login, "--replicaof", "127.0.0.1", str(primary.port)]
        )
        started.append(replica)
        sentinels = []
        for i in range(3):
            port = free_port()
            conf = sentinel_config(tmp_path / f"sentinel{i}", port, primary.port)
            sentinels.append(start_redis_sentinel(conf, port))
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


def reader_on(srv: ServerProcess, prefix: str) -> AdapterStore:
    """The store on one data node, logged in as the read-only user."""
    url = f"redis://collm-reader:{PASSWORDS['REDIS_PASSWORD_READER']}@127.0.0.1:{srv.port}/0"
    return AdapterStore.from_url(url, prefix)


async def test_the_store_follows_a_sentinel_failover(sentinel_set: SentinelSet, redis_prefix: str) -> None:
    s = sentinel_set
    settings = CommonSettings(
        redis_url="redis://collm-aggregator@127.0.0.1:1/0",  # user and db count; the Sentinels name the host
        redis_password=PASSWORDS["REDIS_PASSWORD_AGGREGATOR"],
        redis_sentinels=s.addresses,
        redis_sentinel_master=MASTER,
        redis_sentinel_password=PASSWORDS["REDIS_SENTINEL_PASSWORD"],
        redis_prefix=redis_prefix,
    )
    store = AdapterStore.connect(settings)
    on_replica = reader_on(s.replica, redis_prefix)
    on_old_primary = reader_on(s.primary, redis_prefix)
    try:
        await wait_until(lambda: s.healthy_replicas(), 15, "the Sentinels to see the replica")
        assert await s.master_port() == s.primary.port
        v1 = await store.publish(ADAPTER, b"first", expected_current=None, base_model="tiny", source="test")
        v2 = await store.publish(
            ADAPTER, b"second", expected_current=v1.version, base_model="tiny", source="test"
        )
        # The replica holds both (replication logs in as collm-replication), then the primary is lost.
        await wait_until(lambda: on_replica.current(ADAPTER), 10, "the writes on the replica")
        assert await on_replica.get_blob(ADAPTER, v2.version) == b"second"
        s.primary.kill()
        t_kill = time.monotonic()

        async def promoted() -> bool:
            return await s.master_port() == s.replica.port

        await wait_until(promoted, 30, "the Sentinels to promote the replica (as collm-sentinel)")
        t_promoted = time.monotonic()
        # The same store object reads what was written before the failover ...
        assert await wait_until(lambda: store.current(ADAPTER), 10, "a read after the failover") == v2.version
        assert await store.get_blob(ADAPTER, v1.version) == b"first"
        assert await store.get_blob(ADAPTER, v2.version) == b"second"
        # ... and publishes on the new primary, the former replica.
        v3 = await store.publish(
            ADAPTER, b"third", expected_current=v2.version, base_model="tiny", source="test"
        )
        t_written = time.monotonic()
        assert await on_replica.get_blob(ADAPTER, v3.version) == b"third"
        # The old primary comes back as a replica of the new one, and catches up.
        await asyncio.to_thread(s.primary.restart)
        await wait_until(
            lambda: _has(s, s.primary.port),
            30,
            "the old primary to come back as a replica (REPLICAOF, CONFIG REWRITE)",
        )
        t_back = time.monotonic()
        await wait_until(
            lambda: _current_is(on_old_primary, v3.version), CATCH_UP_S, "the old primary to catch up"
        )
        # The operator's `collm adapters` finds the primary through the same Sentinels.
        versions = await asyncio.to_thread(collm_versions, s, redis_prefix)
        assert [v["version"] for v in versions] == [v1.version, v2.version, v3.version], versions
        print(  # noqa: T201
            f"sentinel failover: promoted {t_promoted - t_kill:.2f} s after the kill, "
            f"first write on the new primary {t_written - t_kill:.2f} s after it, "
            f"old primary caught up {time.monotonic() - t_back:.2f} s after it was back"
        )
    finally:
        for st in (store, on_replica, on_old_primary):
            await st.close()


def collm_versions(s: SentinelSet, prefix: str) -> list[dict[str, Any]]:
    """`collm adapters versions ADAPTER --json` with the Sentinels in its environment, as the reader."""
    env = {
        **os.environ,
        "COLLM_REDIS_URL": f"redis://collm-reader:{PASSWORDS['REDIS_PASSWORD_READER']}@127.0.0.1:1/0",
        "COLLM_REDIS_SENTINELS": s.addresses,
        "COLLM_REDIS_SENTINEL_MASTER": MASTER,
        "COLLM_REDIS_SENTINEL_PASSWORD": PASSWORDS["REDIS_SENTINEL_PASSWORD"],
        "COLLM_REDIS_PREFIX": prefix,
    }
    cmd = [sys.executable, "-m", "collm_ops", "adapters", "versions", ADAPTER, "--json"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


async def _has(s: SentinelSet, port: int) -> bool:
    return port in await s.healthy_replicas()


async def _current_is(store: AdapterStore, version: int) -> bool:
    return await store.current(ADAPTER) == version


def test_sentinel_addresses_are_validated() -> None:
    with pytest.raises(ValueError, match="host:port"):
        CommonSettings(redis_sentinels="127.0.0.1")
    assert CommonSettings(redis_sentinels=" a:1, b:2 ").redis_sentinels == " a:1, b:2 "
