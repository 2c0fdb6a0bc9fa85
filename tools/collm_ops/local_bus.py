"""The closed local bus: the users of deploy/nats/auth.conf for a nats-server the launcher starts itself.

When `collm up` (the launcher) starts its own nats-server, that server runs with the same users and
subject permissions as deploy/nats/auth.conf (`collm_ops.nats_auth`, for this stack's replicas) and a
random password per user, and every service logs in as its own user: the gateway as `gateway`, replica
`r0` as `replica-r0` (which may publish only its own telemetry), and so on. A process on the host
without a password cannot connect, and one with a service's password may publish only what that
service may.

Everything lives in `<run_dir>/nats-auth/` (mode 0700), each file mode 0600:

* `credentials.json`: user -> password. Kept across runs of the same run directory (a replica added
  later gets a user of its own, the others keep theirs), so a login saved by an operator stays valid.
* `nats.conf`: the server's `authorization` block with those passwords (the launcher passes it with
  `-c`; the command line sets address, port and JetStream store).
* `operator.env`: the operator's login (user `admin`, every subject) as shell variables, read by the
  NATS CLI (`NATS_URL`, `NATS_USER`, `NATS_PASSWORD`) and by `collm` (`COLLM_NATS_URL`,
  `COLLM_NATS_USER`, `COLLM_NATS_PASSWORD`): `. .collm/run/nats-auth/operator.env`.

Passwords are 32 hex digits after a letter, so they need no quoting in the config or the shell. The
launcher names the files it writes, never a password.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from collm_ops import nats_auth

DIR_NAME = "nats-auth"
CREDENTIALS_FILE = "credentials.json"
CONFIG_FILE = "nats.conf"
OPERATOR_ENV_FILE = "operator.env"
OPERATOR_USER = "admin"
_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9]{15,}")

CONFIG_HEADER = """\
# nats-server configuration of a local CoLLM stack, written by the launcher (`collm up`): the users and
# subject permissions of deploy/nats/auth.conf (collm_ops.nats_auth) for replicas {replicas}, with this
# run directory's passwords (credentials.json beside this file). The command line sets address, port and
# the JetStream store.
"""


# --- pure -----------------------------------------------------------------------------------------------
def new_password() -> str:
    return "p" + secrets.token_hex(16)


def service_user(service: str, replica_id: str | None = None) -> str:
    """The NATS user a service logs in as: `gateway`, `coordinator`, `aggregator`, `replica-<id>`."""
    if service == "replica":
        if replica_id is None:
            raise ValueError("a replica's user needs its id")
        return nats_auth.replica_user(replica_id)
    return service


def complete_passwords(
    existing: Mapping[str, str], users: Sequence[str], make: Callable[[], str] = new_password
) -> dict[str, str]:
    """A password for each of `users`: the existing one when it is well formed, else a new one. Users of
    `existing` that are not in `users` are kept (a replica that is not started this time keeps its login)."""
    out = {u: p for u, p in existing.items() if isinstance(p, str) and _PASSWORD.fullmatch(p)}
    for u in users:
        if u not in out:
            out[u] = make()
    return out


def server_config(passwords: Mapping[str, str], replica_ids: Sequence[str], consumer: str) -> str:
    users = nats_auth.users(replica_ids, consumer)
    return (
        CONFIG_HEADER.format(replicas=",".join(replica_ids))
        + "\n"
        + nats_auth.render_authorization(users, passwords)
    )


def operator_env(nats_url: str, user: str, password: str) -> str:
    """`operator.env`: the operator's login for the NATS CLI and for `collm`."""
    values = {
        "NATS_URL": nats_url,
        "NATS_USER": user,
        "NATS_PASSWORD": password,
        "COLLM_NATS_URL": nats_url,
        "COLLM_NATS_USER": user,
        "COLLM_NATS_PASSWORD": password,
    }
    head = "# The operator's login to a local CoLLM stack's NATS (every subject). Source it: . THIS_FILE\n"
    return head + "".join(f"export {k}={v}\n" for k, v in values.items())


# --- files ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LocalBus:
    """The closed local bus of one run directory: where its files are and every user's password."""

    directory: Path
    passwords: dict[str, str]
    replica_ids: tuple[str, ...]

    @property
    def config_path(self) -> Path:
        return self.directory / CONFIG_FILE

    @property
    def operator_env_path(self) -> Path:
        return self.directory / OPERATOR_ENV_FILE

    def login(self, user: str) -> tuple[str, str]:
        return user, self.passwords[user]

    def service_env(self, service: str, replica_id: str | None = None) -> dict[str, str]:
        """`COLLM_NATS_USER` / `COLLM_NATS_PASSWORD` of a service's own user."""
        user, password = self.login(service_user(service, replica_id))
        return {"COLLM_NATS_USER": user, "COLLM_NATS_PASSWORD": password}


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600, replacing the file whole (never readable by others, even
    while it is written)."""
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    os.chmod(path, 0o600)


def private_dir(path: Path) -> Path:
    """`path` made (mode 0700) if missing; returned."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def keep_passwords(cred_path: Path, users: Sequence[str]) -> dict[str, str]:
    """The passwords of `users` kept in the credentials file `cred_path` (user -> password; an unreadable
    or malformed one counts as empty), new ones for users without one; written back (mode 0600)."""
    existing: dict[str, str] = {}
    if cred_path.exists():
        try:
            loaded = json.loads(cred_path.read_text())
            existing = loaded if isinstance(loaded, dict) else {}
        except (OSError, json.JSONDecodeError):
            existing = {}
    passwords = complete_passwords(existing, users)
    write_private(cred_path, json.dumps(passwords, indent=1, sort_keys=True) + "\n")
    return passwords


def prepare(
    run_dir: Path,
    replica_ids: Sequence[str],
    nats_url: str,
    consumer: str = nats_auth.AGGREGATOR_CONSUMER,
) -> LocalBus:
    """Write (or bring up to date) `<run_dir>/nats-auth/`: credentials, server config, operator login."""
    d = private_dir(run_dir / DIR_NAME)
    ids = tuple(replica_ids)
    users = [u.name for u in nats_auth.users(ids, consumer)]
    passwords = keep_passwords(d / CREDENTIALS_FILE, users)
    write_private(d / CONFIG_FILE, server_config(passwords, ids, consumer))
    write_private(d / OPERATOR_ENV_FILE, operator_env(nats_url, OPERATOR_USER, passwords[OPERATOR_USER]))
    return LocalBus(d, passwords, ids)
