"""Prometheus metrics of the aggregator (`collm_aggregator_*`, served on `metrics_port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ROUNDS = Counter("collm_aggregator_rounds_total", "Rounds that ended, by final state", ["adapter", "state"])
ROUNDS_OPENED = Counter("collm_aggregator_rounds_opened_total", "Rounds opened, by plan source", ["policy"])
ACTIVE_ROUNDS = Gauge("collm_aggregator_active_rounds", "Rounds not final yet")
UPDATES = Counter("collm_aggregator_updates_total", "Local updates received, by verdict", ["verdict"])
REJECTED = Counter("collm_aggregator_rejected_updates_total", "Updates rejected, by reason code", ["reason"])
REBASED = Counter(
    "collm_aggregator_rebased_rounds_total",
    "Rounds aggregated onto a version an earlier round published while they collected (async rounds)",
)
LATE = Counter("collm_aggregator_late_updates_total", "Updates that arrived after their round closed")
BYTES_RECEIVED = Counter("collm_aggregator_update_bytes_total", "Bytes of update blobs read from the store")
AGGREGATION_SECONDS = Histogram(
    "collm_aggregator_aggregation_seconds",
    "Time to aggregate one round's updates",
    ["strategy"],
    buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30),
)
PHASE_SECONDS = Histogram(
    "collm_aggregator_phase_seconds",
    "Duration of each round phase",
    ["phase"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)
PRODUCT_ERROR = Gauge(
    "collm_aggregator_product_error_ratio",
    "Last round: distance of the aggregate's B·A from the exact average of the updates' B·A, relative to the "
    "average change from the base",
    ["adapter"],
)
EVAL_LOSS = Gauge(
    "collm_aggregator_eval_loss_nats",
    "Last round's held-out loss (nats per token): `before` (the current version), `after` (the candidate)",
    ["adapter", "which"],
)
PUBLICATIONS = Counter("collm_aggregator_publications_total", "Adapter versions published", ["source"])
PLANS_SKIPPED = Counter("collm_aggregator_plans_skipped_total", "Built-in plans not opened", ["adapter"])
