"""The NATS and Redis of a launched stack (`collm_ops.launcher`): used as found when they answer on their
ports, else started by the launcher on localhost (closed by default: `collm_ops.local_bus`,
`collm_ops.local_store`), and the operator's logins to them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import urlparse

from collm_common.settings import CommonSettings
from collm_ops import local_bus, local_store
from collm_ops.child_env import consumer_name
from collm_ops.local_bus import LocalBus
from collm_ops.local_store import LocalStore
from collm_ops.servers import ServerProcess, port_open, start_nats, start_redis
from collm_ops.stack_config import StackConfig

LOCAL_HOSTS = ("127.0.0.1", "localhost")


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    u = urlparse(url.split(",")[0])
    return u.hostname or "127.0.0.1", u.port or default_port


class StackServers:
    """The servers this launcher started (`servers`, what supervision may restart) and, when it started
    them closed, their users (`local_bus`, `local_store`). `log(line)` is the launcher's log."""

    def __init__(self, config: StackConfig, log: Callable[[str], None]) -> None:
        self.config = config
        self.log = log
        self.servers: list[ServerProcess] = []
        # The closed local bus, when the launcher started its own nats-server with users.
        self.local_bus: LocalBus | None = None
        self.local_store: LocalStore | None = None

    def ensure(self) -> None:
        """NATS, then Redis: found answering, or started here (`StackConfig.start_servers`, localhost
        only); a RuntimeError when one neither answers nor can be started."""
        self._ensure_nats()
        self._ensure_redis()

    def _ensure_nats(self) -> None:
        cfg = self.config
        nats_host, nats_port = _host_port(cfg.nats_url, 4222)
        if port_open(nats_host, nats_port):
            self.log(f"using NATS at {cfg.nats_url}")
            earlier = cfg.run_dir / local_bus.DIR_NAME
            if cfg.start_servers and cfg.closed_bus and earlier.is_dir():
                self.log(
                    f"the services log in to it as configured, not as the users in {earlier}: a "
                    "nats-server left running by an earlier `collm up` with this run directory refuses "
                    "them (stop it, then start again)",
                )
            return
        if not (cfg.start_servers and nats_host in LOCAL_HOSTS):
            raise RuntimeError(f"NATS does not answer at {cfg.nats_url}")
        config = cfg.nats_config
        if config is None and cfg.closed_bus:
            self.local_bus = local_bus.prepare(
                cfg.run_dir, [r.replica_id for r in cfg.replicas], cfg.nats_url, consumer_name(cfg)
            )
            config = self.local_bus.config_path
        srv = start_nats(port=nats_port, workdir=cfg.run_dir / "nats", config=config, env=cfg.nats_env)
        self.servers.append(srv)
        if self.local_bus is None:
            self.log(f"started nats-server (JetStream) on {nats_port}")
            return
        self.log(
            f"started nats-server (JetStream) on {nats_port}, closed: one user per service; "
            f"operator login (NATS CLI, collm): . {self.local_bus.operator_env_path}",
        )
        asyncio.run(self._create_streams())

    def _ensure_redis(self) -> None:
        cfg = self.config
        redis_host, redis_port = _host_port(cfg.redis_url, 6379)
        if port_open(redis_host, redis_port):
            self.log(f"using Redis at {cfg.redis_url}")
            return
        if not (cfg.start_servers and redis_host in LOCAL_HOSTS):
            raise RuntimeError(f"Redis does not answer at {cfg.redis_url}")
        acl: list[str] = []
        if cfg.closed_store:
            self.local_store = local_store.prepare(cfg.run_dir, cfg.redis_url, cfg.redis_prefix)
            acl = ["--aclfile", str(self.local_store.acl_path)]
        srv = start_redis(port=redis_port, workdir=cfg.run_dir / "redis", extra_args=acl)
        self.servers.append(srv)
        if self.local_store is None:
            self.log(f"started redis-server on {redis_port}")
        else:
            self.log(
                f"started redis-server on {redis_port}, closed: one ACL user per service; operator "
                f"login (collm, redis-cli --user {local_store.OPERATOR_USER}): "
                f". {self.local_store.operator_env_path}",
            )

    @property
    def nats_login(self) -> tuple[str | None, str | None]:
        """(user, password) of the operator: the closed local bus's `admin`, else
        `StackConfig.nats_user` / `nats_password`."""
        if self.local_bus is not None:
            return self.local_bus.login(local_bus.OPERATOR_USER)
        return self.config.nats_user, self.config.nats_password

    @property
    def redis_login(self) -> tuple[str, str | None]:
        """(URL, password) of the operator: the closed local store's `collm-admin`, else
        `StackConfig.redis_url` as it is."""
        if self.local_store is not None:
            return self.local_store.login(local_store.OPERATOR_USER)
        return self.config.redis_url, None

    def operator_settings(self, **overrides: object) -> CommonSettings:
        """Connection settings of an operator client (NATS and Redis logins, Redis prefix)."""
        user, password = self.nats_login
        redis_url, redis_password = self.redis_login
        fields: dict[str, object] = {
            "nats_url": self.config.nats_url,
            "nats_user": user,
            "nats_password": password,
            "redis_url": redis_url,
            "redis_password": redis_password,
            "redis_prefix": self.config.redis_prefix,
        }
        return CommonSettings(**{**fields, **overrides})  # type: ignore[arg-type]

    async def _create_streams(self) -> None:
        """Create the JetStream streams as the operator (on a closed bus no replica may create them, and
        one may start before the aggregator has)."""
        from collm_common.bus import Bus
        from collm_common.streams import ensure_streams

        settings = self.operator_settings(nats_connect_timeout_s=10.0)
        bus = await Bus.connect(settings, "collm-launcher")
        try:
            await ensure_streams(bus.js, settings.nats_stream_replicas)
        finally:
            await bus.close()

    def stop(self) -> None:
        """Stop the servers started here, last started first (their data directories stay)."""
        for srv in reversed(self.servers):
            srv.stop_keep_dir()
        self.servers.clear()
