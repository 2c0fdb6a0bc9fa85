"""The environment of each service child of a launched stack (`collm_ops.launcher` docstring: what each
child inherits, what the launcher sets over it, and in which order), and the Prometheus ports it hands
out. Nothing here starts a process: `ChildEnvs.all` is what `Stack.start` spawns."""

from __future__ import annotations

import os

from collm_ops import nats_auth
from collm_ops.local_bus import LocalBus
from collm_ops.local_store import LocalStore
from collm_ops.servers import free_port, port_open
from collm_ops.stack_config import PER_PROCESS, StackConfig
from collm_replica.naming import served_name


def consumer_name(config: StackConfig) -> str:
    """The aggregator's durable update consumer (its `COLLM_CONSUMER_NAME`, as `ChildEnvs.env` sets it)."""
    env = {**os.environ, **config.env, **config.service_env.get("aggregator", {})}
    return env.get("COLLM_CONSUMER_NAME", nats_auth.AGGREGATOR_CONSUMER)


class ChildEnvs:
    """The environments of one stack's children. Keeps the metrics port it gave each child
    (`metrics_ports`) and the inherited `COLLM_*` variables some child gets with another value
    (`overridden_env`)."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        # Child name -> its Prometheus port (services started with COLLM_METRICS_PORT).
        self.metrics_ports: dict[str, int] = {}
        self._next_metrics_port = config.metrics_port_base
        self.overridden_env: set[str] = set()

    def metrics_port(self, name: str) -> dict[str, str]:
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

    def env(self, service: str, extra: dict[str, str], store_login: dict[str, str]) -> dict[str, str]:
        """The environment of one child of `service` (precedence: `collm_ops.launcher` docstring);
        `store_login`: its own Redis login, if any."""
        cfg = self.config
        inherited = {k: v for k, v in os.environ.items() if k not in PER_PROCESS}
        env = dict(inherited)
        env.update(
            {
                "COLLM_NATS_URL": cfg.nats_url,
                "COLLM_REDIS_URL": cfg.redis_url,
                "COLLM_REDIS_PREFIX": cfg.redis_prefix,
                **store_login,
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

    def all(self, bus: LocalBus | None, store: LocalStore | None) -> list[tuple[str, str, dict[str, str]]]:
        """(name, module, environment) of every service child, in start order, with their own logins on
        the closed local `bus` and `store` (when the launcher started them). Assigns metrics ports: call
        it once per start."""
        cfg = self.config

        def bus_login(service: str, replica_id: str | None = None) -> dict[str, str]:
            return {} if bus is None else bus.service_env(service, replica_id)

        def env(service: str, extra: dict[str, str]) -> dict[str, str]:
            return self.env(service, extra, {} if store is None else store.service_env(service))

        out: list[tuple[str, str, dict[str, str]]] = []
        if cfg.with_aggregator:
            extra = {**self.metrics_port("aggregator"), **bus_login("aggregator")}
            out.append(("aggregator", "collm_aggregator", env("aggregator", extra)))
        if cfg.with_coordinator:
            extra = {
                "COLLM_COORDINATOR_POLICY": cfg.coordinator_policy,
                **self.metrics_port("coordinator"),
                **bus_login("coordinator"),
            }
            out.append(("coordinator", "collm_coordinator", env("coordinator", extra)))
        for spec in cfg.replicas:
            name = f"replica-{spec.replica_id}"
            extra = {
                "COLLM_REPLICA_ID": spec.replica_id,
                "COLLM_MODEL": cfg.model,
                "COLLM_TORCH_THREADS": str(cfg.torch_threads),
                **({"COLLM_DATA_DIR": spec.data_dir} if spec.data_dir else {}),
                **self.metrics_port(name),
                **spec.env,
                **bus_login("replica", spec.replica_id),
            }
            out.append((name, "collm_replica", env("replica", extra)))
        gateway = {
            "COLLM_HOST": cfg.gateway_host,
            "COLLM_PORT": str(cfg.gateway_port),
            "COLLM_BASE_MODEL": served_name(cfg.model),
            **bus_login("gateway"),
        }
        out.append(("gateway", "collm_gateway", env("gateway", gateway)))
        return out
