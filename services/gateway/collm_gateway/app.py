"""The FastAPI application: `build_app(settings, bus, store)` wires state, routes, errors and tracing.

The app does not own its bus and store (the service entrypoint, or a test, does); its lifespan
subscribes to telemetry, routing weights and adapter publications, and registers the `collm-gateway`
micro service, and undoes all of it on shutdown. Every `/v1/` request (and vLLM's `/tokenize` and
`/detokenize`) is authenticated first (auth.py:
API keys, tenants, rate limits), then its body size is checked (limits.py); the admin routes
(api/admin.py) need an admin key. Every response of a traced route carries `x-collm-trace-id`
(traceid.py). Every error leaves as the OpenAI envelope: validation errors become 400 (not FastAPI's
422), Starlette's own errors (404 route, 405, 413 body) keep their status, anything unexpected is a 500
without internals; every 4xx is counted by status and code (`metrics.REFUSED`). The OpenAPI document
(`/openapi.json`) declares exactly that, per route (api/responses.py). The live dashboard (dashboard/:
`/dashboard`, its state and its event stream) checks API keys itself, as a browser's event stream cannot
send headers.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from starlette.exceptions import HTTPException as StarletteHTTPException

from collm_common import subjects
from collm_common.bus import Bus, MicroService
from collm_common.clock import Clock, WallClock
from collm_common.store import AdapterStore, version_id
from collm_common.tracing import current_trace_id
from collm_common.wire.adapters import AdapterPublished
from collm_gateway import __version__, metrics, micro
from collm_gateway.adapter_admin import AdapterAdmin
from collm_gateway.api import admin, chat, completions, health, models, tokenize
from collm_gateway.api.responses import document as openapi_document
from collm_gateway.api.responses import errors
from collm_gateway.auth import Authenticator, AuthMiddleware
from collm_gateway.catalog import ModelCatalog
from collm_gateway.cluster import ClusterView
from collm_gateway.dashboard import routes as dashboard_routes
from collm_gateway.dashboard.hub import DashboardHub
from collm_gateway.dashboard.state import DashboardLimits
from collm_gateway.dispatch import Dispatcher, routing_config
from collm_gateway.errors import APIError, from_http_status, from_validation
from collm_gateway.limits import BodyLimitMiddleware
from collm_gateway.samples import SampleIntake
from collm_gateway.serving import CompletionServing
from collm_gateway.settings import GatewaySettings
from collm_gateway.shapes import model_card
from collm_gateway.tokenization import Tokenization
from collm_gateway.traceid import TRACE_ID_HEADER, GatewayApp, TraceIdMiddleware, TraceIdProvider

log = logging.getLogger(__name__)

UNTRACED_URLS = "healthz,readyz,metrics,dashboard"  # dashboard URLs may carry an API key


@dataclass
class GatewayState:
    """Everything a request needs, built once per app and reached by routes through `StateDep`."""

    settings: GatewaySettings
    bus: Bus
    store: AdapterStore
    clock: Clock
    cluster: ClusterView
    catalog: ModelCatalog
    dispatcher: Dispatcher
    serving: CompletionServing
    auth: Authenticator
    adapter_admin: AdapterAdmin
    sample_intake: SampleIntake
    tokenization: Tokenization
    dashboard: DashboardHub | None = None
    started_unix_s: float = 0.0
    micro: MicroService | None = None
    _subs: list[Any] = field(default_factory=list)

    def base_card(self) -> dict[str, Any]:
        s = self.settings
        return model_card(
            s.base_model, int(self.started_unix_s), "collm", None, s.base_model, s.max_model_len
        )

    def adapter_card(
        self, name: str, version: int, created_unix_s: float, owner: str | None
    ) -> dict[str, Any]:
        s = self.settings
        card = model_card(
            name,
            int(created_unix_s),
            owner or "collm",
            s.base_model,
            version_id(name, version),
            s.max_model_len,
        )
        card["version"] = version
        return card

    async def start(self) -> None:
        self.started_unix_s = self.clock.now()
        await self.cluster.subscribe(self.bus)
        if self.dashboard is not None:
            await self.dashboard.start()

        async def on_published(_msg: AdapterPublished, _raw: Any) -> None:
            self.catalog.invalidate()

        self._subs.append(
            await self.bus.subscribe(subjects.adapter_published_all(), AdapterPublished, on_published)
        )
        http_url = f"http://{self.settings.host}:{self.settings.port}"
        self.micro = await micro.register(
            self.bus, self.settings, self.cluster, self.started_unix_s, http_url
        )
        await self.bus.nc.flush()  # subscriptions are live on the server before the app reports started
        log.info(
            "gateway %s serving %s",
            self.settings.gateway_id,
            self.settings.base_model,
            extra={"gateway_id": self.settings.gateway_id, "http": http_url},
        )
        log.info(self.auth.describe(), extra={"keys_required": self.auth.keys_required})

    async def stop(self) -> None:
        if self.micro is not None:
            with contextlib.suppress(Exception):
                await self.micro.stop()
            self.micro = None
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        if self.dashboard is not None:
            await self.dashboard.stop()
        await self.cluster.unsubscribe()


def build_state(
    settings: GatewaySettings,
    bus: Bus,
    store: AdapterStore,
    clock: Clock | None = None,
    rng: random.Random | None = None,
) -> GatewayState:
    clock = clock or WallClock()
    cluster = ClusterView(clock, routing_config(settings))
    catalog = ModelCatalog(store, settings.base_model, settings.models_cache_ttl_s, clock)
    dispatcher = Dispatcher(settings, bus, cluster, clock, rng)
    serving = CompletionServing(settings, catalog, dispatcher, clock)
    auth = Authenticator(settings, clock)
    adapter_admin = AdapterAdmin(settings, bus, store, catalog)
    intake = SampleIntake(settings, bus, cluster, clock)
    tokenization = Tokenization(settings, bus, cluster, catalog, rng)
    state = GatewayState(
        settings, bus, store, clock, cluster, catalog, dispatcher, serving, auth, adapter_admin, intake,
        tokenization,
    )  # fmt: skip
    limits = DashboardLimits(
        stale_after_s=settings.telemetry_stale_s, stale_after_intervals=settings.telemetry_stale_intervals
    )
    state.dashboard = DashboardHub(bus, store, clock, limits=limits, ping_s=settings.sse_ping_s)
    return state


def build_app(
    settings: GatewaySettings,
    bus: Bus,
    store: AdapterStore,
    *,
    clock: Clock | None = None,
    rng: random.Random | None = None,
) -> FastAPI:
    state = build_state(settings, bus, store, clock, rng)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = GatewayApp(
        title="CoLLM gateway",
        version=__version__,
        description="OpenAI-compatible API of CoLLM",
        lifespan=lifespan,
        responses=errors(500),  # any route, on an unexpected error (install_error_handlers)
    )
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    app.state.gateway = state
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    # Added after the body limit, so it runs before: an unauthenticated request is refused before its
    # body is read.
    app.add_middleware(AuthMiddleware, authenticator=state.auth)
    # Outermost of the app's own middleware: every answer below it carries the trace id.
    app.add_middleware(TraceIdMiddleware)
    install_error_handlers(app)
    for module in (chat, completions, models, tokenize, health, admin, dashboard_routes):
        app.include_router(module.router)
    FastAPIInstrumentor.instrument_app(
        app,
        tracer_provider=TraceIdProvider(),
        excluded_urls=UNTRACED_URLS,
        exclude_spans=["send", "receive"],
    )
    return app


def error_response(err: APIError) -> JSONResponse:
    metrics.count_refusal(err.status, err.code)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_validation(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(from_validation(exc.errors()))

    async def on_http(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        err = from_http_status(exc.status_code, str(exc.detail) if exc.detail else None)
        resp = error_response(err)
        for key, value in (exc.headers or {}).items():
            resp.headers[key] = value
        return resp

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        resp = error_response(APIError(500, "internal error in the gateway", code="internal_error"))
        trace_id = current_trace_id()  # this handler answers outside TraceIdMiddleware
        if trace_id is not None:
            resp.headers[TRACE_ID_HEADER] = trace_id
        return resp

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
