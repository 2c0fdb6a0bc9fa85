"""The closed local store: the Redis ACL users of deploy/redis/users.acl for a redis-server the launcher
starts itself.

When `collm up` (the launcher) starts its own redis-server, that server runs with the users and key
patterns compose gives its Redis (deploy/redis/users.acl, the one definition of them) and a random
password per user, and every service logs in as its compose user: the aggregator as `collm-aggregator`
(the only writer of versions and round records), replicas as `collm-replica`, the gateway as
`collm-gateway`, the coordinator as `collm-reader` (read-only); the `default` user may only PING. The
launcher, `collm` and operators use `collm-admin`, which this module adds (every key and command), so a
process on the host without a password can neither read nor rewrite the adapter catalogue.

Everything lives in `<run_dir>/redis-auth/` (mode 0700), each file mode 0600:

* `credentials.json`: user -> password, kept across runs of the same run directory.
* `users.acl`: the rendered ACL file (the launcher starts redis-server with `--aclfile` on it).
* `operator.env`: the operator's login as shell variables for `collm` (`COLLM_REDIS_URL` naming
  `collm-admin`, `COLLM_REDIS_PASSWORD`) and redis-cli (`REDISCLI_AUTH` with `--user collm-admin`):
  `. .collm/run/redis-auth/operator.env`.

The launcher names the files it writes, never a password.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from collm_ops.local_bus import keep_passwords, private_dir, write_private

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "redis" / "users.acl"
DIR_NAME = "redis-auth"
CREDENTIALS_FILE = "credentials.json"
ACL_FILE = "users.acl"
OPERATOR_ENV_FILE = "operator.env"
OPERATOR_USER = "collm-admin"
# The template's password variable of each user.
PASSWORD_VARS = {
    "default": "REDIS_PASSWORD",
    "collm-aggregator": "REDIS_PASSWORD_AGGREGATOR",
    "collm-replica": "REDIS_PASSWORD_REPLICA",
    "collm-gateway": "REDIS_PASSWORD_GATEWAY",
    "collm-reader": "REDIS_PASSWORD_READER",
}
# The user each service logs in as (as in docker-compose.yml).
SERVICE_USERS = {
    "aggregator": "collm-aggregator",
    "replica": "collm-replica",
    "gateway": "collm-gateway",
    "coordinator": "collm-reader",
}
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


# --- pure -----------------------------------------------------------------------------------------------
def render_acl(template: str, values: Mapping[str, str]) -> str:
    """The template as deploy/redis/render-acl.sh renders it: comment and blank lines dropped, every
    `${NAME}` replaced by `values[NAME]` (a missing, empty or blank value is an error)."""
    out = []
    for line in template.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue

        def sub(m: re.Match[str]) -> str:
            value = values.get(m.group(1), "")
            if not value or any(c.isspace() for c in value):
                raise ValueError(f"{m.group(1)} is not set (or holds whitespace)")
            return value

        out.append(_VAR.sub(sub, line))
    return "\n".join(out) + "\n"


def acl_file(template: str, passwords: Mapping[str, str], prefix: str) -> str:
    """The ACL file of a local stack: the template's users with these passwords, and the operator."""
    values = {var: passwords[user] for user, var in PASSWORD_VARS.items()} | {"COLLM_REDIS_PREFIX": prefix}
    operator = f"user {OPERATOR_USER} on >{passwords[OPERATOR_USER]} ~* &* +@all\n"
    return render_acl(template, values) + operator


def user_url(redis_url: str, user: str) -> str:
    """`redis_url` naming `user` (no password: that goes in COLLM_REDIS_PASSWORD)."""
    parts = urlsplit(redis_url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{user}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def operator_env(redis_url: str, password: str) -> str:
    values = {
        "COLLM_REDIS_URL": user_url(redis_url, OPERATOR_USER),
        "COLLM_REDIS_PASSWORD": password,
        "REDISCLI_AUTH": password,
    }
    head = (
        "# The operator's login to a local CoLLM stack's Redis (every key): . THIS_FILE; redis-cli then "
        f"needs --user {OPERATOR_USER}\n"
    )
    return head + "".join(f"export {k}={v}\n" for k, v in values.items())


# --- files ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LocalStore:
    """The closed local store of one run directory: where its files are and every user's password."""

    directory: Path
    passwords: dict[str, str]
    redis_url: str

    @property
    def acl_path(self) -> Path:
        return self.directory / ACL_FILE

    @property
    def operator_env_path(self) -> Path:
        return self.directory / OPERATOR_ENV_FILE

    def login(self, user: str) -> tuple[str, str]:
        """(URL naming `user`, its password)."""
        return user_url(self.redis_url, user), self.passwords[user]

    def service_env(self, service: str) -> dict[str, str]:
        """`COLLM_REDIS_URL` (naming the service's user) and `COLLM_REDIS_PASSWORD`."""
        url, password = self.login(SERVICE_USERS[service])
        return {"COLLM_REDIS_URL": url, "COLLM_REDIS_PASSWORD": password}


def prepare(run_dir: Path, redis_url: str, prefix: str, template: Path = TEMPLATE) -> LocalStore:
    """Write (or bring up to date) `<run_dir>/redis-auth/`: credentials, ACL file, operator login."""
    d = private_dir(run_dir / DIR_NAME)
    passwords = keep_passwords(d / CREDENTIALS_FILE, [*PASSWORD_VARS, OPERATOR_USER])
    write_private(d / ACL_FILE, acl_file(template.read_text(encoding="utf-8"), passwords, prefix))
    write_private(d / OPERATOR_ENV_FILE, operator_env(redis_url, passwords[OPERATOR_USER]))
    return LocalStore(d, passwords, redis_url)
