"""Every Prometheus metric of the coordinator (`collm_coordinator_*`), in one place.

Names carry their unit (`_ratio` for shares, weights and attainment, `_replicas`, `_seconds`, `_total`).
Decision reasons are exported twice: as an Enum per replica (the reason in force now, for dashboards)
and as labelled counters (how often each reason was decided, for rates).
"""

from __future__ import annotations

from typing import get_args

from prometheus_client import Counter, Enum, Gauge, Histogram

from collm_coordinator.core.types import ReasonCode

REASON_STATES = list(get_args(ReasonCode))  # every reason code the core decides, in its order
POLICY_STATES = ["collm", "separate", "fixed_ratio", "leftover"]

TICKS = Counter("collm_coordinator_ticks_total", "Coordinator loop runs", ["loop"])
TICK_SECONDS = Histogram(
    "collm_coordinator_tick_seconds",
    "Time of one on_tick call (pure core)",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
POLICY = Enum("collm_coordinator_policy", "Policy in force", states=POLICY_STATES)
SHARE = Gauge(
    "collm_coordinator_ft_share_ratio", "Fine-tuning share decided for a replica (0..1)", ["replica"]
)
WEIGHT = Gauge(
    "collm_coordinator_routing_weight_ratio",
    "Routing weight decided for a replica (its fraction of the requests, 0..1; sent to the gateway only "
    "when the policy publishes weights)",
    ["replica"],
)
REASON = Enum(
    "collm_coordinator_share_reason", "Reason of a replica's current share", ["replica"], states=REASON_STATES
)
DECISIONS = Counter("collm_coordinator_decisions_total", "Share decisions by reason", ["reason"])
VIRTUAL_QUEUE = Gauge(
    "collm_coordinator_virtual_queue_ratio",
    "Virtual queue Z of the attainment target: the accumulated shortfall of SLO attainment (a ratio) "
    "times virtual_queue_gain; grows while attainment is below the target, shrinks to 0 while above it "
    "(then the headroom grows; not bounded by 1)",
)
HEADROOM = Gauge(
    "collm_coordinator_headroom_ratio",
    "Headroom h of the attainment target (0..1): grows while attainment stays above the target; a "
    "training share counts (1 - h) of itself against serving capacity",
)
SPEND = Gauge(
    "collm_coordinator_spend_ratio",
    "Spend (0..1): the part of a training share the replicas train beyond their requests' slack, at their "
    "latency's cost; follows spend_gain x headroom",
)
ATTAINMENT = Gauge(
    "collm_coordinator_attainment_ratio", "SLO attainment measured over the last fast tick (0..1)"
)
TARGET = Gauge(
    "collm_coordinator_target_ratio",
    "Attainment target in force (0..1): the configured one, or attainable_frac x the attainable level "
    "where that is lower (overload)",
)
ATTAINABLE = Gauge(
    "collm_coordinator_attainable_ratio",
    "Attainable level (0..1): the attainment requests would have had without the training that ran while "
    "they were in flight, smoothed",
)
DEMAND = Gauge("collm_coordinator_demand_replicas", "Current serving demand, in fully busy replicas")
FORECAST = Gauge(
    "collm_coordinator_forecast_demand_replicas", "Forecast serving demand of the next round, in replicas"
)
LIVE = Gauge("collm_coordinator_live_replicas", "Replicas reporting telemetry")
STALE = Gauge("collm_coordinator_stale_replicas", "Replicas silent past the staleness bound")
ROUNDS = Counter("collm_coordinator_rounds_total", "Round plans by outcome of opening", ["result"])
PLANNED_TOKENS = Counter("collm_coordinator_planned_tokens_total", "Training tokens planned", ["adapter"])
CONTROL_FAILURES = Counter(
    "collm_coordinator_control_failures_total", "Share commands that failed or timed out", ["replica", "code"]
)
CONTROL_SKIPPED = Counter(
    "collm_coordinator_control_skipped_total",
    "Share commands not sent because the previous one to that replica had not answered",
    ["replica"],
)
