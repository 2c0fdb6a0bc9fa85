"""Settings shared by every service.

Every service reads its configuration through a subclass of `CommonSettings`; beside it only
OpenTelemetry's own `OTEL_*` variables are read (`tracing.py`), and the replica sets Hugging Face's
`HF_*` defaults for its model loader (`collm_replica.models`). Environment variables carry the
`COLLM_` prefix (`COLLM_NATS_URL`, ...), values are validated when the settings object is built, and
every field documents itself so the settings page (docs/settings.md) and the compose checks can be
generated from the classes.

Secrets can come from files instead: with `COLLM_SECRETS_DIR` set (docker-compose.yml sets
/run/secrets, where compose mounts its secrets), a file there named like a variable in lower case
(`collm_nats_password`, `collm_redis_password`, `collm_admin_key`) gives that setting's value; a variable
that is set wins over the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

SECRETS_DIR_VAR = "COLLM_SECRETS_DIR"


def with_password(url: str, password: str) -> str:
    """`url` (redis:// or rediss://) with `password` for the user it names; refuses a URL that carries
    another password (one built from these settings carries the same one: unchanged)."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"COLLM_REDIS_PASSWORD needs a redis:// or rediss:// URL (got {parts.scheme}://)")
    if parts.password is not None:
        if unquote(parts.password) == password:
            return url
        raise ValueError("COLLM_REDIS_URL carries a password and COLLM_REDIS_PASSWORD another one: give one")
    host = parts.netloc.rsplit("@", 1)[-1]
    user = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def sentinel_addresses(text: str) -> list[tuple[str, int]]:
    """(host, port) of each `host:port` in a comma separated list (COLLM_REDIS_SENTINELS); ValueError
    naming a malformed one."""
    out = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"COLLM_REDIS_SENTINELS takes host:port, comma separated (got {item!r})")
        out.append((host, int(port)))
    return out


class CommonSettings(BaseSettings):
    """Connection and observability settings that every service has."""

    model_config = SettingsConfigDict(
        env_prefix="COLLM_", env_file=None, extra="ignore", validate_default=True, frozen=True
    )

    secrets_dir: Path | None = Field(
        None,
        description="Directory of secret files named like the variables in lower case "
        "(`collm_nats_password`, ...): each gives that setting when its variable is unset "
        "(docker-compose.yml: /run/secrets).",
    )
    nats_url: str = Field(
        "nats://127.0.0.1:4222",
        description="NATS server URL(s), comma separated: on a NATS cluster list several nodes; the "
        "connection reconnects to another listed (or cluster-announced) node when its node goes away.",
    )
    nats_user: str | None = Field(
        None,
        description="NATS user name (when the server requires auth). Replies to this service's requests "
        "then arrive under its own inbox prefix `_INBOX.<user>` (deploy/nats/auth.conf allows each user "
        "only its own).",
    )
    nats_password: str | None = Field(
        None, description="NATS password for `nats_user` (or the file `collm_nats_password`, see above)."
    )
    nats_token: str | None = Field(
        None, description="NATS authorization token (a server secured by one shared token instead of users)."
    )
    nats_creds_file: str | None = Field(
        None, description="NATS credentials file (JWT and NKey seed; decentralised auth with `nsc`)."
    )
    nats_connect_timeout_s: float = Field(
        30.0, gt=0, description="How long a service keeps retrying its first NATS connection."
    )
    nats_stream_replicas: int = Field(
        1,
        ge=1,
        le=5,
        description="Replicas of each JetStream stream CoLLM creates (`collm_common.streams`): 1 on one "
        "nats-server, 3 on a three-node NATS cluster (a stream then survives the loss of one node). An "
        "existing stream keeps the replicas it was created with.",
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis URL of the adapter store (with `redis_sentinels`: only its user, password and "
        "database count; the primary's address comes from the Sentinels).",
    )
    redis_sentinels: str = Field(
        "",
        description="Redis Sentinel addresses, host:port comma separated. When set, the adapter store "
        "connects to the primary that the Sentinels name `redis_sentinel_master`, and to the new primary "
        "after a failover. Empty: COLLM_REDIS_URL's host.",
    )
    redis_sentinel_master: str = Field(
        "collm", min_length=1, description="Name of the primary that the Sentinels monitor."
    )
    redis_sentinel_password: SecretStr | None = Field(
        None,
        description="Password of the Sentinels themselves (their `requirepass`), or the file "
        "`collm_redis_sentinel_password`; none: Sentinels without a password.",
    )
    redis_password: SecretStr | None = Field(
        None,
        description="Password of the Redis user that COLLM_REDIS_URL names (redis://user@host:6379/0), for a "
        "URL without one (or the file `collm_redis_password`, see above); it goes into the URL.",
    )
    redis_prefix: str = Field(
        "collm", pattern=r"^[A-Za-z0-9_.-]+$", description="Namespace of every Redis key CoLLM writes."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    log_json: bool = Field(True, description="Structured JSON logs (one object per line, with trace ids).")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Port of the Prometheus /metrics endpoint (None: off, 0: any)."
    )
    fixed_ratio_k: int = Field(
        5,
        ge=1,
        description="K of the fixed-ratio baseline: K inference iterations per training step, on every "
        "service alike (the coordinator's `fixed_ratio` policy grants the share 1/(K+1); a replica's "
        "`fixed` co-scheduler runs one training step every K iterations).",
    )

    def __init__(self, **values: Any) -> None:
        # Compose secrets: files in COLLM_SECRETS_DIR named like the variables (pydantic's secrets_dir).
        values.setdefault("_secrets_dir", os.environ.get(SECRETS_DIR_VAR) or None)
        super().__init__(**values)

    @model_validator(mode="before")
    @classmethod
    def _redis_password_into_url(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("redis_password"):
            return data
        password = data["redis_password"]
        if isinstance(password, SecretStr):
            password = password.get_secret_value()
        url = data.get("redis_url") or cls.model_fields["redis_url"].default
        return {**data, "redis_url": with_password(str(url), str(password))}

    @field_validator("nats_url")
    @classmethod
    def _nats_scheme(cls, v: str) -> str:
        for url in v.split(","):
            if not url.strip().startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ValueError(f"COLLM_NATS_URL must be nats://host:port (got {url!r})")
        return v

    @field_validator("redis_sentinels")
    @classmethod
    def _sentinel_addresses(cls, v: str) -> str:
        sentinel_addresses(v)
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"COLLM_REDIS_URL must be redis://host:port/db (got {v!r})")
        return v
