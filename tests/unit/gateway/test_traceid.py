"""Trace ids for every request: the gateway's tracer provider and the response header."""

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from collm_gateway.traceid import TRACE_ID_HEADER, TraceIdProvider, with_trace_id

pytestmark = pytest.mark.unit


def test_without_an_sdk_provider_spans_still_get_trace_ids() -> None:
    provider = TraceIdProvider(installed=trace.NoOpTracerProvider)
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("a") as span:
        ctx = span.get_span_context()
        assert ctx.is_valid and trace.get_current_span() is span
    other = tracer.start_span("b")
    assert other.get_span_context().is_valid
    assert other.get_span_context().trace_id != ctx.trace_id
    other.end()


def test_with_an_sdk_provider_its_spans_are_exported() -> None:
    sdk = TracerProvider()
    exporter = InMemorySpanExporter()
    sdk.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = TraceIdProvider(installed=lambda: sdk).get_tracer("t")
    with tracer.start_as_current_span("served") as span:
        trace_id = span.get_span_context().trace_id
    assert [(s.name, s.context.trace_id) for s in exporter.get_finished_spans()] == [("served", trace_id)]


def test_the_header_is_added_once() -> None:
    name = TRACE_ID_HEADER.encode()
    headers = with_trace_id([(b"content-type", b"application/json"), (name, b"old")], "ab" * 16)
    assert headers == [(b"content-type", b"application/json"), (name, b"ab" * 16)]
