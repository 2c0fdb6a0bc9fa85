"""docker-compose.yml wires the shipped security configuration: checked without a Docker engine.

Every NATS user of deploy/nats/auth.conf has its password variable in the nats container (nats-server
refuses to start on a missing one), every service logs in as the user of its role with the very value
the server holds, and the same for Redis users (deploy/redis/users.acl, rendered in the redis container);
the NATS CLI in nats-box is the operator (admin).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from collm_ops import nats_auth
from tests.unit.ops.test_compose import collm_services, env_of, interpolate

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[3]
NATS_USER_OF = {"aggregator": "aggregator", "coordinator": "coordinator", "gateway": "gateway"}
REDIS_USER_OF = {
    "aggregator": "collm-aggregator",
    "coordinator": "collm-reader",
    "gateway": "collm-gateway",
    "replica": "collm-replica",
}


def distinct_env(text: str) -> dict[str, str]:
    """A value for every ${VAR} of the compose file, each different: wiring errors cannot hide."""
    names = sorted(set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text)))
    return {n: f"value-of-{n.lower()}" for n in names if "PASSWORD" in n}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    text = (ROOT / "docker-compose.yml").read_text()
    return interpolate(yaml.safe_load(text), distinct_env(text))


def test_nats_server_has_every_users_password_and_the_auth_file(compose: dict[str, Any]) -> None:
    nats = compose["services"]["nats"]
    env = env_of(nats)
    for u in nats_auth.users():
        assert env.get(u.password_var, "").startswith("value-of-"), f"nats lacks ${u.password_var} ({u.name})"
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in nats["volumes"]}
    assert mounts["/etc/nats/auth.conf"] == "./deploy/nats/auth.conf"
    assert "include ./auth.conf" in (ROOT / "deploy/nats/nats.conf").read_text()


def test_each_service_logs_in_as_its_own_nats_user(compose: dict[str, Any]) -> None:
    server = env_of(compose["services"]["nats"])
    seen = set()
    for name, (target, svc) in collm_services(compose).items():
        env = env_of(svc)
        want = f"replica-{env['COLLM_REPLICA_ID']}" if target == "replica" else NATS_USER_OF[target]
        assert env["COLLM_NATS_USER"] == want, name
        assert env["COLLM_NATS_PASSWORD"] == server[nats_auth.password_var(want)], name
        seen.add(want)
        # Its container health check pings its own kind of micro service: that user may.
        user = next(u for u in nats_auth.users() if u.name == want)
        assert f"$SRV.PING.collm-{target}" in user.publish
    assert len(seen) == len(collm_services(compose)), "two services share a NATS user"
    box = env_of(compose["services"]["nats-box"])
    assert box["NATS_USER"] == "admin" and box["NATS_PASSWORD"] == server["NATS_PASSWORD_ADMIN"]


def test_each_service_logs_in_as_its_redis_user(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    server = env_of(redis)
    acl = (ROOT / "deploy/redis/users.acl").read_text()
    defined = set(re.findall(r"^user (\S+) ", acl, re.MULTILINE))
    assert defined == {"default", *REDIS_USER_OF.values()}
    rules = "\n".join(ln for ln in acl.splitlines() if ln.startswith("user "))
    for var in set(re.findall(r"\$\{([A-Z_]+)\}", rules)):  # render-acl.sh fails on a missing one
        assert server.get(var), f"redis lacks ${var}"
    assert server["REDISCLI_AUTH"] == server["REDIS_PASSWORD"], "the health check logs in as default"
    for name, (target, svc) in collm_services(compose).items():
        user, password = re.fullmatch(
            r"redis://([^:@]+):([^@]+)@redis:6379/0", env_of(svc)["COLLM_REDIS_URL"]
        ).groups()  # type: ignore[union-attr]
        assert user == REDIS_USER_OF[target], name
        assert password == server["REDIS_PASSWORD_" + user.removeprefix("collm-").upper()], name
    command = " ".join(redis["command"])
    assert "render-acl.sh /usr/local/etc/redis/users.acl" in command and "--aclfile" in command
    assert "--requirepass" not in command, "the ACL file defines every user, default included"
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in redis["volumes"]}
    assert mounts["/usr/local/etc/redis/users.acl"] == "./deploy/redis/users.acl"
    assert mounts["/usr/local/etc/redis/render-acl.sh"] == "./deploy/redis/render-acl.sh"
