"""The gateway's Prometheus metrics (`collm_gateway_*`, units in names), declared once.

Latencies are what the client sees from the gateway: TTFT from the request's arrival to the first
token chunk, TPOT = (e2e - TTFT) / (completion tokens - 1) as in DESIGN.md, e2e to the last event.
"""

from __future__ import annotations

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
    "Requests that completed within their TTFT and TPOT targets (DESIGN.md goodput)",
    ["model"],
)
TTFT = Histogram(
    "collm_gateway_ttft_seconds",
    "Time to first token seen by the gateway",
    ["model"],
    buckets=_LATENCY_BUCKETS_S,
)
TPOT = Histogram(
    "collm_gateway_tpot_seconds", "Time per output token after the first", ["model"], buckets=_TPOT_BUCKETS_S
)
E2E = Histogram(
    "collm_gateway_e2e_seconds",
    "End-to-end latency of completed requests",
    ["model"],
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
    "collm_gateway_routing_weights_factor",
    "Influence of the coordinator's routing weights at the last decision (1 fresh, 0 ignored)",
)
