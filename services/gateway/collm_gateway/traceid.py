"""The request's trace id on every response: the `x-collm-trace-id` header, tracing exported or not.

The gateway's HTTP server spans come from `TraceIdProvider`: the process's SDK tracer provider when one
is installed (tracing exports, `collm_common.tracing.setup_tracing`), otherwise a local SDK provider
without an exporter, whose spans get real ids and go nowhere. Either way every traced request has a
trace id (32 hex digits): in its response's `x-collm-trace-id`, in its log lines (`trace_id`), and in
the trace context sent to the replica, so a replica that exports traces files its spans under it.

`GatewayApp` starts every HTTP request from an empty OpenTelemetry context, so each request on a
kept-alive connection is its own trace (or its `traceparent`'s). `TraceIdMiddleware` writes the header on
every response that passes through the app's middleware: answers, streams (their headers go out before the
first event) and the error envelopes of API keys, rate limits, body limits, validation and routes. The
handler of unexpected errors answers outside the middleware and writes it itself
(`app.install_error_handlers`). The routes left untraced (`/healthz`, `/readyz`, `/metrics`, `/dashboard`)
have no span and no header.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider as SDKTracerProvider
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from collm_common.tracing import current_trace_id

TRACE_ID_HEADER = "x-collm-trace-id"


class TraceIdProvider(trace.TracerProvider):
    """Tracers whose spans always have a trace id: each span is started by the SDK provider that
    `installed()` returns at that moment (the process's global one by default), or by a local
    provider without exporter when there is none (the global provider is then the API's no-op)."""

    def __init__(self, installed: Callable[[], trace.TracerProvider] = trace.get_tracer_provider) -> None:
        self._installed = installed
        self._local: SDKTracerProvider | None = None

    def current(self) -> SDKTracerProvider:
        provider = self._installed()
        if isinstance(provider, SDKTracerProvider):
            return provider
        if self._local is None:
            self._local = SDKTracerProvider()
        return self._local

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> trace.Tracer:
        return _Tracer(
            self, (instrumenting_module_name, instrumenting_library_version, schema_url, attributes)
        )


class _Tracer(trace.Tracer):
    def __init__(self, provider: TraceIdProvider, names: tuple[Any, ...]) -> None:
        self._provider = provider
        self._names = names

    def _tracer(self) -> trace.Tracer:
        return self._provider.current().get_tracer(*self._names)

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        return self._tracer().start_span(*args, **kwargs)

    @contextlib.contextmanager  # type: ignore[override]
    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Iterator[trace.Span]:
        with self._tracer().start_as_current_span(*args, **kwargs) as span:
            yield span


def with_trace_id(headers: Sequence[tuple[bytes, bytes]], trace_id: str) -> list[tuple[bytes, bytes]]:
    """ASGI response headers with `x-collm-trace-id` set to `trace_id` (replacing any already there)."""
    name = TRACE_ID_HEADER.encode()
    return [(k, v) for k, v in headers if k.lower() != name] + [(name, trace_id.encode())]


class GatewayApp(FastAPI):
    """The gateway's FastAPI app: every HTTP request starts from an empty OpenTelemetry context, so its
    server span is the root of its own trace (or a child of its `traceparent`), never a child of whatever
    was current where the server created the request's task. That can be another request's span: when a
    request body outgrows uvicorn's read buffer (64 KiB), the request pauses and later resumes the
    socket's reading from inside its own span, and asyncio runs every later read callback of that
    connection (which starts the next requests' tasks) in the context current at that moment."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        token = otel_context.attach(otel_context.Context())
        try:
            await super().__call__(scope, receive, send)
        finally:
            otel_context.detach(token)


class TraceIdMiddleware:
    """Adds `x-collm-trace-id` (the trace id of the request's server span) to the response's headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        trace_id = current_trace_id() if scope["type"] == "http" else None
        if trace_id is None:
            await self.app(scope, receive, send)
            return

        async def send_with_trace_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": with_trace_id(message.get("headers", ()), trace_id)}
            await send(message)

        await self.app(scope, receive, send_with_trace_id)
