"""`GET /healthz` (the process is up), `GET /readyz` (a replica can serve), `GET /metrics` (Prometheus), and
vLLM's `GET /health` (200 with an empty body when a replica can serve, else 503) and `GET /version`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from collm_gateway import __version__
from collm_gateway.api.deps import StateDep
from collm_gateway.api.responses import errors
from collm_gateway.errors import no_replica

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


def ready_replicas(state: Any) -> list[str]:
    """The replicas with fresh telemetry; a 503 (`no_replica`) when NATS is down or there are none."""
    if not state.bus.connected:
        raise no_replica(state.settings.retry_after_s, "not ready: NATS is unreachable")
    fresh = state.cluster.fresh_replicas()
    if not fresh:
        raise no_replica(state.settings.retry_after_s, "not ready: no replica has reported fresh telemetry")
    return fresh


@router.get("/readyz", responses=errors(503))
async def readyz(state: StateDep) -> dict[str, Any]:
    """200 only when NATS is connected and at least one replica reported fresh telemetry."""
    return {"status": "ready", "replicas": ready_replicas(state)}


@router.get(
    "/health", response_class=Response, responses={200: {"description": "Empty body."}, **errors(503)}
)
async def health(state: StateDep) -> Response:
    """vLLM's health check: 200 with an empty body when the gateway can serve (as `/readyz`), else 503."""
    ready_replicas(state)
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    """vLLM's version endpoint: the CoLLM gateway's version."""
    return {"version": __version__}


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition format.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
async def metrics() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
