"""The simulated control plane: the gateway's view of the replicas and its routing, and the coordinator.

Telemetry (every `telemetry_interval_s`): every replica's snapshot reaches the gateway and the
coordinator. Routing: the gateway's policy ranks the replicas from their latest telemetry, this
gateway's own in-flight counts and the coordinator's latest weights (`rank_replicas`). The coordinator
ticks when its core asks (`CoordinatorCore.on_tick`); weights go to the gateway, shares to the replicas
(with their TTL) when the coordinator service would send them (`share_command_due`: changed, or half
their TTL old; a share reaching a busy replica ends its training stretch at the next piece, as a command
does on the engine), round plans to the simulated aggregator. Control messages and weights arrive at once
(the bus adds milliseconds).

The `separate` baseline is a serving cluster beside a training cluster: by default (`separate_routing=
"serving_cluster"`) its requests are routed by the gateway's least-loaded rule over the serving replicas
only, as that cluster's own gateway would; `"weights"` instead feeds the coordinator's weights to the
shared gateway's weighted draw. `router="mask"` applies the same rule to every policy's published
weights (a what-if for a gateway that treats weights as an eligibility mask; the shipped gateway draws).
"""

from __future__ import annotations

from typing import Any

from collm_common.calibration import Calibration
from collm_coordinator import convert
from collm_coordinator.core import SentShare, TickInputs, share_command_due
from collm_coordinator.core.types import ReplicaObservation
from collm_coordinator.priors import cost_prior, quality_prior
from collm_sim.config import SimConfig
from collm_sim.events import EventQueue
from collm_sim.plugins import (
    CoordinatorCore,
    CoreConfig,
    ReplicaSnapshot,
    RoutingConfig,
    WeightsSnapshot,
    rank_replicas,
)
from collm_sim.replica import SimReplica
from collm_sim.rounds import SimAggregator

# `snapshots_at` copies snapshots' instance dictionaries: a snapshot must keep its fields there.
assert not hasattr(ReplicaSnapshot, "__slots__") and not hasattr(ReplicaSnapshot, "__post_init__")


def snapshots_at(
    view: dict[str, tuple[float, ReplicaSnapshot]],
    now: float,
    in_flight: dict[str, int],
    only: set[str] | None = None,
) -> list[ReplicaSnapshot]:
    """The gateway's snapshots at `now`: for each replica of `view` (of `only`, when given), its
    telemetry's snapshot (received at the time beside it) with its age and this gateway's in-flight count,
    i.e. `dataclasses.replace(base, age_s=now - received_s, local_in_flight=in_flight[id])`, built by
    copying the fields at once (the frozen dataclass's `__init__` sets them one by one, and this runs for
    every replica on every request)."""
    new, cls = object.__new__, ReplicaSnapshot
    out = []
    for rid, (received_s, base) in view.items():
        if only is not None and rid not in only:
            continue
        snap = new(cls)
        fields = snap.__dict__
        fields.update(base.__dict__)
        fields["age_s"] = now - received_s
        fields["local_in_flight"] = in_flight[rid]
        out.append(snap)
    return out


class ControlPlane:
    """The gateway and the coordinator of one simulation over `replicas`; round plans go to
    `aggregator`, and what reaches a replica wakes it through `queue`. `in_flight`: the gateway's requests
    in flight per replica (the caller counts them)."""

    def __init__(
        self,
        cfg: SimConfig,
        calibration: Calibration,
        replicas: dict[str, SimReplica],
        aggregator: SimAggregator,
        queue: EventQueue,
    ) -> None:
        self.cfg = cfg
        self.replicas = replicas
        self.ids = sorted(replicas)
        self.aggregator = aggregator
        self.queue = queue
        core_kw: dict[str, Any] = {
            "cost_prior": cost_prior(calibration, cfg.engine.train_micro_tokens),
            "quality_prior": quality_prior(calibration, float(cfg.core.get("quality_token_scale", 20_000.0))),  # type: ignore[arg-type]
        }
        core_kw.update(cfg.core)
        self.core = CoordinatorCore(CoreConfig(**core_kw), cfg.policy)
        g = cfg.gateway
        self.routing_cfg = RoutingConfig(
            g.telemetry_stale_s, g.telemetry_stale_intervals, g.weights_hold_frac, g.adapter_miss_penalty
        )
        self.weights: WeightsSnapshot | None = None
        self._weights_at = 0.0
        self._shares_sent: dict[str, SentShare] = {}  # replica -> the share command last sent
        # The gateway's view of each replica: when its telemetry arrived, and the snapshot it gives (age
        # and this gateway's in-flight count are set per request: `snapshots_at`).
        self._gw_view: dict[str, tuple[float, ReplicaSnapshot]] = {}
        self.in_flight: dict[str, int] = dict.fromkeys(self.ids, 0)
        self._pending_obs: list[ReplicaObservation] = []
        self.share_samples: list[float] = []  # per fast tick: the total share
        # Per fast tick and replica: a training share in force, and a round job held with it.
        self.share_ticks = 0
        self.share_job_ticks = 0
        self.z_samples: list[float] = []  # per fast tick: the coordinator's virtual queue

    def route(self, domain: str, t: float, draw: float) -> list[str]:
        """The replicas the gateway tries for a request of `domain` at `t`, in order (at most `1 +
        max_retries`); `draw`: the request's uniform draw for the weighted choice."""
        weights = None
        if self.weights is not None:
            w = self.weights
            weights = WeightsSnapshot(t - self._weights_at, w.ttl_s, w.weights, w.adapter_weights)
        serving: set[str] | None = None
        mask = self.cfg.router == "mask" or (
            self.cfg.policy == "separate" and self.cfg.separate_routing == "serving_cluster"
        )
        if mask and weights is not None and weights.age_s < weights.ttl_s:
            # Weights as an eligibility mask: least-loaded over the replicas with a positive weight (for
            # separate, the serving cluster's own gateway, which knows only the serving replicas).
            table = weights.adapter_weights.get(domain) or weights.weights
            serving = {r for r, x in table.items() if x > 0} or None
            weights = None
        snaps = snapshots_at(self._gw_view, t, self.in_flight, serving)
        tries = 1 + self.cfg.gateway.max_retries  # the gateway tries no more replicas than this
        return rank_replicas(snaps, weights, domain, draw, self.routing_cfg, limit=tries).replica_ids

    def telemetry(self, t: float, interval: float) -> None:
        """Every replica's telemetry reaches the gateway and the coordinator."""
        for rid in self.ids:
            rep = self.replicas[rid]
            msg = rep.telemetry(t, interval)
            self._gw_view[rid] = (
                t,
                ReplicaSnapshot(
                    rid, 0.0, msg.interval_s, msg.queue_len, msg.running, msg.max_batch, 0,
                    {a.name: a.version for a in msg.adapters},
                ),
            )  # fmt: skip
            self._pending_obs.append(convert.observation(msg, t))

    def tick(self, t: float) -> float:
        """The coordinator's tick at `t` on what it learnt since the last one; its next tick's time."""
        versions = self.aggregator.version_views()
        inputs = TickInputs(tuple(self._pending_obs), self.aggregator.take_events(), versions)
        self._pending_obs = []
        d = self.core.on_tick(t, inputs)
        if d.slow is not None:
            for plan in d.slow.plans:
                self.aggregator.open_round(plan, t)
        if d.fast is not None:
            fast = d.fast
            if fast.routing is not None and fast.routing.publish:
                self.weights = WeightsSnapshot(
                    0.0, fast.routing.ttl_s, fast.routing.weights, fast.routing.adapter_weights
                )
                self._weights_at = t
            for s in fast.shares:
                # As the coordinator service: a share is sent when it changed or is half its TTL old
                # (`share_command_due`); the command reaching a replica ends a stretch of training at
                # the next piece, as on the engine, and an idle replica with a job starts training.
                last = self._shares_sent.get(s.replica_id)
                if not share_command_due(last, s.share, s.spend, t, fast.share_ttl_s):
                    continue
                self._shares_sent[s.replica_id] = SentShare(s.share, s.spend, t)
                rep = self.replicas[s.replica_id]
                rep.set_share(s.share, t + fast.share_ttl_s, s.spend)
                if not rep.idle or (s.share > 0 and rep.has_job):
                    self.queue.wake(rep, t)
            self.share_samples.append(sum(s.share for s in fast.shares))
            for rep in self.replicas.values():
                if rep.share_now(t) > 0:
                    self.share_ticks += 1
                    self.share_job_ticks += rep.has_job
            self.z_samples.append(d.diagnostics.virtual_queue)
        return max(d.next_tick_s, t + 1e-6)
