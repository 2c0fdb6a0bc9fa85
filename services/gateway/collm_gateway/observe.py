"""One record per request: latencies, SLO verdict, replica and exact adapter version, written once.

`latencies` and `is_good` are pure (DESIGN.md definitions: TPOT = (e2e - TTFT) / (output tokens - 1); a
request is good when it completed without error and met both targets). `record` writes the outcome to
the metrics, one structured log line and the current span.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from opentelemetry import trace

from collm_gateway import metrics

log = logging.getLogger("collm_gateway.requests")

CLIENT_CLOSED = 499  # nginx's convention: the client went away before the answer was complete


def latencies(
    arrival_s: float, first_token_s: float | None, end_s: float | None, completion_tokens: int
) -> tuple[float | None, float | None, float | None]:
    """(TTFT ms, TPOT ms, e2e ms) from monotonic instants; None where undefined."""
    ttft_ms = (first_token_s - arrival_s) * 1000.0 if first_token_s is not None else None
    e2e_ms = (end_s - arrival_s) * 1000.0 if end_s is not None else None
    tpot_ms = None
    if ttft_ms is not None and e2e_ms is not None and completion_tokens > 1:
        tpot_ms = (e2e_ms - ttft_ms) / (completion_tokens - 1)
    return ttft_ms, tpot_ms, e2e_ms


def is_good(
    status: int,
    ttft_ms: float | None,
    tpot_ms: float | None,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
) -> bool:
    if status != 200 or ttft_ms is None:
        return False
    if slo_ttft_ms is not None and ttft_ms > slo_ttft_ms:
        return False
    return not (slo_tpot_ms is not None and tpot_ms is not None and tpot_ms > slo_tpot_ms)


@dataclass
class RequestRecord:
    request_id: str
    endpoint: str
    model: str  # metrics label: base model id or adapter name ("unknown" before resolution)
    requested_model: str
    stream: bool
    arrival_s: float
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    tenant: str | None = None
    replica_id: str | None = None
    adapter_version_id: str | None = None
    routing_source: str | None = None
    attempts: int = 0
    first_token_s: float | None = None
    end_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    status: int = 200
    error: str | None = None
    recorded: bool = False


def record(rec: RequestRecord, span: trace.Span | None = None) -> None:
    """Write the outcome once (later calls do nothing)."""
    if rec.recorded:
        return
    rec.recorded = True
    ttft_ms, tpot_ms, e2e_ms = latencies(rec.arrival_s, rec.first_token_s, rec.end_s, rec.completion_tokens)
    good = is_good(rec.status, ttft_ms, tpot_ms, rec.slo_ttft_ms, rec.slo_tpot_ms)
    metrics.REQUESTS.labels(rec.model, rec.adapter_version_id or "none", str(rec.status)).inc()
    if rec.status == 200:
        if ttft_ms is not None:
            metrics.TTFT.labels(rec.model).observe(ttft_ms / 1000.0)
        if tpot_ms is not None:
            metrics.TPOT.labels(rec.model).observe(tpot_ms / 1000.0)
        if e2e_ms is not None:
            metrics.E2E.labels(rec.model).observe(e2e_ms / 1000.0)
        metrics.PROMPT_TOKENS.labels(rec.model).inc(rec.prompt_tokens)
    if rec.completion_tokens:
        metrics.COMPLETION_TOKENS.labels(rec.model).inc(rec.completion_tokens)
    if good:
        metrics.GOOD_REQUESTS.labels(rec.model).inc()
    fields = {
        "request_id": rec.request_id,
        "endpoint": rec.endpoint,
        "model": rec.requested_model,
        "stream": rec.stream,
        "status": rec.status,
        "replica": rec.replica_id,
        "adapter_version": rec.adapter_version_id,
        "routing_source": rec.routing_source,
        "attempts": rec.attempts,
        "tenant": rec.tenant,
        "prompt_tokens": rec.prompt_tokens,
        "completion_tokens": rec.completion_tokens,
        "finish_reason": rec.finish_reason,
        "ttft_ms": _round(ttft_ms),
        "tpot_ms": _round(tpot_ms),
        "e2e_ms": _round(e2e_ms),
        "slo_ttft_ms": rec.slo_ttft_ms,
        "slo_tpot_ms": rec.slo_tpot_ms,
        "good": good,
        "error": rec.error,
    }
    log.info("request %s %s", rec.request_id, rec.status, extra=fields)
    if span is not None and span.is_recording():
        for key in (
            "replica",
            "adapter_version",
            "status",
            "ttft_ms",
            "tpot_ms",
            "e2e_ms",
            "completion_tokens",
        ):
            value = fields[key]
            if value is not None:
                span.set_attribute(f"collm.{key}", value)


def _round(x: float | None) -> float | None:
    return round(x, 3) if x is not None else None
