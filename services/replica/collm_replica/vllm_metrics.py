"""vLLM's Prometheus metrics for the serving path, beside a replica's own `collm_replica_*` ones.

A replica is what vLLM calls an engine: the same names, types, labels (`model_name`: the base model a
replica serves, which vLLM also uses for its LoRA requests; `engine`: the replica id) and buckets as
vLLM's `/metrics` (vLLM v1, `vllm/v1/metrics/loggers.py`), so dashboards and alerts written for vLLM read
a CoLLM replica unchanged:

* gauges, set at each telemetry tick: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` (reserved KV over the pool, 0..1), and `vllm:lora_requests_info` (labels
  `max_lora`, `running_lora_adapters`: every adapter with requests in flight, queued or running, since
  the telemetry does not tell them apart, and `waiting_lora_adapters` left empty; its value the time of
  the tick, as vLLM sets it);
* counters brought up to the engine's totals at each telemetry tick: `vllm:prefix_cache_queries_total`
  and `vllm:prefix_cache_hits_total` (tokens looked up in the prefix cache at admission, and of those the
  tokens found cached);
* per finished request: `vllm:request_success_total{finished_reason}`, `vllm:prompt_tokens_total`,
  `vllm:generation_tokens_total`, and the histograms `vllm:time_to_first_token_seconds`,
  `vllm:time_per_output_token_seconds` and `vllm:inter_token_latency_seconds` (the request's mean time
  between tokens, once it has two), `vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds`,
  `vllm:request_prompt_tokens`, `vllm:request_generation_tokens`, `vllm:request_params_max_tokens`.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from collm_common.wire.inference import Finished
from collm_common.wire.telemetry import ResidentAdapter

LABELS = ["model_name", "engine"]

# vLLM's buckets.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TPOT_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip
# vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to the model's context; built for the largest
# context CoLLM serves, so that one histogram family fits every replica of a process.
MAX_TOKEN_BUCKET = 1_000_000


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... while <= `limit` (vLLM's `build_1_2_5_buckets`)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > limit:
                return tuple(out)
            out.append(float(value))
        exponent += 1


TOKEN_BUCKETS = one_two_five_buckets(MAX_TOKEN_BUCKET)

RUNNING = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", LABELS)
WAITING = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", LABELS)
KV_USAGE = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", LABELS)
LORA_INFO = Gauge(
    "vllm:lora_requests_info",
    "Running stats on lora requests.",
    ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
)
SUCCESS = Counter(
    "vllm:request_success", "Count of successfully processed requests.", [*LABELS, "finished_reason"]
)
PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS)
GENERATION_TOKENS = Counter("vllm:generation_tokens", "Number of generation tokens processed.", LABELS)
PREFIX_CACHE_QUERIES = Counter(
    "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", LABELS
)
PREFIX_CACHE_HITS = Counter(
    "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", LABELS
)
TTFT = Histogram(
    "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", LABELS,
    buckets=TTFT_BUCKETS_S,
)  # fmt: skip
TPOT = Histogram(
    "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", LABELS,
    buckets=TPOT_BUCKETS_S,
)  # fmt: skip
ITL = Histogram(
    "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", LABELS,
    buckets=TPOT_BUCKETS_S,
)  # fmt: skip
E2E = Histogram(
    "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LABELS,
    buckets=REQUEST_LATENCY_BUCKETS_S,
)  # fmt: skip
QUEUE_TIME = Histogram(
    "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LABELS,
    buckets=REQUEST_LATENCY_BUCKETS_S,
)  # fmt: skip
PROMPT_TOKENS_REQUEST = Histogram(
    "vllm:request_prompt_tokens", "Number of prefill tokens processed.", LABELS, buckets=TOKEN_BUCKETS
)
GENERATION_TOKENS_REQUEST = Histogram(
    "vllm:request_generation_tokens", "Number of generation tokens processed.", LABELS, buckets=TOKEN_BUCKETS
)
MAX_TOKENS_PARAM = Histogram(
    "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", LABELS,
    buckets=TOKEN_BUCKETS,
)  # fmt: skip

# vLLM's finish reasons: "stop", "length", "abort" (CoLLM's "cancelled" and "timeout" end as aborts).
FINISH_REASONS = {"stop": "stop", "length": "length"}


def record_finished(model_name: str, engine: str, ev: Finished, max_tokens: int | None) -> None:
    """One finished request, as vLLM's engine records it."""
    labels = (model_name, engine)
    SUCCESS.labels(*labels, FINISH_REASONS.get(ev.finish_reason, "abort")).inc()
    PROMPT_TOKENS.labels(*labels).inc(ev.prompt_tokens)
    GENERATION_TOKENS.labels(*labels).inc(ev.completion_tokens)
    PROMPT_TOKENS_REQUEST.labels(*labels).observe(ev.prompt_tokens)
    GENERATION_TOKENS_REQUEST.labels(*labels).observe(ev.completion_tokens)
    if max_tokens is not None:
        MAX_TOKENS_PARAM.labels(*labels).observe(max_tokens)
    E2E.labels(*labels).observe(ev.e2e_ms / 1e3)
    QUEUE_TIME.labels(*labels).observe(ev.queue_ms / 1e3)
    if ev.completion_tokens:
        TTFT.labels(*labels).observe(ev.ttft_ms / 1e3)
    if ev.completion_tokens > 1:
        TPOT.labels(*labels).observe(ev.tpot_ms / 1e3)
        ITL.labels(*labels).observe(ev.tpot_ms / 1e3)


_prefix_cache_seen: dict[tuple[str, str], tuple[int, int]] = {}


def record_prefix_cache(model_name: str, engine: str, queries_total: int, hits_total: int) -> None:
    """Bring the prefix-cache counters up to the engine's totals (cumulative, read at a telemetry tick):
    each is increased by what the engine counted since the last call for these labels (by the whole
    total when it is lower than then: a new engine under the same labels)."""
    labels = (model_name, engine)
    last_q, last_h = _prefix_cache_seen.get(labels, (0, 0))
    if queries_total < last_q or hits_total < last_h:
        last_q = last_h = 0
    PREFIX_CACHE_QUERIES.labels(*labels).inc(queries_total - last_q)
    PREFIX_CACHE_HITS.labels(*labels).inc(hits_total - last_h)
    _prefix_cache_seen[labels] = (queries_total, hits_total)


def record_state(
    model_name: str,
    engine: str,
    running: int,
    waiting: int,
    kv_used_frac: float,
    adapters: Iterable[ResidentAdapter],
    max_lora: int,
    now_unix_s: float,
) -> None:
    """The engine's state at a telemetry tick. `vllm:lora_requests_info` keeps one series, the latest
    (vLLM's readers take the newest sample's labels): the adapters with requests in flight."""
    labels = (model_name, engine)
    RUNNING.labels(*labels).set(running)
    WAITING.labels(*labels).set(waiting)
    KV_USAGE.labels(*labels).set(kv_used_frac)
    busy = ",".join(sorted({a.name for a in adapters if a.in_flight > 0}))
    LORA_INFO.clear()
    LORA_INFO.labels(str(max_lora), "", busy).set(now_unix_s)
