"""Coordinator settings (environment variables `COLLM_COORDINATOR_*`, validated at construction).

Every knob of the core (`collm_coordinator.core.CoreConfig`) is a field here named `coordinator_<knob>`,
so `COLLM_COORDINATOR_FAST_INTERVAL_S=0.5` sets `CoreConfig.fast_interval_s`. The prefix keeps them apart
from the aggregator's and replica's own fields (`round_deadline_s`, ...) when one environment starts the
whole stack.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from collm_common.settings import CommonSettings
from collm_coordinator.core.config import CoreConfig, CostPrior

Policy = Literal["collm", "separate", "fixed_ratio", "leftover"]


class CoordinatorSettings(CommonSettings):
    """The two-timescale coordinator (`python -m collm_coordinator`)."""

    coordinator_policy: Policy = Field(
        "collm",
        description="collm (two-timescale), separate (static serve/train split), fixed_ratio (share "
        "1/(K+1) everywhere, as Loquetier), leftover (training fills what inference leaves, as FlexLLM).",
    )
    # --- cadences ----------------------------------------------------------------------------------
    coordinator_fast_interval_s: float = Field(
        1.0, gt=0, description="Fast loop period: routing weights and fine-tuning shares."
    )
    coordinator_slow_interval_s: float = Field(
        60.0,
        gt=0,
        description="Slow loop period: one federated round plan per adapter. Must exceed the fast one.",
    )
    coordinator_round_deadline_s: float = Field(
        55.0,
        gt=0,
        description="Round length: deadline of a planned round, from its opening (<= slow interval).",
    )
    coordinator_rounds: Literal["async", "sync"] = Field(
        "async",
        description="async: an adapter's next round opens as soon as the previous one's collection closed, "
        "so its participants train while the previous round aggregates, evaluates and publishes (the "
        "aggregator rebases it onto that publication); sync: only after the previous round ended.",
    )
    coordinator_stale_after_s: float = Field(
        3.0, gt=0, description="A replica silent this long is routed around and dropped from plans."
    )
    coordinator_outcome_grace_s: float = Field(
        10.0,
        ge=0,
        description="A planned round with no outcome this long after its deadline (or 0.25 x the round "
        "length, whichever is longer) is forgotten and its adapter planned again.",
    )
    coordinator_evaluation_grace_s: float = Field(
        150.0,
        ge=0,
        description="... and one the aggregator reported aggregating or evaluating, this long (its candidate "
        "is scored on loaded replicas; keep it above the aggregator's eval_timeout_s).",
    )
    coordinator_warmup_s: float = Field(
        20.0, ge=0, description="The first round is planned this long after start (telemetry arrives first)."
    )
    # --- objective ---------------------------------------------------------------------------------
    coordinator_attainment_target: float = Field(
        0.95,
        gt=0,
        le=1,
        description="Long-term SLO attainment target: the knob users set. Below it Z prices SLO risk; "
        "above it the headroom lets training shares grow until attainment comes down to it.",
    )
    coordinator_starvation_floor_s: float = Field(
        180.0,
        gt=0,
        description="An adapter with local data that has had no round planned for this long gets one share "
        "step on its best participant at the next slow tick even when its expected gain does not pay the "
        "SLO-risk penalty (never on a replica at SLO risk, never past the utilisation cap).",
    )
    coordinator_util_cap: float = Field(
        0.9, gt=0, le=1, description="Serving utilisation that forecast load plus training may not exceed."
    )
    coordinator_quality_weight_v: float = Field(
        20.0, ge=0, description="V: weight of expected quality gain (nats) against SLO risk."
    )
    coordinator_virtual_queue_gain: float = Field(
        10.0,
        ge=0,
        description="How fast the signed virtual queue moves per round of attainment off the target: Z "
        "(its positive part) while short of it, headroom (its negative part) while above it.",
    )
    coordinator_headroom_gain: float = Field(
        1.0,
        ge=0,
        description="Headroom h (0..1) per unit of the virtual queue below 0: while attainment stays above "
        "the target, a training share counts (1 - h) of itself against serving capacity, so shares grow "
        "until attainment comes down to the target; 0: shares always count whole.",
    )
    coordinator_spend_gain: float = Field(
        1.0,
        ge=0,
        le=1,
        description="A replica's spend is this x the headroom: the part of its share it trains beyond its "
        "requests' slack, at their latency's cost, so the SLO budget above the target is spent and "
        "attainment comes down to it; 0: training only in the slack.",
    )
    coordinator_max_virtual_queue: float = Field(
        3.0,
        gt=0,
        description="Z stops at this value: a past shortfall of attainment is paid for by a bounded price "
        "on SLO risk, so training resumes within minutes of attainment recovering.",
    )
    coordinator_spend_rise_per_s: float = Field(
        0.005,
        gt=0,
        description="How fast the spend may rise per second (it falls at once): the attainment window "
        "sees what a spend costs before it grows further.",
    )
    # --- fast loop -----------------------------------------------------------------------------------
    coordinator_max_share: float = Field(1.0, ge=0, le=1, description="Largest fine-tuning share granted.")
    coordinator_share_step: float = Field(0.05, gt=0, le=1, description="Granularity of planned shares.")
    coordinator_share_recover_per_tick: float = Field(
        0.1, gt=0, description="How much a cut share may rise back per fast tick."
    )
    coordinator_share_ttl_s: float = Field(
        5.0, gt=0, description="TTL of share commands; replicas fall back to their local default after it."
    )
    coordinator_routing_ttl_s: float = Field(
        5.0, gt=0, description="TTL of published routing weights (the gateway decays them to even after it)."
    )
    coordinator_queue_risk_frac: float = Field(
        0.5, gt=0, description="A queue of this fraction of the batch size puts a replica's SLOs at risk."
    )
    coordinator_non_resident_factor: float = Field(
        0.3, ge=0, le=1, description="Routing weight factor of a replica where the adapter is not resident."
    )
    coordinator_publish_weights: bool = Field(
        False,
        description="collm: publish routing weights to the gateway. Off: the gateway routes least-loaded, "
        "which simulation shows serves better than a weighted draw (bench/README.md, Simulator).",
    )
    coordinator_ttft_slo_ms: float | None = Field(
        None, gt=0, description="TTFT SLO for the risk check on p99 (None: rely on queue and attainment)."
    )
    coordinator_tpot_slo_ms: float | None = Field(
        None, gt=0, description="TPOT SLO for the risk check on p99 (None: rely on queue and attainment)."
    )
    coordinator_risk_attainment: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Windowed attainment under this puts a replica at risk (None: the target).",
    )
    coordinator_risk_attainment_z: float = Field(
        1.0,
        ge=0,
        description="... judged with this many sigmas of confidence: at risk when the upper end of the "
        "Wilson interval of the window's attainment is under it (0: the measured attainment).",
    )
    coordinator_slo_risk_frac: float = Field(
        0.9, gt=0, le=1, description="p99 above this fraction of the SLO counts as at risk."
    )
    # --- forecast ----------------------------------------------------------------------------------
    coordinator_forecast_window_s: float = Field(300.0, gt=0, description="History the load forecast uses.")
    coordinator_burst_headroom_sigmas: float = Field(
        0.5, ge=0, description="Forecast = max(recent mean, window mean + this many std deviations)."
    )
    coordinator_recent_window_s: float = Field(10.0, gt=0, description="What counts as the recent load.")
    coordinator_backlog_horizon_s: float = Field(
        60.0, gt=0, description="Queued requests count as demand spread over this horizon."
    )
    coordinator_burst_window_s: float = Field(
        3.0,
        gt=0,
        description="The burst check's mean demand and a replica's mean load (its risk) over this window.",
    )
    coordinator_burst_spike_factor: float = Field(
        1.25, ge=1, description="...or this second's demand divided by this factor, when larger."
    )
    coordinator_burst_util: float = Field(
        1.0,
        gt=0,
        le=1.5,
        description="Shares are cut when demand exceeds this utilisation of what they leave.",
    )
    # --- quality model -------------------------------------------------------------------------------
    coordinator_quality_token_scale: float = Field(
        20_000.0, gt=0, description="tau: training tokens at which returns start to diminish."
    )
    coordinator_quality_prior_gain: float = Field(
        0.1,
        ge=0,
        description="Prior gain coefficient k (nats per log-token-ratio) without a calibration curve.",
    )
    coordinator_quality_prior_weight: float = Field(
        2.0, gt=0, description="How many log-ratio units of evidence the prior counts as."
    )
    coordinator_quality_memory: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Weight a round's observed gain keeps in an adapter's gain estimate at each later "
        "round of that adapter (1: every round alike): the estimate follows what rounds gain now, so an "
        "adapter whose gains have run out stops outbidding the others.",
    )
    coordinator_data_tokens_per_sample: float = Field(
        256.0, gt=0, description="Tokens of one local training sample (data volume estimate)."
    )
    coordinator_data_useful_epochs: float = Field(
        2.0, gt=0, description="Passes over local data that still teach something new."
    )
    coordinator_stale_data_weight: float = Field(
        0.5, ge=0, le=1, description="Weight of samples a site already trained on (fresh ones count 1)."
    )
    # --- round plans ---------------------------------------------------------------------------------
    coordinator_learning_rate: float = Field(1e-3, gt=0, description="Learning rate of planned rounds.")
    coordinator_quorum_frac: float = Field(
        0.5, gt=0, le=1, description="Quorum as a fraction of participants."
    )
    coordinator_min_budget_tokens: int = Field(64, ge=1, description="Smaller budgets are not planned.")
    coordinator_probe_budget_tokens: int = Field(
        512, ge=1, description="Budget of a replica whose training speed is not known yet."
    )
    coordinator_probe_share: float = Field(0.25, gt=0, le=1, description="Share of such a probe.")
    coordinator_adapters: dict[str, list[str]] = Field(
        default_factory=dict,
        description='Adapters to train and the domains that train each, JSON: {"shared": ["*"], '
        '"medical": ["medical"]}. Empty: one adapter per domain that replicas report, named after it.',
    )
    # --- baselines -----------------------------------------------------------------------------------
    coordinator_separate_train_frac: float = Field(
        0.25, gt=0, lt=1, description="separate: fraction of replicas that only train."
    )
    coordinator_leftover_share: float = Field(1.0, gt=0, le=1, description="leftover: the share granted.")
    # --- shell ---------------------------------------------------------------------------------------
    coordinator_calibration_path: Path | None = Field(
        None,
        description="Calibration file (bench/calibration/<model>.json): priors for training speed, step "
        "costs and quality curves before telemetry teaches them. None: learn from telemetry only.",
    )
    coordinator_train_micro_tokens: int = Field(
        64,
        ge=1,
        description="Tokens of a replica's training micro-step (turns the calibration into tokens/s).",
    )
    coordinator_control_timeout_s: float = Field(
        0.5, gt=0, description="Timeout of one share command; a slow replica never blocks the tick."
    )
    coordinator_open_round_timeout_s: float = Field(
        5.0, gt=0, description="Timeout of one round plan sent to the aggregator."
    )
    coordinator_use_store: bool = Field(
        True, description="Read current adapter versions and quality records from the adapter store."
    )
    coordinator_store_refresh_s: float = Field(
        10.0, gt=0, description="How often versions and quality records are re-read from the store."
    )
    coordinator_micro_version: str = Field(
        "0.1.0", pattern=r"^\d+\.\d+\.\d+$", description="Semver reported by the `collm-coordinator` service."
    )

    @model_validator(mode="after")
    def _coherent(self) -> CoordinatorSettings:
        if self.coordinator_fast_interval_s >= self.coordinator_slow_interval_s:
            raise ValueError(
                f"COLLM_COORDINATOR_FAST_INTERVAL_S ({self.coordinator_fast_interval_s}) must be shorter "
                f"than COLLM_COORDINATOR_SLOW_INTERVAL_S ({self.coordinator_slow_interval_s}): the fast loop "
                "reacts to load within seconds, the slow loop plans one federated round"
            )
        if self.coordinator_calibration_path is not None and not self.coordinator_calibration_path.is_file():
            raise ValueError(
                f"COLLM_COORDINATOR_CALIBRATION_PATH {self.coordinator_calibration_path} is not a file"
            )
        try:
            self.core_config()
        except ValueError as exc:
            raise ValueError(f"COLLM_COORDINATOR_* settings: {exc}") from None
        return self

    def core_config(
        self, cost_prior: CostPrior | None = None, quality_prior: dict[str, float] | None = None
    ) -> CoreConfig:
        """The core's knobs from these settings (every `coordinator_<knob>` field)."""
        values: dict[str, object] = {}
        for f in dataclasses.fields(CoreConfig):
            key = f"coordinator_{f.name}"
            if key in type(self).model_fields:
                values[f.name] = getattr(self, key)
        values["adapters"] = {a: tuple(d) for a, d in self.coordinator_adapters.items()}
        values["fixed_ratio_k"] = self.fixed_ratio_k
        if cost_prior is not None:
            values["cost_prior"] = cost_prior
        if quality_prior is not None:
            values["quality_prior"] = quality_prior
        return CoreConfig(**values)  # type: ignore[arg-type]
