"""A real CoLLM stack to break on purpose: own nats-server and redis-server, the launcher's processes.

`FaultStack` starts nats-server (JetStream, its store in `<tmp>/nats`) and redis-server (append-only
persistence in `<tmp>/redis`, as the shipped config) on free ports, writes a small local dataset per
replica, and runs the whole stack through `collm_ops.launcher.Stack` with the tiny model: aggregator,
coordinator, replicas and gateway, each a `python -m collm_<service>` process. Faults act on those real
processes: `Stack.kill` / `Stack.restart` for a service, `ServerProcess.stop` / `restart` for NATS and
Redis (same port, same data directory). With `nats_nodes` = 3 NATS is a three-node JetStream cluster
instead (`collm_ops.servers.start_nats_cluster`): every service gets every node's URL and creates its
streams with three replicas.

Settings are shortened so that a fault shows within a second or two (telemetry every 0.25 s, a replica
stale after 1 s, coordinator weights and shares with a 2 s TTL) and the coordinator plans no round of
its own (rounds here are opened by the scenarios). Every process writes its own log,
`<tmp>/logs/<name>.log` (the launcher's own lines: `<tmp>/stack.log`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
from nats.errors import Error as NatsError

from collm_common import subjects
from collm_common.bus import Bus, BusError
from collm_common.settings import CommonSettings
from collm_common.store import AdapterStore
from collm_common.wire.admin import AggregatorStatus, StatusRequest
from collm_common.wire.control import CoordinatorStatus, CoordinatorStatusRequest
from collm_common.wire.gateway import GatewayStatus, GatewayStatusRequest
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_ops.launcher import ReplicaSpec, Stack, StackConfig
from collm_ops.servers import (
    NatsCluster,
    ServerProcess,
    free_port,
    start_nats,
    start_nats_cluster,
    start_redis,
)
from collm_replica.naming import served_name

from .probe import Outcome, run_load

# Fast fault detection and short TTLs (see the module docstring).
TELEMETRY_INTERVAL_S = 0.25
GATEWAY_STALE_S = 1.0
ROUTING_TTL_S = 2.0
SHARE_TTL_S = 2.0
FT_SHARE_DEFAULT = 0.3
REQUEST_DEADLINE_S = 30.0
CLIENT_TIMEOUT_S = REQUEST_DEADLINE_S + 5.0  # a request unanswered by then hung past its deadline

REPLICA_ENV = {
    "COLLM_TELEMETRY_INTERVAL_S": str(TELEMETRY_INTERVAL_S),
    "COLLM_ADAPTER_SYNC_INTERVAL_S": "2",
    "COLLM_FT_SHARE_DEFAULT": str(FT_SHARE_DEFAULT),
    "COLLM_TRAIN_MICRO_TOKENS": "32",
    "COLLM_TRAIN_BATCH_TOKENS": "64",
    "COLLM_TRAIN_MAX_SEQ_LEN": "48",
    "COLLM_EVAL_MAX_EXAMPLES": "6",
    "COLLM_PUBLISH_EVERY_STEPS": "2",
    "COLLM_ROUND_DEADLINE_MARGIN_S": "1",
}
GATEWAY_ENV = {
    "COLLM_TELEMETRY_STALE_S": str(GATEWAY_STALE_S),
    "COLLM_TELEMETRY_STALE_INTERVALS": "3",
    "COLLM_FIRST_EVENT_TIMEOUT_S": "1.0",
    "COLLM_REQUEST_DEADLINE_S": str(REQUEST_DEADLINE_S),
    "COLLM_INTER_TOKEN_TIMEOUT_S": "10",
    "COLLM_FIRST_TOKEN_TIMEOUT_S": "20",
    "COLLM_MODELS_CACHE_TTL_S": "0.5",
}
COORDINATOR_ENV = {
    "COLLM_COORDINATOR_PUBLISH_WEIGHTS": "true",
    "COLLM_COORDINATOR_FAST_INTERVAL_S": "0.5",
    "COLLM_COORDINATOR_ROUTING_TTL_S": str(ROUTING_TTL_S),
    "COLLM_COORDINATOR_SHARE_TTL_S": str(SHARE_TTL_S),
    "COLLM_COORDINATOR_STALE_AFTER_S": "1.5",
    "COLLM_COORDINATOR_WARMUP_S": "86400",  # no round plans of its own: the scenarios open rounds
}
AGGREGATOR_ENV = {
    "COLLM_DEFAULT_PLAN": "false",
    "COLLM_EVAL_MAX_EXAMPLES": "6",
    "COLLM_EVAL_TIMEOUT_S": "30",
    "COLLM_CONTROL_TIMEOUT_S": "15",
    "COLLM_TELEMETRY_STALE_S": "3",
    # The tiny model's losses move at random with training: a wide gate lets every round publish, so
    # the scenarios exercise the publication path (the gate itself is tested in tests/unit/aggregator).
    "COLLM_GATE_MIN_GAIN_NATS": "-100",
    "COLLM_GATE_Z": "0",
}
DOMAINS = {"r0": "med", "r1": "math", "r2": "code"}


def write_dataset(d: Path, domain: str, n_train: int = 24, n_eval: int = 6) -> None:
    """A small local dataset with a held-out split (`train/`, `eval/`), as a site would have."""
    for split, n in (("train", n_train), ("eval", n_eval)):
        (d / split).mkdir(parents=True, exist_ok=True)
        with (d / split / f"{domain}.jsonl").open("w") as f:
            for i in range(n):
                row = {
                    "id": f"{domain}-{split}-{i}",
                    "prompt": f"{domain} question {i}",
                    "response": f"{domain} answer {i % 3}",
                    "domain": domain,
                }
                f.write(json.dumps(row) + "\n")


async def wait_for(probe: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll `probe` (sync or async) until it returns something truthy; AssertionError on timeout."""
    end = time.monotonic() + timeout_s
    while True:
        value = probe()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(interval_s)


@dataclass
class FaultStack:
    tmp: Path
    replicas: tuple[str, ...] = ("r0", "r1")
    with_coordinator: bool = True
    with_aggregator: bool = True
    env: dict[str, str] = field(default_factory=dict)
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    ready_timeout_s: float = 240.0
    # False: the services' own defaults (only the ports, the tiny model and the data come from here),
    # with the aggregator's built-in rounds on: what the soak runs.
    fault_settings: bool = True
    prefix: str = field(default_factory=lambda: f"f{uuid.uuid4().hex[:8]}")
    # 1: one nats-server (`nats`); more: a JetStream cluster of that many nodes (`nats_cluster`, whose
    # first node is also `nats`), streams with that many replicas (at most 3 here).
    nats_nodes: int = 1
    nats: ServerProcess | None = None
    nats_cluster: NatsCluster | None = None
    redis: ServerProcess | None = None
    stack: Stack | None = None
    _log: IO[str] | None = None

    # --- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> FaultStack:
        self.tmp.mkdir(parents=True, exist_ok=True)
        env = dict(self.env)
        if self.nats_nodes > 1:
            self.nats_cluster = start_nats_cluster(self.tmp / "nats", self.nats_nodes)
            self.nats = self.nats_cluster.nodes[0]
            env.setdefault("COLLM_NATS_STREAM_REPLICAS", str(min(self.nats_nodes, 3)))
            asyncio.run(wait_for_jetstream(self.nats_url, 30.0))
        else:
            self.nats = start_nats(workdir=self.tmp / "nats")
        self.redis = start_redis(workdir=self.tmp / "redis")
        specs = []
        for rid in self.replicas:
            data = self.tmp / f"data-{rid}"
            write_dataset(data, DOMAINS.get(rid, rid))
            specs.append(ReplicaSpec(rid, data_dir=str(data)))
        service_env: dict[str, dict[str, str]] = {
            "aggregator": {"COLLM_CONSUMER_NAME": f"agg-{self.prefix}"},
        }
        if self.fault_settings:
            service_env["replica"] = dict(REPLICA_ENV)
            service_env["gateway"] = dict(GATEWAY_ENV)
            service_env["coordinator"] = dict(COORDINATOR_ENV)
            service_env["aggregator"].update(AGGREGATOR_ENV)
        for name, extra in self.service_env.items():
            service_env.setdefault(name, {}).update(extra)
        cfg = StackConfig(
            nats_url=self.nats_url,
            redis_url=self.redis.url,
            redis_prefix=self.prefix,
            model="tiny",
            gateway_port=free_port(),
            replicas=specs,
            env=env,
            service_env=service_env,
            with_coordinator=self.with_coordinator,
            with_aggregator=self.with_aggregator,
            start_servers=False,
            run_dir=self.tmp / "run",
            ready_timeout_s=self.ready_timeout_s,
            metrics_port_base=0,
            log_dir=self.tmp / "logs",
        )
        self._log = (self.tmp / "stack.log").open("w", encoding="utf-8")
        self.stack = Stack(cfg, log_sink=self._log)
        try:
            self.stack.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
        if self.nats_cluster is not None:
            self.nats_cluster.stop()
        for srv in (self.nats, self.redis):
            if srv is not None:
                srv.stop()
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, chars: int = 8000) -> str:
        """The end of every log (the launcher's, then each process's), `chars` in all."""
        paths = [self.tmp / "stack.log", *sorted((self.tmp / "logs").glob("*.log"))]
        paths = [p for p in paths if p.exists()]
        each = max(500, chars // max(1, len(paths)))
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-each:]}" for p in paths)

    # --- access ---------------------------------------------------------------------------------------
    @property
    def s(self) -> Stack:
        assert self.stack is not None, "the stack is not running"
        return self.stack

    @property
    def nats_url(self) -> str:
        """COLLM_NATS_URL of the services: the server's URL, or every cluster node's."""
        if self.nats_cluster is not None:
            return self.nats_cluster.urls
        assert self.nats is not None, "NATS is not running"
        return self.nats.url

    @property
    def gateway_url(self) -> str:
        return self.s.gateway_url

    @property
    def base_model(self) -> str:
        return served_name("tiny")

    def metrics_url(self, child: str) -> str:
        return self.s.metrics_urls()[child]

    @contextlib.asynccontextmanager
    async def bus(self, name: str = "fault-client") -> AsyncIterator[Bus]:
        b = await Bus.connect(CommonSettings(nats_url=self.nats_url, nats_connect_timeout_s=10), name)
        try:
            yield b
        finally:
            await b.close()

    @contextlib.asynccontextmanager
    async def store(self) -> AsyncIterator[AdapterStore]:
        assert self.redis is not None
        st = AdapterStore.from_url(self.redis.url, self.prefix)
        try:
            yield st
        finally:
            await st.close()

    # --- health ---------------------------------------------------------------------------------------
    def dead_children(self) -> dict[str, int]:
        """Children that exited (name -> exit code): after a fault only the one killed may be here."""
        return {c.name: int(c.proc.returncode) for c in self.s.children if c.proc.poll() is not None}

    def failed_children(self) -> dict[str, int]:
        """Children that failed (exited with an error, or were killed) and were not restarted; one that a
        scenario stopped cleanly (exit code 0) is not among them."""
        return {name: code for name, code in self.dead_children().items() if code != 0}

    async def fresh_replicas(self, http: httpx.AsyncClient) -> list[str]:
        try:
            r = await http.get(f"{self.gateway_url}/readyz", timeout=2.0)
        except httpx.HTTPError:
            return []
        return list(r.json().get("replicas", [])) if r.status_code == 200 else []

    async def ensure_healthy(self, timeout_s: float = 60.0) -> None:
        """Every process alive, both servers up, every replica fresh in the gateway, every service
        answering its NATS status endpoint: what each scenario starts from."""
        assert self.nats is not None and self.redis is not None
        dead = self.dead_children()
        if dead:
            raise AssertionError(f"processes exited: {dead}\n{self.log_tail()}")
        want = set(self.replicas)
        async with httpx.AsyncClient() as http:
            await wait_for(
                lambda: self._all_fresh(http, want),
                timeout_s,
                f"replicas {sorted(want)} fresh in the gateway",
            )
        async with self.bus("fault-health") as bus:
            await wait_for(lambda: self.services_answering(bus), timeout_s, "every service to answer")

    async def _all_fresh(self, http: httpx.AsyncClient, want: set[str]) -> bool:
        return want <= set(await self.fresh_replicas(http))

    async def services_answering(self, bus: Bus, timeout_s: float = 1.0) -> bool:
        return all((await self.answering(bus, timeout_s)).values())

    async def answering(self, bus: Bus, timeout_s: float = 1.0) -> dict[str, bool]:
        """Which services answer their NATS status endpoint right now (name -> bool)."""
        probes: dict[str, Awaitable[Any]] = {
            f"replica-{rid}": bus.request(
                subjects.replica(rid, "status"), StatusRequest(), ReplicaTelemetry, timeout_s
            )
            for rid in self.replicas
        }
        probes["gateway"] = bus.request(
            subjects.gateway("status"), GatewayStatusRequest(), GatewayStatus, timeout_s
        )
        if self.with_coordinator:
            probes["coordinator"] = bus.request(
                subjects.coordinator("status"), CoordinatorStatusRequest(), CoordinatorStatus, timeout_s
            )
        if self.with_aggregator:
            probes["aggregator"] = bus.request(
                subjects.aggregator("status"), StatusRequest(), AggregatorStatus, timeout_s
            )
        results = await asyncio.gather(*probes.values(), return_exceptions=True)
        return {
            name: not isinstance(res, BusError | Exception) for name, res in zip(probes, results, strict=True)
        }


async def wait_for_jetstream(nats_url: str, timeout_s: float) -> None:
    """Until JetStream answers at `nats_url` (a cluster's: once its nodes have elected a meta leader)."""
    settings = CommonSettings(nats_url=nats_url, nats_connect_timeout_s=10)
    async with await Bus.connect(settings, "fault-js-wait") as bus:

        async def ready() -> bool:
            try:
                await bus.js.account_info()
            except (NatsError, TimeoutError):
                return False
            return True

        await wait_for(ready, timeout_s, "JetStream", interval_s=0.2)


@contextlib.contextmanager
def running(fs: FaultStack) -> Iterator[FaultStack]:
    """`fs` started (its logs printed and whatever it started stopped if the start fails), then stopped
    after the block."""
    try:
        fs.start()
    except Exception:
        print(fs.log_tail())  # noqa: T201
        fs.stop()
        raise
    try:
        yield fs
    finally:
        fs.stop()


def scrape(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric `name` whose labels include `labels` in Prometheus text `text`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_part = head.partition("{")
        if metric != name:
            continue
        got = {
            k: v.strip('"') for k, _, v in (p.partition("=") for p in label_part.rstrip("}").split(",") if p)
        }
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


async def metric(url: str, name: str, **labels: str) -> float:
    async with httpx.AsyncClient() as http:
        r = await http.get(url, timeout=5.0)
        r.raise_for_status()
    return scrape(r.text, name, **labels)


async def gateway_retries(fs: FaultStack) -> float:
    return await metric(f"{fs.gateway_url}/metrics", "collm_gateway_retries_total")


async def replica_status(bus: Bus, rid: str, timeout_s: float = 1.0) -> ReplicaTelemetry | None:
    try:
        return await bus.request(
            subjects.replica(rid, "status"), StatusRequest(), ReplicaTelemetry, timeout_s
        )
    except BusError:
        return None


async def gateway_status(bus: Bus, timeout_s: float = 1.0) -> GatewayStatus | None:
    try:
        return await bus.request(subjects.gateway("status"), GatewayStatusRequest(), GatewayStatus, timeout_s)
    except BusError:
        return None


@contextlib.asynccontextmanager
async def background_load(
    fs: FaultStack, model: str | None = None, concurrency: int = 2, max_tokens: int = 16
) -> AsyncIterator[list[Outcome]]:
    """Light closed-loop traffic while a fault happens elsewhere; the list fills in as requests end (the
    block may wait on it), and holds them in the order they were sent once the block ends."""
    stop = asyncio.Event()
    out: list[Outcome] = []
    task = asyncio.create_task(
        run_load(
            fs.gateway_url,
            model or fs.base_model,
            concurrency=concurrency,
            duration_s=3600,
            max_tokens=max_tokens,
            timeout_s=CLIENT_TIMEOUT_S,
            stop=stop,
            on_outcome=out.append,
        )
    )
    try:
        yield out
    finally:
        stop.set()
        out[:] = await task
