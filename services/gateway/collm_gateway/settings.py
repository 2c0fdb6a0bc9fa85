"""Gateway settings (environment variables `COLLM_*`, validated at construction).

Timeouts follow the request's life: `first_event_timeout_s` bounds the wait for a replica's first answer
(Accepted or a refusal, which replicas send at admission), `first_token_timeout_s` the wait from Accepted
to the first token (queueing plus prefill), `inter_token_timeout_s` every later gap, and
`request_deadline_s` the whole request. A refusal (429/503/no responders) or a silent replica before
Accepted is retried on the next ranked replica, at most `max_retries` times.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from collm_common.settings import CommonSettings
from collm_common.wire.inference import MAX_CHOICES
from collm_gateway.keys import ApiKeySpec, parse_keys, read_keys_file


class SloDefaults(BaseModel):
    """Latency targets of one model when a request names none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: float | None = Field(None, gt=0, description="Time to first token target (ms).")
    tpot_ms: float | None = Field(None, gt=0, description="Time per output token target (ms).")


def _default_gateway_id() -> str:
    host = "".join(c if c.isalnum() or c in "_-" else "-" for c in socket.gethostname())[:40] or "gw"
    return f"{host}-gw"


class GatewaySettings(CommonSettings):
    """The OpenAI-compatible HTTP front of CoLLM."""

    gateway_id: str = Field(
        default_factory=_default_gateway_id,
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="Instance id of this gateway (micro service metadata, logs, traces).",
    )
    host: str = Field("0.0.0.0", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0: any free port).")
    base_model: str = Field(
        "SmolLM2-135M-Instruct",
        min_length=1,
        max_length=128,
        description="Model id of the base model in the API (`GET /v1/models`, request `model`). "
        "Adapters are addressed by their own names, `name` or `name@vN`.",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Context length advertised on the model cards (None: not advertised)."
    )
    # --- SLOs -------------------------------------------------------------------------------------------
    slo_ttft_ms: float | None = Field(
        1000.0, gt=0, description="Default TTFT target (ms) for models without their own default."
    )
    slo_tpot_ms: float | None = Field(
        100.0, gt=0, description="Default TPOT target (ms) for models without their own default."
    )
    slo_defaults: dict[str, SloDefaults] = Field(
        default_factory=dict,
        description='Per-model SLO defaults, JSON: {"medical": {"ttft_ms": 500, "tpot_ms": 80}}; keys '
        "are model ids (the base model id or an adapter name). A request's own targets win.",
    )
    # --- limits -----------------------------------------------------------------------------------------
    max_body_bytes: int = Field(
        1 << 20,
        ge=1024,
        description="Largest accepted HTTP request body (bytes); larger gets 413. A smaller body whose "
        "request, packed for a replica with its trace headers, exceeds NATS's `max_payload` (1 MiB by "
        "default) gets 413 too.",
    )
    max_tokens_limit: int = Field(
        4096, ge=1, description="Largest `max_tokens` a request may ask for; more gets 400."
    )
    default_max_tokens: int = Field(
        256, ge=1, description="`max_tokens` of a request that sets none (capped by max_tokens_limit)."
    )
    max_n: int = Field(
        8,
        ge=1,
        le=MAX_CHOICES,
        description="Largest `n` (choices per request, decoded from one prefill of the prompt); more gets "
        "400. A replica also refuses an `n` whose choices do not fit its batch or KV cache at once.",
    )
    max_prompts: int = Field(
        64,
        ge=1,
        description="Largest list of prompts one `/v1/completions` request may send (each answered by its "
        "own choices, as OpenAI and vLLM do; LangChain's batch sends 20); more gets 400.",
    )
    # --- API keys, tenants, rate limits (see collm_gateway/keys.py and docs/api.md) ----
    api_keys: dict[str, ApiKeySpec] = Field(
        default_factory=dict,
        description='API keys, JSON {"<sha256 hex of the key>": {"tenant": "acme", "admin": false, '
        '"rate_limit_rps": 5, "burst": 10}}. Keys are stored hashed only. With no keys here nor in '
        "COLLM_API_KEYS_FILE the gateway is open: any key is accepted and every adapter is usable.",
    )
    api_keys_file: Path | None = Field(
        None,
        description="YAML/JSON file of the same mapping (`python -m collm_gateway.keys add` writes it); "
        "re-read when it changes. Set, it turns keys on even while it holds none.",
    )
    api_keys_reload_s: float = Field(
        2.0, gt=0, description="How often the keys file is checked for changes (s)."
    )
    admin_key: SecretStr | None = Field(
        None,
        description="An admin key (the key itself; kept only as its hash in memory). Admin endpoints "
        "need an admin key: this one or a key with admin: true; with neither, they answer 403. Empty is "
        "none (compose's empty `collm_admin_key` secret file).",
    )
    rate_limit_rps: float | None = Field(
        None, gt=0, description="Default per-key rate limit (requests/s) for keys without their own."
    )
    rate_limit_burst: int | None = Field(
        None, ge=1, description="Default bucket size of that limit (None: one second's worth)."
    )
    # --- admin endpoints --------------------------------------------------------------------------------
    admin_timeout_s: float = Field(
        60.0, gt=0, description="Wait for the aggregator's answer to an adapter load or rollback (s)."
    )
    samples_ack_timeout_s: float = Field(
        20.0,
        gt=0,
        description=(
            "Wait for JetStream to acknowledge one uploaded training sample (s); covers a stream leader "
            "election after a lost NATS node (followers wait 4-9 s before they campaign)."
        ),
    )
    max_samples_per_request: int = Field(
        1000, ge=1, description="Most training samples one `POST /v1/samples` may carry."
    )
    # --- timeouts and retries ---------------------------------------------------------------------------
    first_event_timeout_s: float = Field(
        2.0,
        gt=0,
        description="Wait for a replica's first answer (Accepted or refusal) before trying another.",
    )
    first_token_timeout_s: float = Field(
        60.0, gt=0, description="Wait from Accepted to the first token before failing with 504."
    )
    inter_token_timeout_s: float = Field(
        30.0, gt=0, description="Longest gap between two streamed events before failing with 504."
    )
    request_deadline_s: float = Field(
        600.0, gt=0, description="Overall deadline of one request; the replica drops it after that too."
    )
    sse_ping_s: float = Field(
        15.0, gt=0, description="Send an SSE keep-alive comment after this much silence in a stream."
    )
    max_retries: int = Field(
        2, ge=0, le=16, description="Other replicas tried when one refuses before accepting (429/503)."
    )
    retry_after_s: int = Field(
        1, ge=1, description="`Retry-After` seconds sent with 503 (no replica) and 429 (all queues full)."
    )
    # --- cluster view and routing -----------------------------------------------------------------------
    telemetry_stale_s: float = Field(
        3.0, gt=0, description="A replica whose last telemetry is older than this is not routed to."
    )
    telemetry_stale_intervals: float = Field(
        3.0,
        gt=0,
        description="...or older than this many of its own telemetry intervals, whichever is longer.",
    )
    weights_hold_frac: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Coordinator weights apply in full for this fraction of their ttl_s, then decay "
        "linearly to even weights at ttl_s, after which they are ignored.",
    )
    adapter_miss_penalty: float = Field(
        0.5,
        ge=0.0,
        description="Least-loaded fallback: load units added to a replica where the requested adapter "
        "is not resident (1.0 = one full batch).",
    )
    models_cache_ttl_s: float = Field(
        2.0, ge=0.0, description="How long adapter names and versions read from the store are reused."
    )
    # --- NATS micro -------------------------------------------------------------------------------------
    micro_version: str = Field(
        "0.1.0",
        pattern=r"^\d+\.\d+\.\d+$",
        description="Semver reported by the `collm-gateway` micro service.",
    )

    @field_validator("admin_key", mode="before")
    @classmethod
    def _empty_admin_key_is_none(cls, v: Any) -> Any:
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("api_keys", mode="before")
    @classmethod
    def _hashed_keys(cls, v: Any) -> Any:
        return parse_keys(v) if isinstance(v, dict) else v

    @field_validator("api_keys_file")
    @classmethod
    def _readable_keys_file(cls, v: Path | None) -> Path | None:
        # Checked here so a typo stops the gateway before it serves anything (never an open gateway).
        if v is not None:
            if not v.is_file():
                raise ValueError(
                    f"COLLM_API_KEYS_FILE={v} does not exist (create it: python -m collm_gateway.keys add "
                    f"--file {v} --tenant NAME)"
                )
            read_keys_file(v)
        return v

    @property
    def keys_configured(self) -> bool:
        """Whether API keys are required (keys in the settings or a keys file named)."""
        return bool(self.api_keys) or self.api_keys_file is not None

    @model_validator(mode="after")
    def _coherent(self) -> GatewaySettings:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"COLLM_DEFAULT_MAX_TOKENS ({self.default_max_tokens}) must not exceed "
                f"COLLM_MAX_TOKENS_LIMIT ({self.max_tokens_limit})"
            )
        if self.first_event_timeout_s > self.request_deadline_s:
            raise ValueError("COLLM_FIRST_EVENT_TIMEOUT_S must not exceed COLLM_REQUEST_DEADLINE_S")
        return self

    def slo_for(self, model_id: str) -> SloDefaults:
        """Default targets of `model_id` (per-model entry, else the gateway-wide defaults)."""
        own = self.slo_defaults.get(model_id)
        return SloDefaults(
            ttft_ms=own.ttft_ms if own and own.ttft_ms is not None else self.slo_ttft_ms,
            tpot_ms=own.tpot_ms if own and own.tpot_ms is not None else self.slo_tpot_ms,
        )
