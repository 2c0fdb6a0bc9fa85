"""The gateway's Prometheus metrics (`collm_gateway_*`, units in names), declared once.

Latencies are what the client sees from the gateway: TTFT from the request's arrival to the first
token chunk, TPOT = (e2e - TTFT) / (completion tokens - 1), e2e to the last event (definitions:
docs/architecture.md, Goodput and SLO attainment).

Request counts and latencies are labelled by model (the base model id or the adapter name) and by the
exact adapter version that served (`medical@v7`, `base`). Versions only grow, so `VersionSeries` keeps
the series of the `versions_per_model` most recently seen versions of each model and removes older
ones: the number of series stays bounded however many rounds publish.

`collm_gateway_requests_refused_total` counts every request answered with a 4xx error envelope, on any
route, by status and reason (the envelope's `code`: `invalid_api_key`, `rate_limit_exceeded`,
`request_too_large`, `invalid_value`, `invalid_json`, `missing_field`, `model_not_found`,
`unsupported_value`, `queue_full`, ...; `none` for an error without a code). Most of these never reach
a completion's record (`collm_gateway_requests_total`): refused by API keys, the body limit or
validation, they end before any route runs. Reasons are the gateway's own codes, so the series stay few.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)

REQUESTS = Counter(
    "collm_gateway_requests_total",
    "Completion requests by model, exact adapter version that served them, and HTTP status",
    ["model", "adapter_version", "status"],
)
GOOD_REQUESTS = Counter(
    "collm_gateway_requests_good_total",
    "Requests that completed within their TTFT and TPOT targets (docs/architecture.md, Goodput)",
    ["model"],
)
TTFT = Histogram(
    "collm_gateway_ttft_seconds",
    "Time to first token seen by the gateway, by model and exact adapter version",
    ["model", "adapter_version"],
    buckets=_LATENCY_BUCKETS_S,
)
TPOT = Histogram(
    "collm_gateway_tpot_seconds",
    "Time per output token after the first, by model and exact adapter version",
    ["model", "adapter_version"],
    buckets=_TPOT_BUCKETS_S,
)
E2E = Histogram(
    "collm_gateway_e2e_seconds",
    "End-to-end latency of completed requests, by model and exact adapter version",
    ["model", "adapter_version"],
    buckets=_LATENCY_BUCKETS_S,
)
COMPLETION_TOKENS = Counter(
    "collm_gateway_completion_tokens_total", "Completion tokens streamed to clients", ["model"]
)
PROMPT_TOKENS = Counter("collm_gateway_prompt_tokens_total", "Prompt tokens of accepted requests", ["model"])
IN_FLIGHT = Gauge("collm_gateway_in_flight_requests", "Completion requests in progress")
RETRIES = Counter(
    "collm_gateway_retries_total", "Requests sent to another replica after a refusal, by reason", ["reason"]
)
REPLICA_CHOICE = Counter(
    "collm_gateway_replica_choice_total",
    "Replicas that accepted a request, by how the router ranked them (weights draw or least_loaded order)",
    ["replica", "source"],
)
CANCELS = Counter("collm_gateway_cancels_total", "Cancel requests sent to replicas, by reason", ["reason"])
FRESH_REPLICAS = Gauge("collm_gateway_fresh_replicas", "Replicas with fresh telemetry")
WEIGHTS_FACTOR = Gauge(
    "collm_gateway_routing_weights_ratio",
    "Influence of the coordinator's routing weights at the last decision (1 fresh, 0 ignored)",
)
REFUSED = Counter(
    "collm_gateway_requests_refused_total",
    "Requests answered with a 4xx error envelope, by HTTP status and reason (the envelope's code)",
    ["status", "reason"],
)
DASHBOARD_STREAMS = Counter(
    "collm_gateway_dashboard_streams_total",
    "Dashboard event streams opened, and how they ended (client_gone, overflow, shutdown)",
    ["event"],
)


def count_refusal(status: int, reason: str | None) -> None:
    """Count an error answer in `REFUSED` if it is a refusal (4xx)."""
    if 400 <= status < 500:
        REFUSED.labels(str(status), reason or "none").inc()


class VersionSeries:
    """Bounds the version-labelled series: per model, the `versions_per_model` latest versions seen."""

    def __init__(self, versions_per_model: int = 8) -> None:
        self.versions_per_model = versions_per_model
        self._seen: dict[str, OrderedDict[str, set[str]]] = {}  # model -> version -> statuses
        self._lock = threading.Lock()

    def touch(self, model: str, version: str, status: str) -> list[str]:
        """Note a request of `model@version`; returns the versions whose series were just removed."""
        with self._lock:
            versions = self._seen.setdefault(model, OrderedDict())
            versions.setdefault(version, set()).add(status)
            versions.move_to_end(version)
            evicted = []
            while len(versions) > self.versions_per_model:
                old, statuses = versions.popitem(last=False)
                evicted.append(old)
                for st in statuses:
                    _remove(REQUESTS, model, old, st)
                for hist in (TTFT, TPOT, E2E):
                    _remove(hist, model, old)
            return evicted


def _remove(metric: Counter | Histogram, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:  # never observed with these labels (e.g. no TPOT for one-token answers)
        pass


VERSIONS = VersionSeries()
