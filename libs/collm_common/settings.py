"""Settings shared by every service.

Every service reads its configuration through a subclass of `CommonSettings`; nothing else in CoLLM reads
the environment. Environment variables carry the `COLLM_` prefix (`COLLM_NATS_URL`, ...), values are
validated when the settings object is built, and every field documents itself so the README table and the
compose checks can be generated from the classes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class CommonSettings(BaseSettings):
    """Connection and observability settings that every service has."""

    model_config = SettingsConfigDict(
        env_prefix="COLLM_", env_file=None, extra="ignore", validate_default=True, frozen=True
    )

    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma separated.")
    nats_user: str | None = Field(
        None,
        description="NATS user name (when the server requires auth). Replies to this service's requests "
        "then arrive under its own inbox prefix `_INBOX.<user>` (deploy/nats/auth.conf allows each user "
        "only its own).",
    )
    nats_password: str | None = Field(None, description="NATS password for `nats_user`.")
    nats_token: str | None = Field(
        None, description="NATS authorization token (a server secured by one shared token instead of users)."
    )
    nats_creds_file: str | None = Field(
        None, description="NATS credentials file (JWT and NKey seed; decentralised auth with `nsc`)."
    )
    nats_connect_timeout_s: float = Field(
        30.0, gt=0, description="How long a service keeps retrying its first NATS connection."
    )
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL of the adapter store.")
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

    @field_validator("nats_url")
    @classmethod
    def _nats_scheme(cls, v: str) -> str:
        for url in v.split(","):
            if not url.strip().startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ValueError(f"COLLM_NATS_URL must be nats://host:port (got {url!r})")
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"COLLM_REDIS_URL must be redis://host:port/db (got {v!r})")
        return v
