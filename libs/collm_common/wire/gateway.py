"""The gateway's `status` endpoint (`subjects.gateway("status")`): its view of the cluster.

Answered by any one gateway instance (queue group), so `collm status` sees what routing sees: which
replicas are fresh, their load and resident adapters, and how much the coordinator's weights count.
"""

from __future__ import annotations

from pydantic import Field

from collm_common.wire.base import WireModel


class GatewayStatusRequest(WireModel):
    pass


class GatewayReplicaView(WireModel):
    replica_id: str
    fresh: bool
    age_s: float
    model: str = ""
    queue_len: int = 0
    running: int = 0
    max_batch: int = 0
    in_flight_here: int = 0
    adapters: dict[str, str] = Field(default_factory=dict)  # name -> version id


class GatewayStatus(WireModel):
    gateway_id: str
    base_model: str
    started_unix_s: float
    in_flight: int = 0
    replicas: list[GatewayReplicaView] = Field(default_factory=list)
    weights: dict[str, float] = Field(default_factory=dict)
    weights_age_s: float | None = None
    weights_factor: float = 0.0
