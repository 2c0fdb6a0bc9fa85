"""deploy/cluster/docker-compose.cluster.yml (the overlay on docker-compose.yml), checked without a Docker
engine: the overlay is merged onto the base file the way Compose merges (`environment` and
`depends_on` by key, `secrets` and `volumes` by target); then every CoLLM service is checked for the
cluster settings, and the NATS nodes, Redis nodes and Sentinels for what makes them one cluster.
`docker compose config` itself runs when a Compose v2 binary is present.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from collm_common.settings import CommonSettings, sentinel_addresses
from collm_ops import settings_doc

from .test_compose import COMPOSE, ROOT, collm_services, env_of, interpolate, secrets_of

pytestmark = pytest.mark.unit

OVERLAY = ROOT / "deploy/cluster/docker-compose.cluster.yml"


def merged() -> dict[str, Any]:
    base = interpolate(yaml.safe_load(COMPOSE.read_text()))
    over = interpolate(yaml.safe_load(OVERLAY.read_text()))
    services = {name: dict(svc) for name, svc in base["services"].items()}
    for name, svc in over["services"].items():
        into = services.setdefault(name, {})
        for key, value in svc.items():
            if key == "environment":
                into[key] = {**env_of(into), **env_of(svc)}
            elif key == "secrets":
                both = {**secrets_of(into), **secrets_of(svc)}
                into[key] = [{"source": s, "target": t} for t, s in both.items()]
            elif key == "depends_on":
                into[key] = {**into.get(key, {}), **value}
            elif key == "volumes":
                by_target = {v.split(":")[1]: v for v in [*into.get(key, []), *value]}
                into[key] = list(by_target.values())
            else:
                into[key] = value
    secrets = {**base["secrets"], **over.get("secrets", {})}
    return {"services": services, "secrets": secrets, "volumes": {**base["volumes"], **over["volumes"]}}


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return merged()


def nats_nodes(c: dict[str, Any]) -> list[str]:
    return sorted(n for n in c["services"] if n == "nats" or n.startswith("nats-") and n != "nats-box")


def sentinels(c: dict[str, Any]) -> list[str]:
    return sorted(n for n in c["services"] if n.startswith("redis-sentinel-"))


def test_three_nats_nodes_route_to_each_other_with_jetstream(cluster: dict[str, Any]) -> None:
    nodes = nats_nodes(cluster)
    assert nodes == ["nats", "nats-2", "nats-3"]
    names = set()
    for n in nodes:
        svc = cluster["services"][n]
        command = " ".join(svc["command"])
        for other in nodes:
            assert f"@{other}:6222" in command, (n, other)
        mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
        assert mounts["/etc/nats/nats.conf"] == "./deploy/cluster/nats-node.conf", n
        assert mounts["/etc/nats/auth.conf"] == "./deploy/nats/auth.conf", n
        assert "/data" in mounts, n
        assert "nats_cluster_password" in secrets_of(svc), n
        assert "js-enabled-only" in " ".join(svc["healthcheck"]["test"]), n
        names.add(svc["environment"]["NATS_SERVER_NAME"])
    assert len(names) == len(nodes), "every node has its own server_name"
    conf = (ROOT / "deploy/cluster/nats-node.conf").read_text()
    assert "server_name: $NATS_SERVER_NAME" in conf and "jetstream" in conf and "include ./auth.conf" in conf


def test_every_collm_service_uses_every_node_r3_streams_and_the_sentinels(
    cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    nodes, sents = nats_nodes(cluster), sentinels(cluster)
    services = collm_services(cluster)
    assert "replica-2" in services and services["replica-2"][0] == "replica"
    for name, (target, svc) in services.items():
        env = env_of(svc)
        cls = settings_doc.settings_class(settings_doc.SERVICES[target])
        known = {settings_doc.env_name(cls, f) for f in cls.model_fields}
        assert not [k for k in env if k.startswith("COLLM_") and k not in known], name
        run_secrets = tmp_path / name
        run_secrets.mkdir()
        for file, source in secrets_of(svc).items():
            (run_secrets / file).write_text(f"value-of-{source}\n")
        for k in [k for k in os.environ if k.startswith("COLLM_")]:
            monkeypatch.delenv(k)
        for k, v in env.items():
            if k.startswith("COLLM_"):
                monkeypatch.setenv(k, v)
        monkeypatch.setenv("COLLM_SECRETS_DIR", str(run_secrets))
        s = cls()
        assert isinstance(s, CommonSettings)
        assert sorted(u.split("//")[1].split(":")[0] for u in s.nats_url.split(",")) == nodes, name
        assert s.nats_stream_replicas == len(nodes), name
        assert sorted(h for h, _ in sentinel_addresses(s.redis_sentinels)) == sents, name
        assert s.redis_sentinel_password is not None, name
        assert s.redis_sentinel_password.get_secret_value() == "value-of-redis_sentinel_password", name


def test_redis_primary_replica_and_three_sentinels(cluster: dict[str, Any]) -> None:
    svcs = cluster["services"]
    assert len(sentinels(cluster)) == 3
    replica = " ".join(svcs["redis-replica"]["command"])
    assert "--replicaof redis 6379" in replica
    for node in ("redis", "redis-replica"):
        command = " ".join(svcs[node]["command"])
        assert "users-cluster.acl" in command and "--masteruser collm-replication" in command, node
        assert "--replica-announce-ip" not in command, node  # known by address (redis-sentinel.sh)
        assert {"redis_password_replication", "redis_password_sentinel"} <= set(secrets_of(svcs[node])), node
    script = (ROOT / "deploy/cluster/redis-sentinel.sh").read_text()
    assert "sentinel monitor collm $primary 6379 2" in script  # quorum 2 of 3
    assert "primary=$(getent hosts redis " in script and "sentinel announce-hostnames no" in script
    assert "sentinel auth-user collm collm-sentinel" in script
    acl = (ROOT / "deploy/cluster/users-cluster.acl").read_text()
    assert "user collm-replication" in acl and "user collm-sentinel" in acl
    for name in sentinels(cluster):
        assert svcs[name]["command"][-1] == name  # announces its own host name


def test_every_secret_is_declared_and_shipped(cluster: dict[str, Any]) -> None:
    for name, svc in cluster["services"].items():
        for source in secrets_of(svc).values():
            assert source in cluster["secrets"], (name, source)
    for name, spec in cluster["secrets"].items():
        assert spec["file"] == f"./deploy/secrets/{name}", name
        assert (ROOT / "deploy/secrets" / name).is_file(), name
    for name, svc in cluster["services"].items():
        for v in svc.get("volumes") or []:
            source = v.split(":")[0] if isinstance(v, str) else v["source"]
            if source.startswith("./"):
                assert (ROOT / source).exists(), (name, source)
            else:
                assert source in cluster["volumes"], (name, source)


def test_docker_compose_config_accepts_the_overlay() -> None:
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI")
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no Docker Compose v2 (deploy/compose_check.py installs one)")
    files = ["-f", str(COMPOSE), "-f", str(OVERLAY)]
    r = subprocess.run(["docker", "compose", *files, "config", "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_collm_services_wait_for_every_node_and_sentinel_and_those_have_health_checks(
    cluster: dict[str, Any],
) -> None:
    svcs = cluster["services"]
    for name in collm_services(cluster):
        deps = svcs[name]["depends_on"]
        for dep in [*nats_nodes(cluster), *sentinels(cluster), "redis"]:
            assert deps.get(dep, {}).get("condition") == "service_healthy", (name, dep)
    for name, svc in svcs.items():
        for dep, spec in (svc.get("depends_on") or {}).items():
            if spec.get("condition") == "service_healthy":
                assert "healthcheck" in svcs[dep], (name, dep)
