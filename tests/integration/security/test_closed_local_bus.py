"""The launcher's own NATS is closed: no phantom replica from the host.

The launcher (what `collm up` runs) starts its own nats-server and redis-server on free ports, with one
replica `r0` (tiny model), the coordinator, the aggregator and the gateway, each logged in as its own
user of deploy/nats/auth.conf with the run directory's passwords. Then, while the stack's own telemetry
keeps flowing, telemetry for a replica `r9` that does not exist is published every way a process on the
host could: without credentials, with a wrong password, with the gateway's credentials (a service that
may publish no telemetry), and with replica r0's credentials (on r9's subject, which the server refuses,
and on r0's own subject naming r9, which the readers drop). Neither the gateway's cluster view (`/readyz`)
nor the coordinator's (`status`) ever lists r9. Last, the operator (`admin`, the login in
`<run_dir>/nats-auth/operator.env`) publishes the same telemetry on r9's own subject and the gateway does
list r9: the probes see a phantom when one gets through. `collm micro ls` works with the operator's login
and is refused without it, and no password appears in the launcher's log.

A NATS that already answers is used as configured, even with a run directory that holds a local bus
(the launcher then names that directory: a nats-server left by an earlier run would refuse the services).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client

from collm_common import subjects
from collm_common.bus import Bus, inbox_prefix
from collm_common.wire import encode
from collm_common.wire.control import CoordinatorStatus, CoordinatorStatusRequest
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_ops import local_bus
from collm_ops.launcher import ReplicaSpec, Stack, StackConfig
from collm_ops.servers import ServerProcess, free_port
from tests.integration.security.conftest import running

pytestmark = pytest.mark.integration
PHANTOM = "r9"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp_path = tmp_path_factory.mktemp("closed-local")
    cfg = StackConfig(
        nats_url=f"nats://127.0.0.1:{free_port()}",
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        model="tiny",
        gateway_port=free_port(),
        replicas=[ReplicaSpec("r0", env={"COLLM_TELEMETRY_INTERVAL_S": "0.5"})],
        run_dir=tmp_path / "run",
        ready_timeout_s=240,
        service_env={
            "coordinator": {"COLLM_COORDINATOR_FAST_INTERVAL_S": "0.5", "COLLM_COORDINATOR_WARMUP_S": "1"}
        },
    )
    with running(cfg) as s:
        yield s


def phantom(replica_id: str = PHANTOM) -> bytes:
    """Telemetry that would make the router rank `replica_id` first: idle, fast, fresh."""
    t = ReplicaTelemetry(
        replica_id=replica_id, ts_unix_s=time.time(), interval_s=0.5, model="tiny", max_batch=64
    )
    return encode(t)


async def login(url: str, user: str, password: str, errors: list[str]) -> Client:
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return await nats.connect(
        url,
        user=user,
        password=password,
        inbox_prefix=inbox_prefix(user),
        error_cb=on_error,
        allow_reconnect=False,
        connect_timeout=2,
    )


async def refused_login(url: str, **auth: str) -> str:
    async def ignore(_exc: Exception) -> None:
        return None

    with pytest.raises(Exception) as caught:  # noqa: PT011 - nats-py raises its own error classes
        nc = await nats.connect(
            url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0, error_cb=ignore, **auth
        )
        await nc.close()
    return str(caught.value)


def ready_replicas(stack: Stack) -> list[str]:
    r = httpx.get(f"{stack.gateway_url}/readyz", timeout=5)
    assert r.status_code == 200, r.text
    return sorted(r.json()["replicas"])


def collm_micro_ls(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("COLLM_NATS", "NATS_"))}
    return subprocess.run(
        # Answers gathered for 3 s: a replica busy on a loaded machine answers the ping late.
        [sys.executable, "-m", "collm_ops", "micro", "ls", "--json", "--timeout", "3"],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_no_phantom_replica_from_the_host(stack: Stack) -> None:
    assert stack.local_bus is not None
    url = stack.config.nats_url
    passwords = json.loads((stack.local_bus.directory / local_bus.CREDENTIALS_FILE).read_text())
    assert passwords == stack.local_bus.passwords

    # Nobody logs in without credentials, or with a wrong password.
    anonymous = await refused_login(url)
    wrong = await refused_login(url, user="replica-r0", password="p" + "0" * 32)
    assert "authorization" in anonymous.lower() and "authorization" in wrong.lower(), (anonymous, wrong)

    gw_errors: list[str] = []
    r0_errors: list[str] = []
    as_gateway = await login(url, "gateway", passwords["gateway"], gw_errors)
    as_r0 = await login(url, "replica-r0", passwords["replica-r0"], r0_errors)
    operator = await Bus.connect(stack.operator_settings(nats_connect_timeout_s=10), "test-operator")
    seen: dict[str, int] = {}

    async def on_telemetry(t: ReplicaTelemetry, _m: object) -> None:
        seen[t.replica_id] = seen.get(t.replica_id, 0) + 1

    await operator.subscribe(subjects.telemetry_all(), ReplicaTelemetry, on_telemetry)

    async def coordinator_view() -> tuple[list[str], list[str]]:
        st = await operator.request(
            subjects.coordinator("status"), CoordinatorStatusRequest(), CoordinatorStatus, 10
        )
        return sorted(st.live), sorted(st.stale)

    try:
        deadline = time.monotonic() + 20
        while (await coordinator_view())[0] != ["r0"]:
            assert time.monotonic() < deadline, "the coordinator never saw r0 live"
            await asyncio.sleep(0.5)

        # 4 s of phantom telemetry, every way but the operator's, 4 times a second.
        t_end = time.monotonic() + 4
        views: list[tuple[list[str], list[str], list[str]]] = []
        while time.monotonic() < t_end:
            await as_gateway.publish(subjects.telemetry(PHANTOM), phantom())
            await as_gateway.publish(subjects.telemetry("r0"), phantom())
            await as_r0.publish(subjects.telemetry(PHANTOM), phantom())
            await as_r0.publish(subjects.telemetry("r0"), phantom())  # allowed; names r9: dropped
            await as_gateway.flush()
            await as_r0.flush()
            await asyncio.sleep(0.25)
            live, stale = await coordinator_view()
            views.append((await asyncio.to_thread(ready_replicas, stack), live, stale))
        await asyncio.sleep(1.0)  # whatever got through has arrived by now
        live, stale = await coordinator_view()
        views.append((await asyncio.to_thread(ready_replicas, stack), live, stale))

        assert all(v == (["r0"], ["r0"], []) for v in views), views
        # The server refused each phantom publish but r0's on its own subject (the readers dropped those).
        assert any(subjects.telemetry(PHANTOM) in e for e in gw_errors), gw_errors
        assert any(subjects.telemetry("r0") in e for e in gw_errors), gw_errors
        assert any(subjects.telemetry(PHANTOM) in e for e in r0_errors), r0_errors
        assert not any(subjects.telemetry("r0") in e for e in r0_errors), r0_errors
        # The stack's own telemetry kept flowing (r0 reports every 0.5 s); the operator, who subscribes
        # to everything, did receive r0's phantom-naming messages from r0's user and dropped them too.
        assert seen.get("r0", 0) >= 8 and PHANTOM not in seen, seen

        # The operator may publish anything: then the probes above do see the phantom.
        await operator.nc.publish(subjects.telemetry(PHANTOM), phantom())
        await operator.nc.flush()
        deadline = time.monotonic() + 10
        while PHANTOM not in await asyncio.to_thread(ready_replicas, stack):
            assert time.monotonic() < deadline, "the gateway never listed the operator's phantom"
            await asyncio.sleep(0.2)
    finally:
        await as_gateway.close()
        await as_r0.close()
        await operator.close()

    # The operator's login file works for `collm`; without it `collm` cannot see the services.
    env_file = stack.local_bus.operator_env_path
    op_env = dict(
        line.removeprefix("export ").split("=", 1)
        for line in env_file.read_text().splitlines()
        if line.startswith("export ")
    )
    with_login = await asyncio.to_thread(collm_micro_ls, op_env)
    assert with_login.returncode == 0, with_login.stderr
    names = {r["name"] for r in json.loads(with_login.stdout)}
    assert names == set(subjects.SERVICE_NAMES), names
    without = await asyncio.to_thread(collm_micro_ls, {"COLLM_NATS_URL": url})
    assert without.returncode == 1 and "authorization" in without.stderr.lower(), without

    logs = stack.logs.getvalue()  # type: ignore[attr-defined]
    assert str(env_file) in logs
    assert not any(p in logs for p in passwords.values())


def test_the_redis_it_started_is_closed_each_service_logs_in_as_its_own_user(stack: Stack) -> None:
    """The launcher's own redis-server has the ACL users of deploy/redis/users.acl with the run
    directory's passwords (`<run_dir>/redis-auth/`): without a password nothing is read or written, the
    catalogue forgery of a host process (`SET <prefix>:adapter:{a}:current 1`) is refused to the gateway's
    and the coordinator's users (as in compose, the aggregator's and the replicas' may write adapter keys:
    they publish versions and create v1s), the operator's login works, each service was given its compose
    user, and no password appears in the launcher's log."""
    import redis

    store = stack.local_store
    assert store is not None
    url, _ = store.login("default")
    host_port = url.split("@", 1)[1].rsplit("/", 1)[0]
    key = f"{stack.config.redis_prefix}:adapter:{{med}}:current"
    anonymous = redis.Redis.from_url(f"redis://{host_port}/0")
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.get(key)
    for user in ("collm-gateway", "collm-reader"):
        as_user = redis.Redis.from_url(store.login(user)[0], password=store.passwords[user])
        assert as_user.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            as_user.set(key, "1")
    op_url, op_password = stack.redis_login
    operator = redis.Redis.from_url(op_url, password=op_password)
    operator.set(f"{stack.config.redis_prefix}:probe", "1")
    assert operator.get(f"{stack.config.redis_prefix}:probe") == b"1"
    env_file = store.operator_env_path
    assert f"COLLM_REDIS_PASSWORD={op_password}" in env_file.read_text()
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"
    envs = {c.name: c.env for c in stack.children}
    for name, user in (("aggregator", "collm-aggregator"), ("coordinator", "collm-reader"),
                       ("gateway", "collm-gateway"), ("replica-r0", "collm-replica")):  # fmt: skip
        assert envs[name]["COLLM_REDIS_URL"].startswith(f"redis://{user}@"), name
        assert envs[name]["COLLM_REDIS_PASSWORD"] == store.passwords[user], name
    logs = stack.logs.getvalue()  # type: ignore[attr-defined]
    assert str(env_file) in logs
    assert not any(p in logs for p in store.passwords.values())


def test_a_nats_that_answers_is_used_as_configured_and_a_left_local_bus_is_named(
    tmp_path: Path, nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    local_bus.prepare(tmp_path / "run", ["r0"], nats_server.url)
    log = io.StringIO()
    cfg = StackConfig(
        nats_url=nats_server.url,
        redis_url=redis_server.url,
        replicas=[ReplicaSpec("r0")],
        run_dir=tmp_path / "run",
    )
    stack = Stack(cfg, log_sink=log)
    stack._ensure_servers()
    assert stack.local_bus is None and stack.servers == [] and stack.nats_login == (None, None)
    text = log.getvalue()
    assert f"using NATS at {nats_server.url}" in text
    assert f"not as the users in {tmp_path / 'run' / local_bus.DIR_NAME}" in text
