"""The gateway's view of the cluster: the latest telemetry of each replica and the coordinator's weights.

Ages are measured on this gateway's monotonic clock from when a message arrived, not from the
sender's timestamp, so clock skew between machines cannot make a dead replica look fresh. The view
also counts the requests this gateway has in flight per replica (telemetry lags by up to an interval).
Replicas silent for much longer than the staleness limit are forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from collm_common import subjects
from collm_common.bus import Bus
from collm_common.clock import Clock
from collm_common.wire.control import RoutingWeights
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_gateway import metrics
from collm_gateway.routing import ReplicaSnapshot, RoutingConfig, WeightsSnapshot, is_stale

FORGET_AFTER_STALE_FACTOR = 20.0


@dataclass
class _Seen:
    telemetry: ReplicaTelemetry
    received_s: float


class ClusterView:
    def __init__(self, clock: Clock, routing: RoutingConfig) -> None:
        self.clock = clock
        self.routing = routing
        self._replicas: dict[str, _Seen] = {}
        self._weights: tuple[RoutingWeights, float] | None = None
        self._in_flight: dict[str, int] = {}
        self._subs: list[Any] = []

    # --- inputs --------------------------------------------------------------------------------------
    def on_telemetry(self, t: ReplicaTelemetry) -> None:
        self._replicas[t.replica_id] = _Seen(t, self.clock.monotonic())

    def on_weights(self, w: RoutingWeights) -> None:
        self._weights = (w, self.clock.monotonic())

    def begin(self, replica_id: str) -> None:
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1

    def end(self, replica_id: str) -> None:
        left = self._in_flight.get(replica_id, 0) - 1
        if left > 0:
            self._in_flight[replica_id] = left
        else:
            self._in_flight.pop(replica_id, None)

    async def subscribe(self, bus: Bus) -> None:
        async def on_telemetry(msg: ReplicaTelemetry, _raw: Any) -> None:
            self.on_telemetry(msg)

        async def on_weights(msg: RoutingWeights, _raw: Any) -> None:
            self.on_weights(msg)

        self._subs.append(await bus.subscribe(subjects.telemetry_all(), ReplicaTelemetry, on_telemetry))
        self._subs.append(await bus.subscribe(subjects.routing_weights(), RoutingWeights, on_weights))

    async def unsubscribe(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # connection already closed: nothing left to undo
                pass
        self._subs.clear()

    # --- outputs -------------------------------------------------------------------------------------
    def snapshots(self) -> list[ReplicaSnapshot]:
        now = self.clock.monotonic()
        out = []
        for rid, seen in list(self._replicas.items()):
            t = seen.telemetry
            snap = ReplicaSnapshot(
                replica_id=rid,
                age_s=now - seen.received_s,
                interval_s=t.interval_s,
                queue_len=t.queue_len,
                running=t.running,
                max_batch=t.max_batch,
                local_in_flight=self._in_flight.get(rid, 0),
                adapters={a.name: a.version for a in t.adapters},
            )
            limit_s = max(
                self.routing.telemetry_stale_s, self.routing.telemetry_stale_intervals * t.interval_s
            )
            if snap.age_s > FORGET_AFTER_STALE_FACTOR * limit_s:
                del self._replicas[rid]
                continue
            out.append(snap)
        metrics.FRESH_REPLICAS.set(sum(1 for s in out if not is_stale(s, self.routing)))
        return out

    def weights(self) -> WeightsSnapshot | None:
        if self._weights is None:
            return None
        w, received_s = self._weights
        return WeightsSnapshot(
            age_s=self.clock.monotonic() - received_s,
            ttl_s=w.ttl_s,
            weights=dict(w.weights),
            adapter_weights={k: dict(v) for k, v in w.adapter_weights.items()},
        )

    def is_fresh(self, replica_id: str) -> bool:
        seen = self._replicas.get(replica_id)
        if seen is None:
            return False
        t = seen.telemetry
        snap = ReplicaSnapshot(replica_id, self.clock.monotonic() - seen.received_s, interval_s=t.interval_s)
        return not is_stale(snap, self.routing)

    def fresh_replicas(self) -> list[str]:
        return sorted(s.replica_id for s in self.snapshots() if not is_stale(s, self.routing))

    def telemetry(self, replica_id: str) -> ReplicaTelemetry | None:
        seen = self._replicas.get(replica_id)
        return seen.telemetry if seen else None

    def in_flight(self, replica_id: str) -> int:
        return self._in_flight.get(replica_id, 0)

    def total_in_flight(self) -> int:
        return sum(self._in_flight.values())
