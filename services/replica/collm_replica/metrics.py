"""Prometheus metrics of a replica (`collm_replica_*`, units in names), served on `metrics_port`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

LABELS = ["replica"]

QUEUE = Gauge("collm_replica_queue_requests", "Requests waiting for admission", LABELS)
RUNNING = Gauge("collm_replica_running_requests", "Sequences in the running batch", LABELS)
KV_USED = Gauge("collm_replica_kv_used_ratio", "Reserved KV tokens over the KV budget", LABELS)
FT_SHARE = Gauge("collm_replica_ft_share_ratio", "Fine-tuning share in force (0..1)", LABELS)
ADAPTERS = Gauge(
    "collm_replica_resident_adapter_versions", "Adapter versions resident in the LoRA bank", LABELS
)
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


class TokenCounters(Protocol):
    """What the engine exposes as plain integer attributes (read atomically, from any thread)."""

    generated_tokens_total: int
    prefill_tokens_total: int
    ft_tokens_total: int


class EngineTokenCollector(Collector):
    """Token counters read from each attached engine at scrape time, so a scrape right after traffic is
    current (counters copied at telemetry ticks would lag by up to one interval). One collector serves
    every replica of the process (tests run several in one)."""

    def __init__(self) -> None:
        self.engines: dict[str, Callable[[], TokenCounters]] = {}

    def attach(self, replica_id: str, engine: Callable[[], TokenCounters]) -> None:
        self.engines[replica_id] = engine

    def detach(self, replica_id: str) -> None:
        self.engines.pop(replica_id, None)

    def collect(self) -> Iterator[CounterMetricFamily]:
        families = [
            ("collm_replica_generated_tokens", "Output tokens generated", "generated_tokens_total"),
            ("collm_replica_prefill_tokens", "Prompt tokens prefilled", "prefill_tokens_total"),
            ("collm_replica_ft_tokens", "Tokens processed by co-executed fine-tuning", "ft_tokens_total"),
        ]
        engines = list(self.engines.items())
        for name, doc, attr in families:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            for replica_id, engine in engines:
                family.add_metric([replica_id], float(getattr(engine(), attr)))
            yield family


ENGINE_TOKENS = EngineTokenCollector()
REGISTRY.register(ENGINE_TOKENS)
