"""A replica's telemetry: the engine's snapshot as a `ReplicaTelemetry`, with rates since the last one.

`TelemetryBuilder.build(snapshot, round_role, round_id)` turns cumulative counters into per-second rates
over the time since the previous call (the first call: over one `interval_s`) and sets the replica's
gauges (`collm_replica.metrics`, and vLLM's in `collm_replica.vllm_metrics`); it is what the worker
publishes every `telemetry_interval_s` on `subjects.telemetry(id)` and answers on its `status` endpoint.
"""

from __future__ import annotations

from collm_common.clock import Clock, WallClock
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_replica import metrics, vllm_metrics
from collm_replica.engine import EngineSnapshot

_RATES = ("gen", "pre", "arr", "ft", "infer_ms", "train_ms")


class TelemetryBuilder:
    """See module docstring."""

    def __init__(
        self, replica_id: str, model: str, interval_s: float, max_lora: int = 0, clock: Clock | None = None
    ) -> None:
        self.rid = replica_id
        self.clock = clock or WallClock()
        self.model = model
        self.interval_s = interval_s
        self.max_lora = max_lora  # adapter slots, for vLLM's `vllm:lora_requests_info`
        self._last: dict[str, float] | None = None

    def build(self, snap: EngineSnapshot, round_role: str, round_id: int | None) -> ReplicaTelemetry:
        now = self.clock.monotonic()
        counters = {
            "gen": float(snap.generated_tokens_total),
            "pre": float(snap.prefill_tokens_total),
            "arr": float(snap.arrivals_total),
            "ft": float(snap.ft_tokens_total),
            "infer_ms": snap.infer_ms_total,
            "train_ms": snap.train_ms_total,
            "t": now,
        }
        last = self._last or {**counters, "t": now - self.interval_s}
        dt = max(1e-6, now - last["t"])
        rate = {k: (counters[k] - last[k]) / dt for k in _RATES}
        self._last = counters
        lat = snap.latency
        metrics.QUEUE.labels(self.rid).set(snap.queue_len)
        metrics.RUNNING.labels(self.rid).set(snap.running)
        metrics.KV_USED.labels(self.rid).set(snap.kv_used_frac)
        metrics.FT_SHARE.labels(self.rid).set(snap.ft_share)
        metrics.ADAPTERS.labels(self.rid).set(len(snap.adapters))
        vllm_metrics.record_state(
            self.model, self.rid, snap.running, snap.queue_len, snap.kv_used_frac, snap.adapters,
            self.max_lora, self.clock.now(),
        )  # fmt: skip
        vllm_metrics.record_prefix_cache(
            self.model, self.rid, snap.prefix_cache_queries_total, snap.prefix_cache_hits_total
        )
        return ReplicaTelemetry(
            replica_id=self.rid,
            ts_unix_s=self.clock.now(),
            interval_s=self.interval_s,
            model=self.model,
            queue_len=snap.queue_len,
            running=snap.running,
            max_batch=snap.max_batch,
            kv_used_frac=snap.kv_used_frac,
            tokens_per_s=rate["gen"],
            prefill_tokens_per_s=rate["pre"],
            arrivals_per_s=rate["arr"],
            **lat,  # the latency window's summary: TTFT/TPOT p50/p99, finished, good, attainment
            decode_step_ms=snap.decode_step_ms,
            prefill_ms_per_token=snap.prefill_ms_per_token,
            train_step_ms=snap.train_step_ms,
            infer_busy_frac=min(1.0, rate["infer_ms"] / 1e3),
            train_busy_frac=min(1.0, rate["train_ms"] / 1e3),
            ft_share=snap.ft_share,
            ft_share_source=snap.ft_share_source,  # type: ignore[arg-type]
            ft_spend=snap.ft_spend,
            ft_tokens_per_s=rate["ft"],
            ft_loss=snap.ft_loss,
            training_jobs=snap.jobs,
            adapters=snap.adapters,
            round_role=round_role,  # type: ignore[arg-type]
            round_id=round_id,
            local_samples=snap.local_samples,
            domains=snap.domains,
        )
