"""docker-compose.yml wires the shipped security configuration: checked without a Docker engine.

Every NATS user of deploy/nats/auth.conf has its password secret in the nats container (secrets-env.sh
exports each as the variable auth.conf names; nats-server refuses to start on a missing one), every
service logs in as the user of its role with the very secret the server holds, and the same for Redis
users (deploy/redis/users.acl, rendered in the redis container); the NATS CLI in nats-box is the
operator (admin). Every secret is a file of its own, and the shipped files (deploy/secrets/) exist.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from collm_ops import nats_auth
from tests.unit.ops.test_compose import collm_services, env_of, interpolate, secrets_of

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[3]
NATS_USER_OF = {"aggregator": "aggregator", "coordinator": "coordinator", "gateway": "gateway"}
REDIS_USER_OF = {
    "aggregator": "collm-aggregator",
    "coordinator": "collm-reader",
    "gateway": "collm-gateway",
    "replica": "collm-replica",
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return interpolate(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


def exported(secret: str) -> str:
    """The variable deploy/secrets-env.sh exports a secret file as."""
    return secret.upper().replace("-", "_")


def test_every_secret_is_a_file_of_its_own_and_the_shipped_ones_exist(compose: dict[str, Any]) -> None:
    files = {name: spec["file"] for name, spec in compose["secrets"].items()}
    assert len(set(files.values())) == len(files), "two secrets share a file"
    for name, file in files.items():
        assert file == f"./deploy/secrets/{name}", name
        assert (ROOT / file).is_file(), f"{file} is missing"
    used = {s for svc in compose["services"].values() for s in secrets_of(svc).values()}
    assert used == set(files), f"declared but unused: {set(files) - used}; undeclared: {used - set(files)}"
    assert (ROOT / "deploy/secrets/collm_admin_key").read_text().strip() == "", "no admin key by default"


def test_secrets_env_exports_each_secret_file(tmp_path: Path) -> None:
    script = (ROOT / "deploy/secrets-env.sh").read_text()
    assert "/run/secrets/*" in script
    run_secrets = tmp_path / "run-secrets"
    run_secrets.mkdir()
    (run_secrets / "nats_password_replica_r0").write_text("pw-r0\n")
    (run_secrets / "redis_password").write_text("pw-default\n")
    local = tmp_path / "secrets-env.sh"
    local.write_text(script.replace("/run/secrets/*", f"{run_secrets}/*"))
    out = subprocess.run(
        ["sh", str(local), "sh", "-c", 'echo "$NATS_PASSWORD_REPLICA_R0 $REDIS_PASSWORD"'],
        capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]},
    )  # fmt: skip
    assert out.stdout == "pw-r0 pw-default\n"


def test_nats_server_has_every_users_password_and_the_auth_file(compose: dict[str, Any]) -> None:
    nats = compose["services"]["nats"]
    have = {exported(s) for s in secrets_of(nats).values()}
    for u in nats_auth.users():
        assert u.password_var in have, f"nats lacks ${u.password_var} ({u.name})"
    assert nats["command"][:2] == ["sh", "/etc/nats/secrets-env.sh"], "the secrets reach nats-server"
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in nats["volumes"]}
    assert mounts["/etc/nats/auth.conf"] == "./deploy/nats/auth.conf"
    assert mounts["/etc/nats/secrets-env.sh"] == "./deploy/secrets-env.sh"
    assert "include ./auth.conf" in (ROOT / "deploy/nats/nats.conf").read_text()


def test_each_service_logs_in_as_its_own_nats_user(compose: dict[str, Any]) -> None:
    server = {exported(s): s for s in secrets_of(compose["services"]["nats"]).values()}
    seen = set()
    for name, (target, svc) in collm_services(compose).items():
        env = env_of(svc)
        want = f"replica-{env['COLLM_REPLICA_ID']}" if target == "replica" else NATS_USER_OF[target]
        assert env["COLLM_NATS_USER"] == want, name
        assert "COLLM_NATS_PASSWORD" not in env, f"{name}: the password is a secret, not a variable"
        assert secrets_of(svc)["collm_nats_password"] == server[nats_auth.password_var(want)], name
        seen.add(want)
        # Its container health check pings its own kind of micro service: that user may.
        user = next(u for u in nats_auth.users() if u.name == want)
        assert f"$SRV.PING.collm-{target}" in user.publish
    assert len(seen) == len(collm_services(compose)), "two services share a NATS user"
    box = compose["services"]["nats-box"]
    assert secrets_of(box) == {"nats_password_admin": server["NATS_PASSWORD_ADMIN"]}
    start = " ".join(box["command"])
    assert "--user admin" in start and "cat /run/secrets/nats_password_admin" in start


def test_each_service_logs_in_as_its_redis_user(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    have = {exported(s) for s in secrets_of(redis).values()}
    acl = (ROOT / "deploy/redis/users.acl").read_text()
    defined = set(re.findall(r"^user (\S+) ", acl, re.MULTILINE))
    assert defined == {"default", *REDIS_USER_OF.values()}
    rules = "\n".join(ln for ln in acl.splitlines() if ln.startswith("user "))
    for var in set(re.findall(r"\$\{([A-Z_]+)\}", rules)) - {"COLLM_REDIS_PREFIX"}:
        assert var in have, f"redis lacks ${var}"  # render-acl.sh fails on a missing one
    assert env_of(redis)["COLLM_REDIS_PREFIX"], "the users' key patterns"
    assert redis["command"][:2] == ["sh", "/usr/local/etc/redis/secrets-env.sh"]
    for name, (target, svc) in collm_services(compose).items():
        user = REDIS_USER_OF[target]
        assert env_of(svc)["COLLM_REDIS_URL"] == f"redis://{user}@redis:6379/0", name
        assert exported(secrets_of(svc)["collm_redis_password"]) == (
            "REDIS_PASSWORD_" + user.removeprefix("collm-").upper()
        ), name


def test_only_the_gateway_gets_the_admin_key(compose: dict[str, Any]) -> None:
    for name, (target, svc) in collm_services(compose).items():
        has = secrets_of(svc).get("collm_admin_key") == "collm_admin_key"
        assert has == (target == "gateway"), name
