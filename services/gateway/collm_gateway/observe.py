"""One record per request: latencies, SLO verdict, replica and exact adapter version, written once.

`latencies` and `is_good` are pure (definitions: docs/architecture.md, Goodput and SLO attainment; TPOT =
(e2e - TTFT) / (output tokens - 1); TTFT = e2e for a request that completed without a token; a
request is good when it completed without error and met both targets). `record` writes the outcome to
the metrics, one structured log line and the request's HTTP span.

Span attributes follow OpenTelemetry's GenAI semantic conventions where they fit (`gen_ai.request.model`,
`gen_ai.response.model` = the exact adapter version that served, `gen_ai.usage.input_tokens`, ...) and
CoLLM's own `collm.*` names for the rest (replica, latencies, SLO verdict). A streamed response's HTTP
span ends with its last byte, before the generation is released, so `annotate` is also called just
before that byte (`serving._stream`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Span

from collm_common.slo import meets_slo
from collm_gateway import metrics

log = logging.getLogger("collm_gateway.requests")

CLIENT_CLOSED = 499  # nginx's convention: the client went away before the answer was complete

# OpenTelemetry GenAI semantic conventions (attribute names as in opentelemetry-semantic-conventions).
GEN_AI_PROVIDER = "collm"
GEN_AI_OPERATION = {"chat": "chat", "completions": "text_completion"}


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
    return status == 200 and meets_slo(ttft_ms, tpot_ms, slo_ttft_ms, slo_tpot_ms)


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


def request_attributes(
    endpoint: str,
    model: str,
    request_id: str,
    max_tokens: int,
    temperature: float,
    top_p: float,
    stream: bool,
) -> dict[str, str | int | float | bool]:
    """GenAI attributes known when a request is accepted (set on the HTTP and the dispatch span)."""
    return {
        "gen_ai.operation.name": GEN_AI_OPERATION.get(endpoint, endpoint),
        "gen_ai.provider.name": GEN_AI_PROVIDER,
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": max_tokens,
        "gen_ai.request.temperature": temperature,
        "gen_ai.request.top_p": top_p,
        "gen_ai.request.stream": stream,
        "gen_ai.response.id": request_id,
    }


def response_attributes(
    adapter_version_id: str | None,
    base_model: str,
    prompt_tokens: int,
    completion_tokens: int,
    finish_reason: str | None,
) -> dict[str, str | int | list[str]]:
    """GenAI attributes of the answer: the exact weights that served it and the token usage."""
    attrs: dict[str, str | int | list[str]] = {
        "gen_ai.usage.input_tokens": prompt_tokens,
        "gen_ai.usage.output_tokens": completion_tokens,
    }
    if adapter_version_id:
        attrs["gen_ai.response.model"] = base_model if adapter_version_id == "base" else adapter_version_id
    if finish_reason:
        attrs["gen_ai.response.finish_reasons"] = [finish_reason]
    return attrs


def first_token_s(rec: RequestRecord) -> float | None:
    """When the request's first token counts as out: its first token chunk's instant; for a request that
    completed (200) without any token, its end (TTFT = e2e, as the benchmark client measures it)."""
    if rec.first_token_s is None and rec.status == 200:
        return rec.end_s
    return rec.first_token_s


def outcome_fields(rec: RequestRecord) -> dict[str, object]:
    ttft_ms, tpot_ms, e2e_ms = latencies(rec.arrival_s, first_token_s(rec), rec.end_s, rec.completion_tokens)
    good = is_good(rec.status, ttft_ms, tpot_ms, rec.slo_ttft_ms, rec.slo_tpot_ms)
    return {
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


_SPAN_FIELDS = (
    "replica", "adapter_version", "status", "ttft_ms", "tpot_ms", "e2e_ms", "completion_tokens", "good",
)  # fmt: skip


def annotate(rec: RequestRecord, span: Span | None, base_model: str) -> None:
    """Write the request's outcome on `span` (collm.* and gen_ai.* attributes), if it still records."""
    if span is None or not span.is_recording():
        return
    fields = outcome_fields(rec)
    for key in _SPAN_FIELDS:
        value = fields[key]
        if value is not None:
            span.set_attribute(f"collm.{key}", value)  # type: ignore[arg-type]
    span.set_attributes(
        response_attributes(
            rec.adapter_version_id, base_model, rec.prompt_tokens, rec.completion_tokens, rec.finish_reason
        )
    )


def record(rec: RequestRecord, span: trace.Span | None = None, base_model: str = "") -> None:
    """Write the outcome once (later calls do nothing)."""
    if rec.recorded:
        return
    rec.recorded = True
    fields = outcome_fields(rec)
    ttft_ms, tpot_ms, e2e_ms = latencies(rec.arrival_s, first_token_s(rec), rec.end_s, rec.completion_tokens)
    good = bool(fields["good"])
    version = rec.adapter_version_id or "none"
    metrics.VERSIONS.touch(rec.model, version, str(rec.status))
    metrics.REQUESTS.labels(rec.model, version, str(rec.status)).inc()
    if rec.status == 200:
        if ttft_ms is not None:
            metrics.TTFT.labels(rec.model, version).observe(ttft_ms / 1000.0)
        if tpot_ms is not None:
            metrics.TPOT.labels(rec.model, version).observe(tpot_ms / 1000.0)
        if e2e_ms is not None:
            metrics.E2E.labels(rec.model, version).observe(e2e_ms / 1000.0)
        metrics.PROMPT_TOKENS.labels(rec.model).inc(rec.prompt_tokens)
    if rec.completion_tokens:
        metrics.COMPLETION_TOKENS.labels(rec.model).inc(rec.completion_tokens)
    if good:
        metrics.GOOD_REQUESTS.labels(rec.model).inc()
    log.info("request %s %s", rec.request_id, rec.status, extra=fields)
    annotate(rec, span, base_model)


def _round(x: float | None) -> float | None:
    return round(x, 3) if x is not None else None
