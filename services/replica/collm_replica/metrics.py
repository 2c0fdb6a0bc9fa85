"""Prometheus metrics of a replica (`collm_replica_*`, units in names), served on `metrics_port`."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LABELS = ["replica"]

QUEUE = Gauge("collm_replica_queue_requests", "Requests waiting for admission", LABELS)
RUNNING = Gauge("collm_replica_running_requests", "Sequences in the running batch", LABELS)
KV_USED = Gauge("collm_replica_kv_used_ratio", "Reserved KV tokens over the KV budget", LABELS)
FT_SHARE = Gauge("collm_replica_ft_share_ratio", "Fine-tuning share in force (0..1)", LABELS)
ADAPTERS = Gauge(
    "collm_replica_resident_adapter_versions", "Adapter versions resident in the LoRA bank", LABELS
)
GENERATED = Counter("collm_replica_generated_tokens_total", "Output tokens generated", LABELS)
PREFILLED = Counter("collm_replica_prefill_tokens_total", "Prompt tokens prefilled", LABELS)
FT_TOKENS = Counter("collm_replica_ft_tokens_total", "Tokens processed by co-executed fine-tuning", LABELS)
REQUESTS = Counter("collm_replica_requests_total", "Generate requests by outcome", [*LABELS, "outcome"])
TTFT = Histogram(
    "collm_replica_ttft_seconds",
    "Time to first token",
    LABELS,
    buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32),
)
TPOT = Histogram(
    "collm_replica_tpot_seconds",
    "Time per output token after the first",
    LABELS,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6),
)
SWAPS = Counter(
    "collm_replica_adapter_swaps_total", "Adapter versions installed (shadow swaps)", [*LABELS, "source"]
)
