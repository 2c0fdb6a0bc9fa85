"""The knobs of the coordinator core, validated once.

Each knob an operator sets is declared once, here, with what it means and its bounds (`knob`): the
service's settings are made from these declarations (`COLLM_COORDINATOR_<KNOB>`,
`collm_coordinator.settings`), and `CoreConfig` checks the same bounds. The service builds a
`CoreConfig` from `CoordinatorSettings`; the simulator and the tests build one directly. Priors that
come from measurements (training speed, inference step costs, quality curves) enter through `CostPrior`
and `QualityPrior`, built from the calibration file by the caller: nothing here holds a measured number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

POLICIES = ("collm", "separate", "fixed_ratio", "leftover")
ROUND_MODES = ("async", "sync")
# The replicas' co-scheduler (`COLLM_COSCHEDULER`) that runs each policy whole: the two-timescale policy and
# the static split grant shares that the SLO-aware co-scheduler spends, the fixed-ratio baseline trains one
# step every K iterations (Loquetier), the leftover baseline trains in what inference leaves (FlexLLM).
COSCHEDULER_FOR_POLICY = {"collm": "slo", "separate": "slo", "fixed_ratio": "fixed", "leftover": "leftover"}


@dataclass(frozen=True)
class Setting:
    """A knob as operators see it: what it means, and its bounds (pydantic's gt / ge / lt / le)."""

    description: str
    bounds: Mapping[str, float]

    def violated_by(self, value: Any) -> str | None:
        """What `value` breaks ("must be in (0, 1]"), None when it is within the bounds (or unset)."""
        if value is None or not self.bounds:
            return None
        b = self.bounds
        ok = all(
            (
                ("gt" not in b or value > b["gt"]),
                ("ge" not in b or value >= b["ge"]),
                ("lt" not in b or value < b["lt"]),
                ("le" not in b or value <= b["le"]),
            )
        )
        if ok:
            return None
        low = f"({b['gt']:g}" if "gt" in b else (f"[{b['ge']:g}" if "ge" in b else None)
        high = f"{b['lt']:g})" if "lt" in b else (f"{b['le']:g}]" if "le" in b else None)
        if low and high:
            return f"must be in {low}, {high}"
        if low:
            return f"must be {'>' if 'gt' in b else '>='} {low[1:]}"
        return f"must be {'<' if 'lt' in b else '<='} {high[:-1]}"


def knob(default: Any, description: str, **bounds: float) -> Any:
    """A `CoreConfig` field that operators set (`COLLM_COORDINATOR_<NAME>`)."""
    return field(default=default, metadata={"setting": Setting(description, bounds)})


def settings() -> Iterator[tuple[str, Any, Setting]]:
    """Every knob operators set: (name, default, its `Setting`), in declaration order."""
    for f in fields(CoreConfig):
        if (setting := f.metadata.get("setting")) is not None:
            yield f.name, f.default, setting


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
    fast_interval_s: float = knob(1.0, "Fast loop period: routing weights and fine-tuning shares.", gt=0)
    slow_interval_s: float = knob(
        60.0, "Slow loop period: one federated round plan per adapter. Must exceed the fast one.", gt=0
    )
    round_deadline_s: float = knob(
        55.0, "Round length: deadline of a planned round, from its opening (<= slow interval).", gt=0
    )
    # "async": an adapter's next round is planned as soon as its previous round's collection closed (the
    # aggregator then rebases it onto the version the previous one publishes), so participants train
    # while the previous round aggregates, evaluates and publishes; "sync": only after it ended.
    rounds: Literal["async", "sync"] = knob(
        "async",
        "async: an adapter's next round opens as soon as the previous one's collection closed, so its"
        " participants train while the previous round aggregates, evaluates and publishes (the "
        "aggregator rebases it onto that publication); sync: only after the previous round ended.",
    )
    stale_after_s: float = knob(
        3.0, "A replica silent this long is routed around and dropped from plans.", gt=0
    )
    warmup_s: float = knob(
        20.0, "The first round is planned this long after start (telemetry arrives first).", ge=0
    )
    # A round whose outcome has not come this long after its deadline is forgotten; one the aggregator
    # reported as aggregating or evaluating (its candidate scored on loaded replicas, each report waited
    # for up to the aggregator's eval_timeout_s) gets `evaluation_grace_s` instead.
    outcome_grace_s: float = knob(
        10.0,
        "A planned round with no outcome this long after its deadline (or 0.25 x the round length, "
        "whichever is longer) is forgotten and its adapter planned again.",
        ge=0,
    )
    evaluation_grace_s: float = knob(
        150.0,
        "... and one the aggregator reported aggregating or evaluating, this long (its candidate is "
        "scored on loaded replicas; keep it above the aggregator's eval_timeout_s).",
        ge=0,
    )
    # --- the long-term target and the drift-plus-penalty weights -----------------------------------
    attainment_target: float = knob(
        0.95,
        "Long-term SLO attainment target: the knob users set. Below it Z prices SLO risk; above it "
        "the headroom lets training shares grow until attainment comes down to it.",
        gt=0,
        le=1,
    )
    attainable_frac: float = knob(
        0.97,
        "Where serving alone could not reach the target (overload), the target in force is this "
        "fraction of the attainable level (the attainment requests would have had without the "
        "training that ran while they were in flight), so the SLO budget is spent there too; 0: the "
        "target stays absolute.",
        ge=0,
        le=1,
    )
    util_cap: float = knob(
        0.9, "Serving utilisation that forecast load plus training may not exceed.", gt=0, le=1
    )
    quality_weight_v: float = knob(20.0, "V: weight of expected quality gain (nats) against SLO risk.", ge=0)
    virtual_queue_gain: float = knob(
        10.0,
        "How fast the signed virtual queue moves per round of attainment off the target: Z (its "
        "positive part) while short of it, headroom (its negative part) while above it.",
        ge=0,
    )
    # Headroom h in [0, 1] per unit of the signed virtual queue below 0 (target.py): while attainment stays
    # above the target the queue goes negative and h grows, so a share counts (1 - h) of itself against
    # serving capacity in both loops (the SLO-aware co-scheduler trains only in the requests' slack, so a
    # share is an upper bound on training, not time taken from serving); 0: shares always count whole.
    headroom_gain: float = knob(
        1.0,
        "Headroom h (0..1) per unit of the virtual queue below 0: while attainment stays above the "
        "target, a training share counts (1 - h) of itself against serving capacity, so shares grow "
        "until attainment comes down to the target; 0: shares always count whole.",
        ge=0,
    )
    # A replica's spend (the part of its share it trains beyond its requests' slack, at their latency's
    # cost) is `spend_gain` x h: the unspent SLO budget is spent, so attainment comes down to the target;
    # 0: training only in the slack.
    spend_gain: float = knob(
        1.0,
        "A replica's spend is this x the headroom: the part of its share it trains beyond its "
        "requests' slack, at their latency's cost, so the SLO budget above the target is spent and "
        "attainment comes down to it; 0: training only in the slack.",
        ge=0,
        le=1,
    )
    spend_rise_per_s: float = knob(
        0.005,
        "How fast the spend may rise per second (it falls at once): the attainment window sees what a"
        " spend costs before it grows further.",
        gt=0,
    )
    # Z stops here: a past shortfall is paid for by at most this much price on SLO risk, so training comes
    # back within minutes of attainment recovering (3 / (gain x (attainment - target)) rounds), not after
    # as long as the shortfall lasted.
    max_virtual_queue: float = knob(
        3.0,
        "Z stops at this value: a past shortfall of attainment is paid for by a bounded price on SLO "
        "risk, so training resumes within minutes of attainment recovering.",
        gt=0,
    )
    # An adapter with data gets one share step on its best participant at the last slow tick before its
    # wait without a planned round would pass this bound, even when its gain does not pay the risk
    # penalty (never on a replica at SLO risk, never past util_cap), or, where no step has room, a turn
    # in the training time a replica already has (slow_loop._floor_inside).
    starvation_floor_s: float = knob(
        180.0,
        "Bound on an adapter's wait between two planned rounds: an adapter with local data gets one "
        "share step on its best participant at the last slow tick before its wait would pass this "
        "bound, even when its expected gain does not pay the SLO-risk penalty (never on a replica at "
        "SLO risk, never past the utilisation cap); where no step has room, a turn in a replica's "
        "training time beside its other jobs (its share unchanged).",
        gt=0,
    )
    # --- fast loop -----------------------------------------------------------------------------------
    max_share: float = knob(1.0, "Largest fine-tuning share granted.", ge=0, le=1)
    share_step: float = knob(0.05, "Granularity of planned shares.", gt=0, le=1)
    share_recover_per_tick: float = knob(0.1, "How much a cut share may rise back per fast tick.", gt=0)
    share_ttl_s: float = knob(
        5.0, "TTL of share commands; replicas fall back to their local default after it.", gt=0
    )
    routing_ttl_s: float = knob(
        5.0, "TTL of published routing weights (the gateway decays them to even after it).", gt=0
    )
    queue_risk_frac: float = knob(
        0.5, "A queue of this fraction of the batch size puts a replica's SLOs at risk.", gt=0
    )
    min_finished_for_attainment: int = 5
    # Time constant of the attainable level (target.py): the target in force moves with it.
    attainable_tau_s: float = 60.0
    # A replica whose windowed attainment is under this is at risk (None: attainment_target).
    risk_attainment: float | None = knob(
        None, "Windowed attainment under this puts a replica at risk (None: the target).", gt=0, le=1
    )
    # ... with this many standard deviations of confidence: at risk when the upper end of the Wilson score
    # interval of the window's attainment is under the floor (0: the measured attainment itself). A
    # window holds 10-30 requests, so one miss (0.93 of 15) says little; two (0.87) say more.
    risk_attainment_z: float = knob(
        1.0,
        "... judged with this many sigmas of confidence: at risk when the upper end of the Wilson "
        "interval of the window's attainment is under it (0: the measured attainment).",
        ge=0,
    )
    non_resident_factor: float = knob(
        0.3, "Routing weight factor of a replica where the adapter is not resident.", ge=0, le=1
    )
    # collm: publish routing weights to the gateway (False: the gateway routes least-loaded; see fast_loop).
    publish_weights: bool = knob(
        False,
        "collm: publish routing weights to the gateway. Off: the gateway routes least-loaded, which "
        "simulation shows serves better than a weighted draw (bench/README.md, Simulator).",
    )
    ttft_slo_ms: float | None = knob(
        None, "TTFT SLO for the risk check on p99 (None: rely on queue and attainment).", gt=0
    )
    tpot_slo_ms: float | None = knob(
        None, "TPOT SLO for the risk check on p99 (None: rely on queue and attainment).", gt=0
    )
    slo_risk_frac: float = knob(0.9, "p99 above this fraction of the SLO counts as at risk.", gt=0, le=1)
    # --- load forecast -------------------------------------------------------------------------------
    forecast_window_s: float = knob(300.0, "History the load forecast uses.", gt=0)
    burst_headroom_sigmas: float = knob(
        0.5, "Forecast = max(recent mean, window mean + this many std deviations).", ge=0
    )
    recent_window_s: float = knob(10.0, "What counts as the recent load.", gt=0)
    # The fast loop's burst check compares the mean demand of this window, and a replica's risk its mean
    # load over it when higher than the latest (one-second samples of a batching engine are noisy: one
    # long prompt is a one-second spike on one replica).
    burst_window_s: float = knob(
        3.0, "The burst check's mean demand and a replica's mean load (its risk) over this window.", gt=0
    )
    # ...but a one-second demand above this multiple of the capacity is a burst at once.
    burst_spike_factor: float = knob(
        1.25, "...or this second's demand divided by this factor, when larger.", ge=1
    )
    # The fast loop cuts shares when demand exceeds this utilisation of what the planned shares leave
    # (above util_cap: the plan keeps a margin for ordinary fluctuation, the cut is for real bursts).
    burst_util: float = knob(
        1.0, "Shares are cut when demand exceeds this utilisation of what they leave.", gt=0, le=1.5
    )
    # Queued requests count as demand spread over this horizon (a queue is normal pipelining in an
    # engine that admits prefill chunk by chunk; only a long one says the replica cannot keep up).
    backlog_horizon_s: float = knob(60.0, "Queued requests count as demand spread over this horizon.", gt=0)
    # --- quality model (see quality.py) --------------------------------------------------------------
    quality_token_scale: float = knob(
        20_000.0, "tau: training tokens at which returns start to diminish.", gt=0
    )
    quality_prior_gain: float = knob(
        0.1, "Prior gain coefficient k (nats per log-token-ratio) without a calibration curve.", ge=0
    )
    quality_prior_weight: float = knob(2.0, "How many log-ratio units of evidence the prior counts as.", gt=0)
    quality_memory: float = knob(
        0.5,
        "Weight a round's observed gain keeps in an adapter's gain estimate at each later round of "
        "that adapter (1: every round alike): the estimate follows what rounds gain now, so an "
        "adapter whose gains have run out stops outbidding the others.",
        gt=0,
        le=1,
    )
    data_tokens_per_sample: float = knob(
        256.0, "Tokens of one local training sample (data volume estimate).", gt=0
    )
    data_useful_epochs: float = knob(2.0, "Passes over local data that still teach something new.", gt=0)
    stale_data_weight: float = knob(
        0.5, "Weight of samples a site already trained on (fresh ones count 1).", ge=0, le=1
    )
    # --- round plans ---------------------------------------------------------------------------------
    learning_rate: float = knob(1e-3, "Learning rate of planned rounds.", gt=0)
    quorum_frac: float = knob(0.5, "Quorum as a fraction of participants.", gt=0, le=1)
    min_budget_tokens: int = knob(64, "Smaller budgets are not planned.", ge=1)
    probe_budget_tokens: int = knob(512, "Budget of a replica whose training speed is not known yet.", ge=1)
    probe_share: float = knob(0.25, "Share of such a probe.", gt=0, le=1)
    adapters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # --- baselines -----------------------------------------------------------------------------------
    separate_train_frac: float = knob(0.25, "separate: fraction of replicas that only train.", gt=0, lt=1)
    fixed_ratio_k: int = 5
    leftover_share: float = knob(1.0, "leftover: the share granted.", gt=0, le=1)
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
            (
                "evaluation_grace_s must be >= outcome_grace_s",
                self.evaluation_grace_s >= self.outcome_grace_s,
            ),
            ("share_ttl_s must be > fast_interval_s", self.share_ttl_s > self.fast_interval_s),
            ("routing_ttl_s must be > fast_interval_s", self.routing_ttl_s > self.fast_interval_s),
            ("forecast_window_s must be >= recent_window_s", self.forecast_window_s >= self.recent_window_s),
            (
                "probe_budget_tokens must be >= min_budget_tokens",
                self.probe_budget_tokens >= self.min_budget_tokens,
            ),
            ("fixed_ratio_k must be >= 1", self.fixed_ratio_k >= 1),
        ]
        for name, _default, setting in settings():
            if (why := setting.violated_by(getattr(self, name))) is not None:
                checks.append((f"{name} {why}", False))
        bad = [msg for msg, ok in checks if not ok]
        if bad:
            raise ValueError("invalid coordinator config: " + "; ".join(bad))

    @property
    def fixed_share(self) -> float:
        """The fixed-ratio baseline's share: one training step per K inference iterations."""
        return 1.0 / (self.fixed_ratio_k + 1)
