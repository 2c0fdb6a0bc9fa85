"""The environment each child of `collm up` gets (collm_ops.launcher.Stack.child_envs), without starting
anything: inherited COLLM_* variables reach every service, the launcher's own per-process and stack-wide
values win, and what names one process is never inherited."""

from __future__ import annotations

import os

import pytest

from collm_aggregator.settings import AggregatorSettings
from collm_gateway.keys import hash_key
from collm_gateway.settings import GatewaySettings
from collm_ops.launcher import PER_PROCESS, ReplicaSpec, Stack, StackConfig
from collm_replica.settings import ReplicaSettings

pytestmark = pytest.mark.unit

API_KEYS = f'{{"{hash_key("sk-test-acme")}": {{"tenant": "acme"}}}}'
OPERATOR_ENV = {
    # meant for the services: they must arrive
    "COLLM_API_KEYS": API_KEYS,
    "COLLM_ADMIN_KEY": "sk-test-admin",
    "COLLM_STRATEGY": "fedavg",
    "COLLM_MAX_BATCH": "3",
    "UNRELATED_SETTING": "kept",
    # what the launcher sets itself: its values win
    "COLLM_NATS_URL": "nats://elsewhere:4222",
    "COLLM_MODEL": "tiny",
    # what names one process: never inherited
    "COLLM_METRICS_PORT": "9100",
    "COLLM_REPLICA_ID": "intruder",
    "COLLM_DATA_DIR": "/shared/data",
    "COLLM_PORT": "9999",
    "OTEL_SERVICE_NAME": "one-name-for-all",
}


@pytest.fixture
def operator_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("COLLM_")]:
        monkeypatch.delenv(key)
    for key, value in OPERATOR_ENV.items():
        monkeypatch.setenv(key, value)


def children(**config: object) -> tuple[Stack, dict[str, dict[str, str]]]:
    fields: dict[str, object] = {
        "nats_url": "nats://127.0.0.1:4333",
        "replicas": [ReplicaSpec("r0", data_dir="/data/r0"), ReplicaSpec("r1")],
        "metrics_port_base": None,
        **config,
    }
    cfg = StackConfig(**fields)  # type: ignore[arg-type]
    stack = Stack(cfg)
    envs = {name: env for name, _module, env in stack.child_envs()}
    return stack, envs


def settings_in(env: dict[str, str], cls: type, monkeypatch: pytest.MonkeyPatch) -> object:
    """`cls()` read from `env` alone, as the child process would read it."""
    with monkeypatch.context() as m:
        for key in list(os.environ):
            m.delenv(key)
        for key, value in env.items():
            m.setenv(key, value)
        return cls()


def test_inherited_collm_variables_reach_every_child(operator_env: None) -> None:
    stack, envs = children()
    assert list(envs) == ["aggregator", "coordinator", "replica-r0", "replica-r1", "gateway"]
    for name, env in envs.items():
        for key in ("COLLM_API_KEYS", "COLLM_ADMIN_KEY", "COLLM_STRATEGY", "COLLM_MAX_BATCH"):
            assert env[key] == OPERATOR_ENV[key], (name, key)
        assert env["UNRELATED_SETTING"] == "kept"
        assert env["COLLM_NATS_URL"] == "nats://127.0.0.1:4333", name  # the launcher's stack-wide value
        assert "COLLM_METRICS_PORT" not in env and "OTEL_SERVICE_NAME" not in env, name  # metrics off
    # per-process values: the launcher's, or none
    assert [envs[f"replica-{r}"]["COLLM_REPLICA_ID"] for r in ("r0", "r1")] == ["r0", "r1"]
    assert envs["replica-r0"]["COLLM_DATA_DIR"] == "/data/r0" and "COLLM_DATA_DIR" not in envs["replica-r1"]
    assert envs["replica-r0"]["COLLM_MODEL"] == "smollm2"
    assert envs["gateway"]["COLLM_PORT"] == "8000"
    for name in ("aggregator", "coordinator", "gateway"):
        assert "COLLM_REPLICA_ID" not in envs[name] and "COLLM_DATA_DIR" not in envs[name]
    for name in ("aggregator", "coordinator", "replica-r0", "replica-r1"):
        assert "COLLM_PORT" not in envs[name] and "COLLM_HOST" not in envs[name]
    assert {k for k in OPERATOR_ENV if k in PER_PROCESS} == PER_PROCESS - {"COLLM_HOST"}
    assert stack.overridden_env == {
        "COLLM_NATS_URL",
        "COLLM_MODEL",
        "COLLM_METRICS_PORT",
        "COLLM_REPLICA_ID",
        "COLLM_DATA_DIR",
        "COLLM_PORT",
    }


def test_each_service_reads_what_the_operator_set(
    operator_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stack, envs = children()
    gateway = settings_in(envs["gateway"], GatewaySettings, monkeypatch)
    assert isinstance(gateway, GatewaySettings)
    assert gateway.keys_configured and gateway.api_keys[hash_key("sk-test-acme")].tenant == "acme"
    assert gateway.admin_key is not None and gateway.admin_key.get_secret_value() == "sk-test-admin"
    assert (gateway.port, gateway.metrics_port) == (8000, None)
    aggregator = settings_in(envs["aggregator"], AggregatorSettings, monkeypatch)
    assert isinstance(aggregator, AggregatorSettings) and aggregator.strategy == "fedavg"
    replica = settings_in(envs["replica-r1"], ReplicaSettings, monkeypatch)
    assert isinstance(replica, ReplicaSettings)
    assert (replica.replica_id, replica.max_batch, replica.data_dir) == ("r1", 3, None)


def test_the_launchers_configuration_wins_over_inherited_values(operator_env: None) -> None:
    stack, envs = children(
        metrics_port_base=0,
        env={"COLLM_STRATEGY": "product_svd"},
        service_env={"gateway": {"COLLM_ADMIN_KEY": "sk-from-config"}},
    )
    ports = {name: env.get("COLLM_METRICS_PORT") for name, env in envs.items()}
    assert ports["gateway"] is None and len({p for p in ports.values() if p}) == 4
    assert all(env["COLLM_STRATEGY"] == "product_svd" for env in envs.values())
    assert envs["gateway"]["COLLM_ADMIN_KEY"] == "sk-from-config"
    assert envs["aggregator"]["COLLM_ADMIN_KEY"] == "sk-test-admin"
    assert {"COLLM_STRATEGY", "COLLM_ADMIN_KEY"} <= stack.overridden_env


def test_without_collm_variables_nothing_is_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("COLLM_")]:
        monkeypatch.delenv(key)
    stack, envs = children()
    assert stack.overridden_env == set()
    assert envs["gateway"]["COLLM_NATS_URL"] == "nats://127.0.0.1:4333"
