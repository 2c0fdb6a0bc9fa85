"""What a launched CoLLM stack is made of (`collm_ops.launcher`): its servers, services, replicas and
their settings, as `StackConfig`; and the environment variables that name one process (`PER_PROCESS`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from collm_ops.supervise import SupervisionPolicy

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


@dataclass
class ReplicaSpec:
    replica_id: str
    data_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else the count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not every OS has affinity masks
        return os.cpu_count() or 1


def default_torch_threads(replicas: int, cpus: int) -> int:
    """Torch threads per replica when none are asked for: the CPUs divided among the replicas, at least
    one (two replicas on two cores: one each, as more would oversubscribe; one replica: both, as its
    batches' products run that much faster)."""
    return max(1, cpus // max(1, replicas))


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
    # Restart service children that exit (`collm_ops.launcher` docstring); `run_forever` turns it on.
    supervise: bool = False
    supervision: SupervisionPolicy = field(default_factory=SupervisionPolicy)


def describe(config: StackConfig) -> str:
    """Where the stack's parts are, as one line of JSON (what `collm up --json` prints first)."""
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
