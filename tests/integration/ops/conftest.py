"""One real CoLLM stack (tiny model) for every operations test in this package.

`Stack` from the launcher starts NATS and Redis on free ports, the aggregator, the coordinator, two
replicas with small local datasets and the gateway, each as `python -m collm_<svc>` with a Prometheus
port, JSON logs and OTLP/HTTP trace export to an in-test receiver. A tap records every message on
`collm.v1.>` from the start (what a `nats sub` opened earlier would have printed). `ops_round` runs one
real federated round on it, once, for the tests that need round records, versions and round metrics.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from collm_common import subjects
from collm_common.bus import Bus
from collm_common.settings import CommonSettings
from collm_common.wire.rounds import RoundOutcome
from collm_ops.launcher import ReplicaSpec, Stack, StackConfig
from collm_ops.servers import free_port, start_nats, start_redis
from tests.integration import seed

from .otlp_receiver import OtlpReceiver

ADAPTER = "ops"
DOMAIN = "ops"
COLLM = Path(sys.executable).parent / "collm"
FINAL_STATES = ("published", "held_back", "aborted")


class LogSink(io.TextIOBase):
    """Collects the launcher's `name | line` output (and keeps the tail for failure messages)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        with self._lock:
            for raw in s.splitlines():
                name, sep, line = raw.partition(" | ")
                if sep:
                    self.lines.append((name.strip(), line))
        return len(s)

    def json_lines(self, child: str) -> list[dict[str, Any]]:
        with self._lock:
            lines = [line for name, line in self.lines if name == child]
        out = []
        for line in lines:
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(doc, dict):
                out.append(doc)
        return out

    def tail(self, n: int = 80) -> str:
        with self._lock:
            return "\n".join(f"{a:>12} | {b}" for a, b in self.lines[-n:])


@dataclass
class Tapped:
    subject: str
    data: bytes
    headers: dict[str, str]
    t: float


class Tap:
    """Records every message on `collm.v1.>` (its own thread, loop and NATS connection)."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.messages: list[Tapped] = []
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        import nats

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        nc = await nats.connect(self.nats_url)

        async def on_msg(msg: Any) -> None:
            self.messages.append(Tapped(msg.subject, msg.data, dict(msg.headers or {}), time.time()))

        await nc.subscribe(subjects.subject(">"), cb=on_msg)
        await nc.flush()
        self._ready.set()
        await self._stop.wait()
        await nc.drain()

    def start(self) -> Tap:
        self.thread.start()
        assert self._ready.wait(10), "tap did not connect"
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)

    def matching(self, pattern: str) -> list[Tapped]:
        return [m for m in list(self.messages) if subject_matches(pattern, m.subject)]


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: `*` one token, `>` the rest."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def write_dataset(d: Path, n_train: int = 24, n_eval: int = 6) -> None:
    for split, n in (("train", n_train), ("eval", n_eval)):
        (d / split).mkdir(parents=True, exist_ok=True)
        with (d / split / f"{DOMAIN}.jsonl").open("w") as f:
            for i in range(n):
                row = {"id": f"{split}-{i}", "prompt": f"ops question {i}", "response": f"ops answer {i % 3}"}
                f.write(json.dumps({**row, "domain": DOMAIN}) + "\n")


@dataclass
class OpsStack:
    stack: Stack
    nats_url: str
    redis_url: str
    prefix: str
    receiver: OtlpReceiver
    logs: LogSink
    tap: Tap
    round_outcome: RoundOutcome | None = None

    @property
    def base_model(self) -> str:
        return "tiny"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("COLLM_")}
        env.update(
            {
                "COLLM_NATS_URL": self.nats_url,
                "COLLM_REDIS_URL": self.redis_url,
                "COLLM_REDIS_PREFIX": self.prefix,
            }
        )
        return env

    def collm(
        self, *args: str, stdin: bytes | None = None, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[bytes]:
        """Run the installed `collm` command against this stack (its COLLM_* connection variables)."""
        return subprocess.run(
            [str(COLLM), *args],
            input=stdin,
            capture_output=True,
            env=self.env(),
            timeout=timeout_s,
            check=False,
        )

    def settings(self) -> CommonSettings:
        return CommonSettings(nats_url=self.nats_url, redis_url=self.redis_url, redis_prefix=self.prefix,
                              nats_connect_timeout_s=10)  # fmt: skip


def wait_until(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


REPLICA_ENV = {
    "COLLM_TELEMETRY_INTERVAL_S": "0.5",
    "COLLM_ADAPTER_SYNC_INTERVAL_S": "1",
    "COLLM_TRAIN_MICRO_TOKENS": "32",
    "COLLM_TRAIN_BATCH_TOKENS": "64",
    "COLLM_TRAIN_MAX_SEQ_LEN": "48",
    "COLLM_EVAL_MAX_EXAMPLES": "6",
    "COLLM_PUBLISH_EVERY_STEPS": "2",
    "COLLM_ROUND_DEADLINE_MARGIN_S": "1",
    "COLLM_FT_SHARE_DEFAULT": "0.9",
}


@pytest.fixture(scope="package")
def ops(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpsStack]:
    tmp = tmp_path_factory.mktemp("ops")
    nats = start_nats(workdir=tmp / "nats")
    redis = start_redis(workdir=tmp / "redis")
    receiver = OtlpReceiver().start()
    tap = Tap(nats.url).start()
    logs = LogSink()
    replicas = []
    for rid in ("r0", "r1"):
        write_dataset(tmp / f"data-{rid}")
        replicas.append(ReplicaSpec(rid, str(tmp / f"data-{rid}")))
    cfg = StackConfig(
        nats_url=nats.url,
        redis_url=redis.url,
        redis_prefix="ops",
        model="tiny",
        gateway_port=free_port(),
        replicas=replicas,
        start_servers=False,
        run_dir=tmp / "run",
        ready_timeout_s=180,
        log_json=True,
        metrics_port_base=0,
        otlp_endpoint=receiver.url,
        # Export spans quickly (the default batch delay is 5 s).
        env={"OTEL_BSP_SCHEDULE_DELAY": "200"},
        service_env={
            "replica": REPLICA_ENV,
            "aggregator": {
                "COLLM_DEFAULT_PLAN": "false",
                "COLLM_EVAL_MAX_EXAMPLES": "6",
                "COLLM_EVAL_TIMEOUT_S": "60",
                "COLLM_CONTROL_TIMEOUT_S": "30",
            },
            # The coordinator plans the rounds of adapter `ops` (seeded as v1 before the start): the first
            # one as soon as both replicas report, then one every 20 s, each with a small token budget.
            "coordinator": {
                "COLLM_COORDINATOR_FAST_INTERVAL_S": "0.5",
                "COLLM_COORDINATOR_WARMUP_S": "1",
                "COLLM_COORDINATOR_SLOW_INTERVAL_S": "20",
                "COLLM_COORDINATOR_ROUND_DEADLINE_S": "18",
                "COLLM_COORDINATOR_ADAPTERS": json.dumps({ADAPTER: [DOMAIN]}),
                "COLLM_COORDINATOR_PROBE_BUDGET_TOKENS": "128",
                "COLLM_COORDINATOR_STORE_REFRESH_S": "1",
            },
        },
    )
    asyncio.run(seed_v1(redis.url, "ops"))
    stack = Stack(cfg, log_sink=logs)
    try:
        stack.start()
    except Exception:
        print(logs.tail(200))
        tap.stop()
        receiver.stop()
        nats.stop()
        redis.stop()
        raise
    ops = OpsStack(stack, nats.url, redis.url, "ops", receiver, logs, tap)
    try:
        yield ops
    finally:
        stack.stop()
        tap.stop()
        receiver.stop()
        nats.stop()
        redis.stop()


async def seed_v1(redis_url: str, prefix: str) -> None:
    await seed.seed_v1(redis_url, prefix, ADAPTER)


async def _wait_round(ops: OpsStack) -> RoundOutcome:
    """The first round the coordinator planned with both replicas, once final (published, held back or
    aborted). Its first plan comes a warm-up after the first replica reports: on a busy machine the other
    may not have reported by then, and that round has one participant; the next one has both."""
    from collm_common.wire.admin import ListRounds, RoundList

    bus = await Bus.connect(ops.settings(), "ops-test")
    try:
        end = time.monotonic() + 150
        while time.monotonic() < end:
            got = await bus.request(
                subjects.aggregator("rounds"), ListRounds(limit=50), RoundList, timeout_s=10
            )
            final = sorted(
                (o for o in got.rounds if o.state in FINAL_STATES and sorted(o.participants) == ["r0", "r1"]),
                key=lambda o: o.round_id,
            )
            if final:
                return final[0]
            await asyncio.sleep(0.5)
        raise AssertionError("no round the coordinator planned with both replicas finished")
    finally:
        await bus.close()


@pytest.fixture(scope="package")
def ops_round(ops: OpsStack) -> RoundOutcome:
    """The first real federated round of adapter `ops`, planned by the coordinator (waited for once)."""
    if ops.round_outcome is None:
        try:
            ops.round_outcome = asyncio.run(_wait_round(ops))
        except Exception:
            print(ops.logs.tail(150))
            raise
    return ops.round_outcome
