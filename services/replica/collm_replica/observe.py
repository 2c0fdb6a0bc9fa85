"""What a replica records about each generate request: span attributes, metrics and one log line.

Pure helpers over the wire types (no NATS, no torch), called by the service shell:

* `request_attributes`: the OpenTelemetry GenAI semantic-convention attributes known when a request
  arrives (`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.request.max_tokens`, ...), set on
  the replica's `generate` span. The usage attributes (`gen_ai.usage.input_tokens` / `output_tokens`,
  `gen_ai.response.finish_reasons`) are set by the engine when the sequence finishes, just before it
  ends the span; the queue wait, prefill and decode are the span's events (`queued`, `prefill_start`
  with `queue_ms`, `first_token` with `ttft_ms`, `finished`).
* `finished_fields`: the fields of the one structured log line per finished request (written inside
  the request's span, so it carries the request's trace id), and `record_finished` / `record_failed`
  for the metrics (`collm_replica_requests_total`, `_ttft_seconds`, `_tpot_seconds` by model and exact
  adapter version).
"""

from __future__ import annotations

from collm_common.wire.inference import Finished, GenerateRequest
from collm_replica import metrics

# OpenTelemetry GenAI semantic conventions (attribute names as in opentelemetry-semantic-conventions);
# the same provider name as the gateway's spans.
GEN_AI_PROVIDER = "collm"


def requested_model(gr: GenerateRequest, base_model: str) -> str:
    """The model a request asked for: the adapter name (`name@vN` when pinned) or the base model id."""
    if gr.adapter is None:
        return base_model
    return f"{gr.adapter}@v{gr.adapter_version}" if gr.adapter_version is not None else gr.adapter


def model_label(gr: GenerateRequest | None, base_model: str) -> str:
    """The `model` metrics label: the adapter name or the base model id, as the gateway labels it."""
    if gr is None:
        return "unknown"
    return gr.adapter or base_model


def request_attributes(gr: GenerateRequest, base_model: str) -> dict[str, str | int | float]:
    """GenAI attributes known when the request arrives."""
    attrs: dict[str, str | int | float] = {
        "gen_ai.operation.name": "chat" if gr.messages is not None else "text_completion",
        "gen_ai.provider.name": GEN_AI_PROVIDER,
        "gen_ai.request.model": requested_model(gr, base_model),
        "gen_ai.request.max_tokens": gr.sampling.max_tokens,
        "gen_ai.request.temperature": gr.sampling.temperature,
        "gen_ai.request.top_p": gr.sampling.top_p,
        "gen_ai.response.id": gr.request_id,
    }
    if gr.sampling.seed is not None:
        attrs["gen_ai.request.seed"] = gr.sampling.seed
    return attrs


def finished_fields(ev: Finished, model: str) -> dict[str, str | int | float]:
    """The structured fields of a finished request's log line."""
    return {
        "request_id": ev.request_id,
        "replica": ev.replica_id,
        "model": model,
        "adapter_version": ev.adapter_version_id,
        "finish_reason": ev.finish_reason,
        "prompt_tokens": ev.prompt_tokens,
        "completion_tokens": ev.completion_tokens,
        "queue_ms": round(ev.queue_ms, 3),
        "ttft_ms": round(ev.ttft_ms, 3),
        "tpot_ms": round(ev.tpot_ms, 3),
        "e2e_ms": round(ev.e2e_ms, 3),
    }


def record_finished(replica: str, model: str, ev: Finished) -> None:
    """Metrics of a finished request: TTFT once a token came, TPOT from the second token on."""
    metrics.record_request(
        replica,
        model,
        ev.adapter_version_id,
        ev.finish_reason,
        ttft_s=ev.ttft_ms / 1e3 if ev.completion_tokens else None,
        tpot_s=ev.tpot_ms / 1e3 if ev.completion_tokens > 1 else None,
    )


def record_failed(replica: str, model: str, version: str | None, outcome: str) -> None:
    """Metrics of a request refused (`refused_<code>`, before any version was chosen) or failed midway."""
    metrics.record_request(replica, model, version or metrics.NO_VERSION, outcome)
