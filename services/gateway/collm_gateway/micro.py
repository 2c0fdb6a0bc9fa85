"""The gateway's NATS micro service `collm-gateway`: PING/INFO/STATS for `nats micro ls`, and `status`."""

from __future__ import annotations

from collections.abc import Mapping

from collm_common import subjects
from collm_common.bus import Bus, MicroService
from collm_common.wire.gateway import GatewayReplicaView, GatewayStatus, GatewayStatusRequest
from collm_gateway.cluster import ClusterView
from collm_gateway.routing import is_stale, weights_factor
from collm_gateway.settings import GatewaySettings


def cluster_status(settings: GatewaySettings, cluster: ClusterView, started_unix_s: float) -> GatewayStatus:
    views = []
    for snap in sorted(cluster.snapshots(), key=lambda s: s.replica_id):
        t = cluster.telemetry(snap.replica_id)
        views.append(
            GatewayReplicaView(
                replica_id=snap.replica_id,
                fresh=not is_stale(snap, cluster.routing),
                age_s=round(snap.age_s, 3),
                model=t.model if t else "",
                queue_len=snap.queue_len,
                running=snap.running,
                max_batch=snap.max_batch,
                in_flight_here=snap.local_in_flight,
                adapters={a.name: a.version_id for a in t.adapters} if t else {},
            )
        )
    w = cluster.weights()
    return GatewayStatus(
        gateway_id=settings.gateway_id,
        base_model=settings.base_model,
        started_unix_s=started_unix_s,
        in_flight=cluster.total_in_flight(),
        replicas=views,
        weights=dict(w.weights) if w else {},
        weights_age_s=round(w.age_s, 3) if w else None,
        weights_factor=weights_factor(w, cluster.routing),
    )


async def register(
    bus: Bus, settings: GatewaySettings, cluster: ClusterView, started_unix_s: float, http_url: str
) -> MicroService:
    svc = await bus.service(
        subjects.SERVICE_GATEWAY,
        settings.micro_version,
        "CoLLM gateway: OpenAI-compatible HTTP API, routing requests to replicas",
        {"gateway_id": settings.gateway_id, "base_model": settings.base_model, "http": http_url},
    )

    async def status(_req: GatewayStatusRequest, _headers: Mapping[str, str]) -> GatewayStatus:
        return cluster_status(settings, cluster, started_unix_s)

    await svc.endpoint("status", subjects.gateway("status"), GatewayStatusRequest, status)
    return svc
