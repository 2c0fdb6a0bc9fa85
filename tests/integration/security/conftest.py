"""Real nats-server and redis-server started with CoLLM's shipped security configuration.

`secure_nats` runs the shipped deploy/nats/nats.conf (which includes auth.conf), templated only where a
test must differ from compose: a free port, the JetStream store and the monitoring port on a temporary
directory, a server log file to read violations from, and random passwords in the environment, exactly
as compose passes them. `secure_redis` renders deploy/redis/users.acl with the shipped render-acl.sh and
starts redis-server with `--aclfile` on it.
"""

from __future__ import annotations

import io
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from collm_common.bus import inbox_prefix
from collm_ops import nats_auth
from collm_ops.launcher import Stack, StackConfig
from collm_ops.servers import ServerProcess, free_port, start_nats, start_redis

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
REPLICAS = ("r0", "r1", "r2")
REDIS_USERS = {
    "REDIS_PASSWORD": "default",
    "REDIS_PASSWORD_AGGREGATOR": "collm-aggregator",
    "REDIS_PASSWORD_REPLICA": "collm-replica",
    "REDIS_PASSWORD_GATEWAY": "collm-gateway",
    "REDIS_PASSWORD_READER": "collm-reader",
}


def password() -> str:
    return "t-" + secrets.token_hex(12)  # starts with a letter: nats-server parses it as a string


@dataclass
class SecureNats:
    server: ServerProcess
    log: Path
    passwords: dict[str, str]  # user -> password

    @property
    def url(self) -> str:
        return self.server.url

    async def connect(
        self, user: str, password: str | None = None, errors: list[str] | None = None, **kw: object
    ) -> Client:
        """A raw nats-py client logged in as `user`, replies under its own inbox prefix; asynchronous
        errors (permission violations) are appended to `errors`."""
        sink = errors if errors is not None else []

        async def on_error(exc: Exception) -> None:
            sink.append(str(exc))

        return await nats.connect(
            self.url,
            user=user,
            password=self.passwords[user] if password is None else password,
            inbox_prefix=inbox_prefix(user),
            error_cb=on_error,
            allow_reconnect=False,
            connect_timeout=2,
            **kw,  # type: ignore[arg-type]
        )

    def violations(self) -> list[tuple[str, str, str]]:
        """(user, "Publish"|"Subscription", subject) of every violation the server logged so far."""
        text = self.log.read_text() if self.log.exists() else ""
        found = re.findall(r'"\$G/user:([^"]+)" - (Publish|Subscription) Violation - Subject "([^"]+)"', text)
        return [(user, kind, subj) for user, kind, subj in found]


def render_nats_conf(tmp: Path) -> tuple[Path, Path]:
    """The shipped nats.conf and auth.conf, copied; only store_dir (the command line gives it), the
    monitoring port and a log file differ. Returns (config, log file)."""
    d = tmp / "nats-conf"
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(DEPLOY / "nats" / "auth.conf", d / "auth.conf")
    text = (DEPLOY / "nats" / "nats.conf").read_text()
    assert re.search(r"^\s*store_dir: /data$", text, re.MULTILINE), "compose stores JetStream on /data"
    text = re.sub(r"^\s*store_dir: /data\n", "", text, flags=re.MULTILINE)
    text, n = re.subn(r"^http: .*$", f"http: 127.0.0.1:{free_port()}", text, flags=re.MULTILINE)
    assert n == 1 and "include ./auth.conf" in text
    log = tmp / "nats-server.log"
    (d / "nats.conf").write_text(text + f'\nlog_file: "{log}"\n')
    return d / "nats.conf", log


@pytest.fixture
def secure_nats(tmp_path: Path) -> Iterator[SecureNats]:
    users = [u.name for u in nats_auth.users()]
    passwords = {u: password() for u in users}
    env = {nats_auth.password_var(u): pw for u, pw in passwords.items()}
    config, log = render_nats_conf(tmp_path)
    srv = start_nats(workdir=tmp_path / "nats", config=config, env=env)
    try:
        yield SecureNats(srv, log, passwords)
    finally:
        srv.stop()


@dataclass
class SecureRedis:
    server: ServerProcess
    passwords: dict[str, str]  # user -> password
    prefix: str = "collm"
    acl: Path = field(default_factory=Path)

    def url(self, user: str, password: str | None = None) -> str:
        pw = self.passwords[user] if password is None else password
        return f"redis://{user}:{pw}@127.0.0.1:{self.server.port}/0"


def render_acl(out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """deploy/redis/render-acl.sh on the shipped template, as compose runs it."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_", "COLLM_REDIS"))}
    with out.open("w") as f:
        return subprocess.run(
            ["sh", str(DEPLOY / "redis" / "render-acl.sh"), str(DEPLOY / "redis" / "users.acl")],
            env={**full, **env},
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )


@pytest.fixture
def secure_redis(tmp_path: Path) -> Iterator[SecureRedis]:
    passwords = {user: password() for user in REDIS_USERS.values()}
    env = {var: passwords[user] for var, user in REDIS_USERS.items()} | {"COLLM_REDIS_PREFIX": "collm"}
    acl = tmp_path / "users.acl"
    done = render_acl(acl, env)
    assert done.returncode == 0, done.stderr
    srv = start_redis(workdir=tmp_path / "redis", extra_args=["--aclfile", str(acl)])
    try:
        yield SecureRedis(srv, passwords, "collm", acl)
    finally:
        srv.stop()


@contextmanager
def running(cfg: StackConfig) -> Iterator[Stack]:
    """The launcher's stack for `cfg`, started and stopped; its log is `stack.logs` (a StringIO), and its
    tail is printed when the start fails."""
    logs = io.StringIO()
    s = Stack(cfg, log_sink=logs)
    try:
        s.start()
    except Exception:
        print(logs.getvalue()[-6000:])
        raise
    s.logs = logs  # type: ignore[attr-defined]
    try:
        yield s
    finally:
        s.stop()
