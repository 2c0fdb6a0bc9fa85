"""Replica telemetry, published every interval on `subjects.telemetry(replica_id)`.

One message is a complete snapshot (no deltas), so a late subscriber or a coordinator that restarted
has the full picture after one interval, and a lost message costs nothing but freshness.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from collm_common.subjects import TOKEN_PATTERN, telemetry
from collm_common.wire.base import WireModel


class ResidentAdapter(WireModel):
    name: str
    version_id: str
    version: int
    in_flight: int = 0
    training: bool = False


class TrainingJobStatus(WireModel):
    adapter: str
    state: Literal["running", "paused", "done", "stopped", "failed"]
    base_version_id: str
    round_id: int | None = None
    tokens_done: int = 0
    token_budget: int = 0
    steps_done: int = 0
    train_loss: float | None = None
    eval_loss: float | None = None
    # Additive (v1): why a job failed, or what it is waiting for (e.g. an adapter slot); "" when fine.
    message: str = ""


class ReplicaTelemetry(WireModel):
    # A subject token: readers address the replica by it (`subjects.replica`), so no other id is valid.
    replica_id: str = Field(pattern=TOKEN_PATTERN)
    ts_unix_s: float
    interval_s: float
    model: str
    # Load.
    queue_len: int = 0
    running: int = 0
    max_batch: int = 0
    kv_used_frac: float = 0.0
    tokens_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    arrivals_per_s: float = 0.0
    # Latency over the telemetry window (ms; None when nothing finished in the window).
    ttft_ms_p50: float | None = None
    ttft_ms_p99: float | None = None
    tpot_ms_p50: float | None = None
    tpot_ms_p99: float | None = None
    finished: int = 0
    good: int = 0
    # Additive (v1): of `finished`, those that would have met their SLOs had the replica not trained
    # while they were in flight (`collm_common.slo.meets_slo_alone`); None: not measured.
    good_alone: int | None = None
    slo_attainment: float | None = None
    # Cost model observed by the engine (for the coordinator and the simulator): a decode step of the
    # largest batch seen, and what one prefill token adds to a step (a step's time beyond a decode step
    # of as many sequences, per prefill token).
    decode_step_ms: float | None = None
    prefill_ms_per_token: float | None = None
    train_step_ms: float | None = None
    # Fractions of the last interval the engine spent on inference iterations and on training
    # micro-steps (additive in v1; None: not measured). The coordinator learns each replica's training
    # speed from train_busy_frac (ft_tokens_per_s / train_busy_frac); without it, from ft_share.
    infer_busy_frac: float | None = None
    train_busy_frac: float | None = None
    # Fine-tuning.
    ft_share: float = 0.0
    ft_share_source: Literal["coordinator", "local_default"] = "local_default"
    # The part of the share in force trained beyond the requests' slack (SetFineTuneShare.spend).
    ft_spend: float = 0.0
    ft_tokens_per_s: float = 0.0
    ft_loss: float | None = None
    training_jobs: list[TrainingJobStatus] = Field(default_factory=list)
    # Adapters and rounds.
    adapters: list[ResidentAdapter] = Field(default_factory=list)
    round_role: Literal["idle", "participant", "done"] = "idle"
    round_id: int | None = None
    local_samples: int = 0
    domains: list[str] = Field(default_factory=list)

    def subject_error(self, subject: str) -> str | None:
        own = telemetry(self.replica_id)
        if subject == own:
            return None
        return f"telemetry of replica {self.replica_id!r} arrived on {subject}, not on its own {own}"
