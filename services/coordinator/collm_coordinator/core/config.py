"""The knobs of the coordinator core, validated once.

The service builds a `CoreConfig` from `CoordinatorSettings`; the simulator and the tests build one
directly. Priors that come from measurements (training speed, inference step costs, quality curves)
enter through `CostPrior` and `QualityPrior`, built from the calibration file by the caller: nothing
here holds a measured number.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

POLICIES = ("collm", "separate", "fixed_ratio", "leftover")
ROUND_MODES = ("async", "sync")
# The replicas' co-scheduler (`COLLM_COSCHEDULER`) that runs each policy whole: the two-timescale policy and
# the static split grant shares that the SLO-aware co-scheduler spends, the fixed-ratio baseline trains one
# step every K iterations (Loquetier), the leftover baseline trains in what inference leaves (FlexLLM).
COSCHEDULER_FOR_POLICY = {"collm": "slo", "separate": "slo", "fixed_ratio": "fixed", "leftover": "leftover"}


@dataclass(frozen=True)
class CostPrior:
    """Costs of one replica before its telemetry says otherwise (from the calibration file).

    `decode_step_ms(batch)` and `prefill_ms_per_token` estimate the inference busy time when the replica
    does not report it; `train_tokens_per_s` is the training speed of a replica that only trains.
    """

    train_tokens_per_s: float | None = None
    prefill_ms_per_token: float | None = None
    decode_step_ms: Callable[[int], float] | None = None


@dataclass(frozen=True)
class CoreConfig:
    # --- cadences ----------------------------------------------------------------------------------
    fast_interval_s: float = 1.0
    slow_interval_s: float = 60.0
    round_deadline_s: float = 55.0
    # "async": an adapter's next round is planned as soon as its previous round's collection closed (the
    # aggregator then rebases it onto the version the previous one publishes), so participants train
    # while the previous round aggregates, evaluates and publishes; "sync": only after it ended.
    rounds: str = "async"
    stale_after_s: float = 3.0
    warmup_s: float = 20.0
    # A round whose outcome has not come this long after its deadline is forgotten; one the aggregator
    # reported as aggregating or evaluating (its candidate scored on loaded replicas, each report waited
    # for up to the aggregator's eval_timeout_s) gets `evaluation_grace_s` instead.
    outcome_grace_s: float = 10.0
    evaluation_grace_s: float = 150.0
    # --- the long-term target and the drift-plus-penalty weights -----------------------------------
    attainment_target: float = 0.95
    util_cap: float = 0.9
    quality_weight_v: float = 20.0
    virtual_queue_gain: float = 10.0
    # Headroom h in [0, 1] per unit of the signed virtual queue below 0 (target.py): while attainment stays
    # above the target the queue goes negative and h grows, so a share counts (1 - h) of itself against
    # serving capacity in both loops (the SLO-aware co-scheduler trains only in the requests' slack, so a
    # share is an upper bound on training, not time taken from serving); 0: shares always count whole.
    headroom_gain: float = 1.0
    # A replica's spend (the part of its share it trains beyond its requests' slack, at their latency's
    # cost) is `spend_gain` x h: the unspent SLO budget is spent, so attainment comes down to the target;
    # 0: training only in the slack.
    spend_gain: float = 1.0
    spend_rise_per_s: float = 0.005
    # Z stops here: a past shortfall is paid for by at most this much price on SLO risk, so training comes
    # back within minutes of attainment recovering (3 / (gain x (attainment - target)) rounds), not after
    # as long as the shortfall lasted.
    max_virtual_queue: float = 3.0
    # An adapter with data that has had no round planned for this long gets one share step on its best
    # participant at the next slow tick even when its gain does not pay the risk penalty (never on a
    # replica at SLO risk, never past util_cap): no adapter waits for minutes behind the others.
    starvation_floor_s: float = 180.0
    # --- fast loop -----------------------------------------------------------------------------------
    max_share: float = 1.0
    share_step: float = 0.05
    share_recover_per_tick: float = 0.1
    share_ttl_s: float = 5.0
    routing_ttl_s: float = 5.0
    queue_risk_frac: float = 0.5
    min_finished_for_attainment: int = 5
    # A replica whose windowed attainment is under this is at risk (None: attainment_target).
    risk_attainment: float | None = None
    # ... with this many standard deviations of confidence: at risk when the upper end of the Wilson score
    # interval of the window's attainment is under the floor (0: the measured attainment itself). A
    # window holds 10-30 requests, so one miss (0.93 of 15) says little; two (0.87) say more.
    risk_attainment_z: float = 1.0
    non_resident_factor: float = 0.3
    # collm: publish routing weights to the gateway (False: the gateway routes least-loaded; see fast_loop).
    publish_weights: bool = False
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    slo_risk_frac: float = 0.9
    # --- load forecast -------------------------------------------------------------------------------
    forecast_window_s: float = 300.0
    burst_headroom_sigmas: float = 0.5
    recent_window_s: float = 10.0
    # The fast loop's burst check compares the mean demand of this window, and a replica's risk its mean
    # load over it when higher than the latest (one-second samples of a batching engine are noisy: one
    # long prompt is a one-second spike on one replica).
    burst_window_s: float = 3.0
    # ...but a one-second demand above this multiple of the capacity is a burst at once.
    burst_spike_factor: float = 1.25
    # The fast loop cuts shares when demand exceeds this utilisation of what the planned shares leave
    # (above util_cap: the plan keeps a margin for ordinary fluctuation, the cut is for real bursts).
    burst_util: float = 1.0
    # Queued requests count as demand spread over this horizon (a queue is normal pipelining in an
    # engine that admits prefill chunk by chunk; only a long one says the replica cannot keep up).
    backlog_horizon_s: float = 60.0
    # --- quality model (see quality.py) --------------------------------------------------------------
    quality_token_scale: float = 20_000.0
    quality_prior_gain: float = 0.1
    quality_prior_weight: float = 2.0
    quality_memory: float = 0.5
    data_tokens_per_sample: float = 256.0
    data_useful_epochs: float = 2.0
    stale_data_weight: float = 0.5
    # --- round plans ---------------------------------------------------------------------------------
    learning_rate: float = 1e-3
    quorum_frac: float = 0.5
    min_budget_tokens: int = 64
    probe_budget_tokens: int = 512
    probe_share: float = 0.25
    adapters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # --- baselines -----------------------------------------------------------------------------------
    separate_train_frac: float = 0.25
    fixed_ratio_k: int = 5
    leftover_share: float = 1.0
    # --- priors from the calibration file ------------------------------------------------------------
    cost_prior: CostPrior = field(default_factory=CostPrior)
    quality_prior: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.fast_interval_s < self.slow_interval_s:
            raise ValueError(
                f"fast_interval_s ({self.fast_interval_s}) must be positive and shorter than "
                f"slow_interval_s ({self.slow_interval_s}): the fast loop reacts to load within seconds, "
                "the slow loop plans one federated round; a slow loop faster than the fast one would "
                "re-plan rounds before the fast loop has seen their effect"
            )
        if not 0 < self.round_deadline_s <= self.slow_interval_s:
            raise ValueError(
                f"round_deadline_s ({self.round_deadline_s}) must be in (0, slow_interval_s="
                f"{self.slow_interval_s}]: a round must end before the next one is planned"
            )
        if self.stale_after_s < self.fast_interval_s:
            raise ValueError(
                f"stale_after_s ({self.stale_after_s}) must be at least fast_interval_s "
                f"({self.fast_interval_s}), or every replica looks dead between two ticks"
            )
        checks: list[tuple[str, bool]] = [
            ('rounds must be "async" or "sync"', self.rounds in ROUND_MODES),
            ("warmup_s must be >= 0", self.warmup_s >= 0),
            ("outcome_grace_s must be >= 0", self.outcome_grace_s >= 0),
            (
                "evaluation_grace_s must be >= outcome_grace_s",
                self.evaluation_grace_s >= self.outcome_grace_s,
            ),
            ("attainment_target must be in (0, 1]", 0 < self.attainment_target <= 1),
            ("util_cap must be in (0, 1]", 0 < self.util_cap <= 1),
            ("quality_weight_v must be >= 0", self.quality_weight_v >= 0),
            ("virtual_queue_gain must be >= 0", self.virtual_queue_gain >= 0),
            ("headroom_gain must be >= 0", self.headroom_gain >= 0),
            ("spend_gain must be in [0, 1]", 0 <= self.spend_gain <= 1),
            ("spend_rise_per_s must be > 0", self.spend_rise_per_s > 0),
            ("max_virtual_queue must be > 0", self.max_virtual_queue > 0),
            ("max_share must be in [0, 1]", 0 <= self.max_share <= 1),
            ("share_step must be in (0, 1]", 0 < self.share_step <= 1),
            ("share_recover_per_tick must be > 0", self.share_recover_per_tick > 0),
            ("share_ttl_s must be > fast_interval_s", self.share_ttl_s > self.fast_interval_s),
            ("routing_ttl_s must be > fast_interval_s", self.routing_ttl_s > self.fast_interval_s),
            ("queue_risk_frac must be > 0", self.queue_risk_frac > 0),
            ("non_resident_factor must be in [0, 1]", 0 <= self.non_resident_factor <= 1),
            ("slo_risk_frac must be in (0, 1]", 0 < self.slo_risk_frac <= 1),
            ("risk_attainment_z must be >= 0", self.risk_attainment_z >= 0),
            (
                "risk_attainment must be in (0, 1]",
                self.risk_attainment is None or 0 < self.risk_attainment <= 1,
            ),
            ("forecast_window_s must be >= recent_window_s", self.forecast_window_s >= self.recent_window_s),
            ("recent_window_s must be > 0", self.recent_window_s > 0),
            ("backlog_horizon_s must be > 0", self.backlog_horizon_s > 0),
            ("burst_window_s must be > 0", self.burst_window_s > 0),
            ("burst_spike_factor must be >= 1", self.burst_spike_factor >= 1),
            ("burst_util must be in (0, 1.5]", 0 < self.burst_util <= 1.5),
            ("burst_headroom_sigmas must be >= 0", self.burst_headroom_sigmas >= 0),
            ("quality_token_scale must be > 0", self.quality_token_scale > 0),
            ("quality_prior_gain must be >= 0", self.quality_prior_gain >= 0),
            ("quality_prior_weight must be > 0", self.quality_prior_weight > 0),
            ("quality_memory must be in (0, 1]", 0 < self.quality_memory <= 1),
            ("data_tokens_per_sample must be > 0", self.data_tokens_per_sample > 0),
            ("data_useful_epochs must be > 0", self.data_useful_epochs > 0),
            ("stale_data_weight must be in [0, 1]", 0 <= self.stale_data_weight <= 1),
            ("learning_rate must be > 0", self.learning_rate > 0),
            ("quorum_frac must be in (0, 1]", 0 < self.quorum_frac <= 1),
            ("min_budget_tokens must be >= 1", self.min_budget_tokens >= 1),
            (
                "probe_budget_tokens must be >= min_budget_tokens",
                self.probe_budget_tokens >= self.min_budget_tokens,
            ),
            ("probe_share must be in (0, 1]", 0 < self.probe_share <= 1),
            ("separate_train_frac must be in (0, 1)", 0 < self.separate_train_frac < 1),
            ("fixed_ratio_k must be >= 1", self.fixed_ratio_k >= 1),
            ("leftover_share must be in (0, 1]", 0 < self.leftover_share <= 1),
        ]
        bad = [msg for msg, ok in checks if not ok]
        if bad:
            raise ValueError("invalid coordinator config: " + "; ".join(bad))

    @property
    def fixed_share(self) -> float:
        """The fixed-ratio baseline's share: one training step per K inference iterations."""
        return 1.0 / (self.fixed_ratio_k + 1)

    @property
    def round_train_s(self) -> float:
        return self.round_deadline_s
