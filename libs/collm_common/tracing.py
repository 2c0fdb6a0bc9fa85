"""OpenTelemetry for every service: off unless configured, W3C trace context across NATS.

`setup_tracing(service)` installs an SDK tracer provider exporting over OTLP/HTTP when
`OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set and neither
`OTEL_SDK_DISABLED=true` nor `OTEL_TRACES_EXPORTER=none` says otherwise; without them tracing stays a
no-op and costs nothing. `inject`/`extract` carry `traceparent`/`tracestate` in NATS headers: the
request path is one trace from the gateway's HTTP span to the replica's generation.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class OtelSettings(BaseSettings):
    """OpenTelemetry's own standard variables (no COLLM_ prefix, by OTel convention)."""

    model_config = SettingsConfigDict(extra="ignore", frozen=True)

    endpoint: str | None = Field(None, validation_alias="OTEL_EXPORTER_OTLP_ENDPOINT")
    traces_endpoint: str | None = Field(None, validation_alias="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    sdk_disabled: bool = Field(False, validation_alias="OTEL_SDK_DISABLED")
    traces_exporter: str = Field("otlp", validation_alias=AliasChoices("OTEL_TRACES_EXPORTER"))
    service_name: str | None = Field(None, validation_alias="OTEL_SERVICE_NAME")

    @property
    def enabled(self) -> bool:
        has_endpoint = bool(self.endpoint or self.traces_endpoint)
        return has_endpoint and not self.sdk_disabled and self.traces_exporter.lower() != "none"


_provider: TracerProvider | None = None


def setup_tracing(service_name: str, instance_id: str | None = None) -> bool:
    """Install the exporting provider if OTLP is configured. Returns whether tracing exports."""
    global _provider
    settings = OtelSettings()
    if not settings.enabled or _provider is not None:
        return _provider is not None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    attrs = {"service.name": settings.service_name or service_name}
    if instance_id:
        attrs["service.instance.id"] = instance_id
    provider = TracerProvider(resource=Resource.create(attrs))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporter (called last when a service stops)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current trace context (W3C `traceparent`, `tracestate`, `baggage`)."""
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract(headers: Mapping[str, str] | None) -> context.Context:
    """The trace context a message carried (an empty context when it carried none)."""
    return propagate.extract(dict(headers or {}))


def current_trace_id() -> str | None:
    """Hex trace id of the current span, for log lines; None outside a recorded span."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
