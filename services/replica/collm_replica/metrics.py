"""Prometheus metrics of a replica (`collm_replica_*`, units in names), served on `metrics_port`.

Requests and their latencies are labelled by replica, model (the base model id or the adapter name, as
the gateway labels them) and the exact adapter version that served (`medical@v7`, a local refresh
`medical@v7+r2.3`, `base`; `none` for a request refused before a version was chosen). Versions only
grow, so the number of series is bounded explicitly: `VersionSeries` keeps, per replica and model, the
series of the `VERSIONS_PER_MODEL` most recently seen versions and removes older ones. That covers the
versions a replica can still serve (the aggregator's retention window, `COLLM_RETENTION_VERSIONS`, 5 by
default, plus the current one) with room for local refreshes; it stays bounded however many rounds
publish.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
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
REQUEST_LABELS = [*LABELS, "model", "adapter_version"]
REQUESTS = Counter(
    "collm_replica_requests_total",
    "Generate requests by model, exact adapter version that served them, and outcome (finish reason, "
    "error, refused_<code>)",
    [*REQUEST_LABELS, "outcome"],
)
TTFT = Histogram(
    "collm_replica_ttft_seconds",
    "Time to first token at the replica (arrival to first token), by model and exact adapter version",
    REQUEST_LABELS,
    buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32),
)
TPOT = Histogram(
    "collm_replica_tpot_seconds",
    "Time per output token after the first, by model and exact adapter version",
    REQUEST_LABELS,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6),
)
SWAPS = Counter(
    "collm_replica_adapter_swaps_total", "Adapter versions installed (shadow swaps)", [*LABELS, "source"]
)
ROUND_UPDATES = Counter(
    "collm_replica_round_updates_total",
    "Round updates of this replica by outcome: sent, or not sent because the adapter store stayed "
    "unreachable until the round's deadline (not_sent_store_unreachable), the store refused the blob "
    "(not_sent_store_error) or JetStream refused the reference (not_sent_bus)",
    [*LABELS, "outcome"],
)
CATALOG_BEHIND = Counter(
    "collm_replica_catalog_behind_total",
    "Times the adapter store's current pointer of an adapter was seen behind the newest version this "
    "replica serves (versions only grow; a rollback publishes a new one): the catalogue and the served "
    "version disagree, logged once per pointer value",
    [*LABELS, "adapter"],
)
UPDATE_UPLOAD_RETRIES = Counter(
    "collm_replica_update_upload_retries_total",
    "Uploads of a round update to the adapter store retried because the store was unreachable",
    LABELS,
)


VERSIONS_PER_MODEL = 8
NO_VERSION = "none"


class VersionSeries:
    """Bounds the version-labelled request series: per (replica, model), the latest versions seen."""

    def __init__(self, versions_per_model: int = VERSIONS_PER_MODEL) -> None:
        self.versions_per_model = versions_per_model
        self._seen: dict[tuple[str, str], OrderedDict[str, set[str]]] = {}  # -> version -> outcomes
        self._lock = threading.Lock()

    def touch(self, replica: str, model: str, version: str, outcome: str) -> list[str]:
        """Note a request of `model` served by `version`; returns the versions whose series were removed."""
        with self._lock:
            versions = self._seen.setdefault((replica, model), OrderedDict())
            versions.setdefault(version, set()).add(outcome)
            versions.move_to_end(version)
            evicted = []
            while len(versions) > self.versions_per_model:
                old, outcomes = versions.popitem(last=False)
                evicted.append(old)
                for out in outcomes:
                    _remove(REQUESTS, replica, model, old, out)
                for hist in (TTFT, TPOT):
                    _remove(hist, replica, model, old)
            return evicted


def _remove(metric: Counter | Histogram, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:  # never observed with these labels (e.g. no TPOT for one-token answers)
        pass


VERSIONS = VersionSeries()


def record_request(
    replica: str,
    model: str,
    version: str,
    outcome: str,
    ttft_s: float | None = None,
    tpot_s: float | None = None,
) -> None:
    """Count one finished, failed or refused request and observe its latencies (None: not defined)."""
    VERSIONS.touch(replica, model, version, outcome)
    REQUESTS.labels(replica, model, version, outcome).inc()
    if ttft_s is not None:
        TTFT.labels(replica, model, version).observe(ttft_s)
    if tpot_s is not None:
        TPOT.labels(replica, model, version).observe(tpot_s)


class TokenCounters(Protocol):
    """What the engine exposes as plain integer attributes (read atomically, from any thread)."""

    generated_tokens_total: int
    prefill_tokens_total: int
    ft_tokens_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    train_limits: dict[str, int]
    infer_ms_total: float
    forward_ms_total: float
    train_ms_total: float
    eval_ms_total: float


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
            (
                "collm_replica_prefix_cache_query_tokens",
                "Tokens of the sequences admitted (prompt; after a preemption, prompt and output) looked up "
                "in the prefix cache",
                "prefix_cache_queries_total",
            ),
            (
                "collm_replica_prefix_cache_hit_tokens",
                "Of the tokens looked up in the prefix cache, those taken from cached KV blocks instead of "
                "computed (hit rate: over collm_replica_prefix_cache_query_tokens)",
                "prefix_cache_hits_total",
            ),
        ]
        engines = list(self.engines.items())
        for name, doc, attr in families:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            for replica_id, engine in engines:
                family.add_metric([replica_id], float(getattr(engine(), attr)))
            yield family
        limits = CounterMetricFamily(
            "collm_replica_ft_limit_iterations",
            "Iterations that served while a training job was active, by what bounded their training time "
            "(share, slack, guard; policy: a co-scheduler that does not say)",
            labels=[*LABELS, "limit"],
        )
        for replica_id, engine in engines:
            for limit, n in sorted(dict(engine().train_limits).items()):
                limits.add_metric([replica_id, limit], float(n))
        yield limits
        busy = CounterMetricFamily(
            "collm_replica_busy_seconds",
            "Wall time the engine spent on each kind of work: inference iterations, fine-tuning pieces, "
            "held-out evaluation pieces (the federated gate's and the jobs' own)",
            labels=[*LABELS, "work"],
        )
        for replica_id, engine in engines:
            e = engine()
            for work, ms in (
                ("inference", e.infer_ms_total),
                ("training", e.train_ms_total),
                ("evaluation", e.eval_ms_total),
            ):
                busy.add_metric([replica_id, work], float(ms) / 1e3)
        yield busy
        forward = CounterMetricFamily(
            "collm_replica_inference_forward_seconds",
            "Of the inference iterations' wall time, the model's forward passes (the rest: planning, "
            "sampling, detokenising, streaming the tokens)",
            labels=LABELS,
        )
        for replica_id, engine in engines:
            forward.add_metric([replica_id], float(engine().forward_ms_total) / 1e3)
        yield forward


ENGINE_TOKENS = EngineTokenCollector()
REGISTRY.register(ENGINE_TOKENS)
