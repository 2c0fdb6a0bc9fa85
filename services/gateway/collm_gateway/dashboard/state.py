"""The dashboard's state and its JSON view models (pure: no NATS, no Redis; time from an injected clock).

Inputs are wire messages as they arrive (`on_telemetry`, `on_decisions`, `on_coordinator_status`,
`on_round`) and adapter records read from the store (`on_adapter`, `on_adapters`). Each returns the
`Update`s it causes: a topic, a JSON-ready payload, and a `Scope` that decides who may see it
(`Update.visible_to`). `snapshot(viewer)` renders everything one viewer may see; `sse_message` frames
either as one server-sent event.

Who sees what (`Viewer`): the cluster view (replicas, coordinator decisions and plans) needs `cluster`.
An adapter, its versions and its rounds are visible to a viewer that sees every adapter, and to a
tenant for its own and shared (ownerless) adapters. The round of an adapter whose owner is not known
yet is shown only to viewers that see every adapter; when the adapter's record arrives, the adapter's
rounds are sent again with the owner known.

The coordinator's planned rounds are its last status; a plan whose round has since ended (a round event
arrived first) is left out.

Memory is bounded (`DashboardLimits`): the newest `history_points` telemetry points per replica, at
most `replicas` replicas (a replica silent for `forget_replica_after_s` is forgotten), the `rounds`
newest rounds, at most `adapters` adapters with their `versions_per_adapter` newest versions, and the
`slow_decisions` latest slow-loop decisions.

Every number in a view is finite or null (JSON has no NaN), times are Unix seconds, durations seconds.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from collm_common.clock import Clock
from collm_common.store import version_id
from collm_common.wire.control import CoordinatorDecisions, CoordinatorStatus, PlannedRound
from collm_common.wire.rounds import RoundOutcome
from collm_common.wire.telemetry import ReplicaTelemetry

Topic = Literal["replica", "replica_removed", "coordinator", "round", "adapter", "adapter_removed"]

FINAL_ROUND_STATES = frozenset({"published", "held_back", "aborted"})
_ROUND_RANK = {"opened": 0, "collecting": 1, "aggregating": 2, "evaluating": 3}


@dataclass(frozen=True)
class DashboardLimits:
    history_points: int = 120
    replicas: int = 64
    forget_replica_after_s: float = 300.0
    stale_after_s: float = 3.0
    stale_after_intervals: float = 3.0
    rounds: int = 50
    adapters: int = 200
    versions_per_adapter: int = 100
    slow_decisions: int = 5

    def as_json(self) -> dict[str, Any]:
        return {
            "history_points": self.history_points,
            "rounds": self.rounds,
            "versions_per_adapter": self.versions_per_adapter,
            "stale_after_s": self.stale_after_s,
            "stale_after_intervals": self.stale_after_intervals,
        }


@dataclass(frozen=True)
class Viewer:
    """What one dashboard client may see: the cluster view, and which adapters."""

    cluster: bool = False
    all_adapters: bool = False
    tenant: str | None = None

    def sees_adapter(self, owner: str | None, owner_known: bool = True) -> bool:
        if self.all_adapters:
            return True
        if not owner_known:
            return False
        return owner is None or (self.tenant is not None and owner == self.tenant)

    def as_json(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "all_adapters": self.all_adapters, "tenant": self.tenant}


EVERYTHING = Viewer(cluster=True, all_adapters=True)


@dataclass(frozen=True)
class Scope:
    """Who may see an update: holders of the cluster view, or viewers of one adapter (by its owner)."""

    cluster: bool = False
    adapter: str | None = None
    owner: str | None = None
    owner_known: bool = True


@dataclass(frozen=True)
class Update:
    topic: Topic
    payload: dict[str, Any]
    scope: Scope

    def visible_to(self, viewer: Viewer) -> bool:
        if self.scope.cluster:
            return viewer.cluster
        return viewer.sees_adapter(self.scope.owner, self.scope.owner_known)


@dataclass(frozen=True)
class VersionInfo:
    """One adapter version as the store records it, with its held-out loss per domain."""

    version: int
    created_unix_s: float
    source: str
    round_id: int | None = None
    parent: int | None = None
    pruned: bool = False
    quality: Mapping[str, float] = field(default_factory=dict)
    task: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # domain -> metric, score, ...


@dataclass(frozen=True)
class AdapterInfo:
    """An adapter as the store lists it: owner tenant (None: shared), current version, versions."""

    name: str
    owner: str | None
    current: int | None
    versions: tuple[VersionInfo, ...] = ()


# --- JSON helpers -----------------------------------------------------------------------------------------
def num(x: float | int | None, digits: int = 4) -> float | None:
    """`x` rounded, or None when missing or not finite."""
    if x is None:
        return None
    v = float(x)
    return round(v, digits) if math.isfinite(v) else None


def losses(d: Mapping[str, float]) -> dict[str, float | None]:
    return {k: num(v) for k, v in sorted(d.items())}


def sse_message(event: str, data: Mapping[str, Any]) -> str:
    """One server-sent event: `event: <name>` and its data as one line of JSON."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'), allow_nan=False)}\n\n"


# --- views --------------------------------------------------------------------------------------------------
def history_point(t: ReplicaTelemetry, at_unix_s: float) -> dict[str, Any]:
    return {
        "t": num(at_unix_s, 3),
        "tokens_per_s": num(t.tokens_per_s, 2),
        "ft_tokens_per_s": num(t.ft_tokens_per_s, 2),
        "queue_len": t.queue_len,
        "running": t.running,
        "slo_attainment": num(t.slo_attainment),
        "ttft_ms_p99": num(t.ttft_ms_p99, 1),
        "tpot_ms_p99": num(t.tpot_ms_p99, 1),
        "ft_share": num(t.ft_share),
    }


def replica_view(t: ReplicaTelemetry, age_s: float, fresh: bool) -> dict[str, Any]:
    load = (t.running / t.max_batch) if t.max_batch > 0 else None
    return {
        "id": t.replica_id,
        "model": t.model,
        "age_s": num(age_s, 2),
        "fresh": fresh,
        "interval_s": num(t.interval_s, 3),
        "ts_unix_s": num(t.ts_unix_s, 3),
        "queue_len": t.queue_len,
        "running": t.running,
        "max_batch": t.max_batch,
        "load": num(load),
        "kv_used_frac": num(t.kv_used_frac),
        "tokens_per_s": num(t.tokens_per_s, 2),
        "prefill_tokens_per_s": num(t.prefill_tokens_per_s, 2),
        "arrivals_per_s": num(t.arrivals_per_s, 3),
        "ttft_ms_p50": num(t.ttft_ms_p50, 1),
        "ttft_ms_p99": num(t.ttft_ms_p99, 1),
        "tpot_ms_p50": num(t.tpot_ms_p50, 1),
        "tpot_ms_p99": num(t.tpot_ms_p99, 1),
        "finished": t.finished,
        "good": t.good,
        "slo_attainment": num(t.slo_attainment),
        "ft_share": num(t.ft_share),
        "ft_share_source": t.ft_share_source,
        "ft_tokens_per_s": num(t.ft_tokens_per_s, 2),
        "ft_loss": num(t.ft_loss),
        "infer_busy_frac": num(t.infer_busy_frac),
        "train_busy_frac": num(t.train_busy_frac),
        "round_role": t.round_role,
        "round_id": t.round_id,
        "local_samples": t.local_samples,
        "domains": list(t.domains),
        "adapters": [
            {
                "name": a.name,
                "version_id": a.version_id,
                "version": a.version,
                "in_flight": a.in_flight,
                "training": a.training,
            }
            for a in t.adapters
        ],
        "training_jobs": [
            {
                "adapter": j.adapter,
                "state": j.state,
                "round_id": j.round_id,
                "tokens_done": j.tokens_done,
                "token_budget": j.token_budget,
                "train_loss": num(j.train_loss),
                "message": j.message,
            }
            for j in t.training_jobs
        ],
    }


def decisions_view(d: CoordinatorDecisions) -> dict[str, Any]:
    return {
        "ts_unix_s": num(d.ts_unix_s, 3),
        "loop": d.loop,
        "policy": d.policy,
        "note": d.note,
        "virtual_queue": num(d.virtual_queue),
        "replicas": [
            {
                "replica_id": r.replica_id,
                "ft_share": num(r.ft_share),
                "routing_weight": num(r.routing_weight),
                "reason_code": r.reason_code,
                "reason": r.reason,
            }
            for r in d.replicas
        ],
    }


def plan_view(p: PlannedRound) -> dict[str, Any]:
    return {
        "adapter": p.adapter,
        "round_id": p.round_id,
        "state": p.state,
        "base_version": p.base_version,
        "deadline_unix_s": num(p.deadline_unix_s, 3),
        "expected_gain": num(p.expected_gain, 6),
        "reason": p.reason,
        "participants": [
            {
                "replica_id": x.replica_id,
                "token_budget": x.token_budget,
                "share": num(x.share),
                "reason": x.reason,
            }
            for x in p.participants
        ],
    }


def round_view(o: RoundOutcome) -> dict[str, Any]:
    final = o.state in FINAL_ROUND_STATES
    opened = o.timeline.get("opened")
    if opened is None and o.state == "opened":
        opened = o.ts_unix_s or None
    ended = (o.timeline.get(o.state) or o.ts_unix_s or None) if final else None
    duration = ended - opened if (ended is not None and opened is not None) else None
    return {
        "round_id": o.round_id,
        "adapter": o.adapter,
        "state": o.state,
        "final": final,
        "base_version": o.base_version,
        "new_version": o.new_version,
        "new_version_id": version_id(o.adapter, o.new_version) if o.new_version is not None else None,
        "participants": list(o.participants),
        "accepted": list(o.accepted),
        "rejected": [{"replica_id": r.replica_id, "code": r.code, "reason": r.reason} for r in o.rejected],
        "late": list(o.late),
        "eval_loss_before": num(o.eval_loss_before),
        "eval_loss_after": num(o.eval_loss_after),
        "domain_losses_before": losses(o.domain_losses_before),
        "domain_losses_after": losses(o.domain_losses_after),
        "strategy": o.strategy,
        "policy": o.policy,
        "reason": o.reason,
        "opened_unix_s": num(opened, 3),
        "ended_unix_s": num(ended, 3),
        "duration_s": num(duration, 3),
        "deadline_unix_s": num(o.deadline_unix_s, 3),
        "timeline": {k: num(v, 3) for k, v in sorted(o.timeline.items(), key=lambda kv: kv[1])},
        "ts_unix_s": num(o.ts_unix_s, 3),
    }


def adapter_view(a: AdapterInfo) -> dict[str, Any]:
    return {
        "name": a.name,
        "owner": a.owner,
        "current": a.current,
        "current_id": version_id(a.name, a.current) if a.current is not None else None,
        "versions": [
            {
                "version": v.version,
                "id": version_id(a.name, v.version),
                "created_unix_s": num(v.created_unix_s, 3),
                "source": v.source,
                "round_id": v.round_id,
                "parent": v.parent,
                "pruned": v.pruned,
                "current": v.version == a.current,
                "quality": losses(v.quality),
                "task": {
                    d: {
                        "metric": str(t.get("metric", "")),
                        "score": num(t.get("score")),
                        "examples": int(t.get("examples", 0)),
                    }
                    for d, t in sorted(v.task.items())
                },
            }
            for v in a.versions
        ],
    }


# --- the state ---------------------------------------------------------------------------------------------
@dataclass
class _Replica:
    telemetry: ReplicaTelemetry
    received_s: float  # monotonic
    history: deque[dict[str, Any]]


class DashboardState:
    def __init__(self, clock: Clock, limits: DashboardLimits | None = None) -> None:
        self.clock = clock
        self.limits = limits or DashboardLimits()
        self._replicas: dict[str, _Replica] = {}
        self._fast: CoordinatorDecisions | None = None
        self._slow: deque[CoordinatorDecisions] = deque(maxlen=self.limits.slow_decisions)
        self._status: CoordinatorStatus | None = None
        self._rounds: dict[int, RoundOutcome] = {}
        self._adapters: dict[str, AdapterInfo] = {}

    # --- replicas ------------------------------------------------------------------------------------------
    def _fresh(self, t: ReplicaTelemetry, age_s: float) -> bool:
        limit_s = max(self.limits.stale_after_s, self.limits.stale_after_intervals * t.interval_s)
        return age_s <= limit_s

    def on_telemetry(self, t: ReplicaTelemetry) -> list[Update]:
        now_s = self.clock.monotonic()
        seen = self._replicas.get(t.replica_id)
        out: list[Update] = []
        if seen is None:
            if len(self._replicas) >= self.limits.replicas:
                out += self.expire()
            if len(self._replicas) >= self.limits.replicas:
                return out
            seen = _Replica(t, now_s, deque(maxlen=self.limits.history_points))
            self._replicas[t.replica_id] = seen
        seen.telemetry, seen.received_s = t, now_s
        point = history_point(t, self.clock.now())
        seen.history.append(point)
        view = replica_view(t, 0.0, True)
        out.append(Update("replica", {"replica": view, "point": point}, Scope(cluster=True)))
        return out

    def expire(self) -> list[Update]:
        """Forget replicas silent for longer than `forget_replica_after_s`."""
        now_s = self.clock.monotonic()
        gone = [
            rid
            for rid, r in self._replicas.items()
            if now_s - r.received_s > self.limits.forget_replica_after_s
        ]
        for rid in gone:
            del self._replicas[rid]
        return [Update("replica_removed", {"id": rid}, Scope(cluster=True)) for rid in gone]

    def replicas_view(self) -> list[dict[str, Any]]:
        now_s = self.clock.monotonic()
        out = []
        for rid in sorted(self._replicas):
            r = self._replicas[rid]
            age_s = now_s - r.received_s
            view = replica_view(r.telemetry, age_s, self._fresh(r.telemetry, age_s))
            view["history"] = list(r.history)
            out.append(view)
        return out

    # --- coordinator ---------------------------------------------------------------------------------------
    def on_decisions(self, d: CoordinatorDecisions) -> list[Update]:
        changed = self._add_fast(d) if d.loop == "fast" else self._add_slow(d)
        return [self._coordinator_update()] if changed else []

    def on_coordinator_status(self, s: CoordinatorStatus) -> list[Update]:
        self._status = s
        if s.fast is not None:
            self._add_fast(s.fast)
        if s.slow is not None:
            self._add_slow(s.slow)
        return [self._coordinator_update()]

    def _add_fast(self, d: CoordinatorDecisions) -> bool:
        if self._fast is not None and d.ts_unix_s < self._fast.ts_unix_s:
            return False
        self._fast = d
        return True

    def _add_slow(self, d: CoordinatorDecisions) -> bool:
        """Keep the newest slow decisions, oldest first, each once."""
        if any(s.ts_unix_s == d.ts_unix_s for s in self._slow):
            return False
        if len(self._slow) == self._slow.maxlen and d.ts_unix_s < self._slow[0].ts_unix_s:
            return False
        merged = sorted([*self._slow, d], key=lambda s: s.ts_unix_s)
        self._slow = deque(merged, maxlen=self.limits.slow_decisions)
        return True

    def coordinator_view(self) -> dict[str, Any]:
        s = self._status
        policy = (self._fast.policy if self._fast else None) or (s.policy if s else None)
        return {
            "policy": policy,
            "fast": decisions_view(self._fast) if self._fast is not None else None,
            "slow": [decisions_view(d) for d in reversed(self._slow)],
            "status_unix_s": num(s.ts_unix_s, 3) if s else None,
            "plans": [plan_view(p) for p in s.rounds if not self._ended(p.round_id)] if s else [],
            "attainment": num(s.attainment) if s else None,
            "virtual_queue": num(s.virtual_queue) if s else None,
            "demand": num(s.demand) if s else None,
            "live": list(s.live) if s else [],
            "stale": list(s.stale) if s else [],
            "aggregator_available": s.aggregator_available if s else None,
            "notes": list(s.notes) if s else [],
        }

    def _ended(self, round_id: int | None) -> bool:
        """Whether a planned round is known to have ended (the coordinator's status may lag)."""
        o = self._rounds.get(round_id) if round_id is not None else None
        return o is not None and o.state in FINAL_ROUND_STATES

    def _coordinator_update(self) -> Update:
        return Update("coordinator", {"coordinator": self.coordinator_view()}, Scope(cluster=True))

    # --- rounds --------------------------------------------------------------------------------------------
    def _adapter_scope(self, adapter: str) -> Scope:
        info = self._adapters.get(adapter)
        if info is None:
            return Scope(adapter=adapter, owner_known=False)
        return Scope(adapter=adapter, owner=info.owner)

    def on_round(self, o: RoundOutcome) -> list[Update]:
        cur = self._rounds.get(o.round_id)
        if cur is not None and _round_key(o) < _round_key(cur):
            return []
        if cur is None and len(self._rounds) >= self.limits.rounds and o.round_id < min(self._rounds):
            return []
        self._rounds[o.round_id] = o
        while len(self._rounds) > self.limits.rounds:
            del self._rounds[min(self._rounds)]
        out = [Update("round", {"round": round_view(o)}, self._adapter_scope(o.adapter))]
        planned = self._status.rounds if self._status is not None else []
        if o.state in FINAL_ROUND_STATES and any(p.round_id == o.round_id for p in planned):
            out.append(self._coordinator_update())  # its plan leaves the coordinator's view
        return out

    def on_rounds(self, outcomes: Iterable[RoundOutcome]) -> list[Update]:
        out: list[Update] = []
        for o in sorted(outcomes, key=lambda x: x.round_id):
            out += self.on_round(o)
        return out

    # --- adapters ------------------------------------------------------------------------------------------
    def knows_adapter(self, name: str) -> bool:
        return name in self._adapters

    def adapter(self, name: str) -> AdapterInfo | None:
        return self._adapters.get(name)

    def on_adapter(self, info: AdapterInfo) -> list[Update]:
        newest = tuple(sorted(info.versions, key=lambda v: v.version)[-self.limits.versions_per_adapter :])
        info = AdapterInfo(info.name, info.owner, info.current, newest)
        old = self._adapters.get(info.name)
        if old == info:
            return []
        if old is None and len(self._adapters) >= self.limits.adapters:
            return []
        self._adapters[info.name] = info
        out: list[Update] = []
        if old is not None and old.owner != info.owner:
            out.append(
                Update("adapter_removed", {"name": info.name}, Scope(adapter=info.name, owner=old.owner))
            )
        scope = Scope(adapter=info.name, owner=info.owner)
        out.append(Update("adapter", {"adapter": adapter_view(info)}, scope))
        if old is None or old.owner != info.owner:
            for rid in sorted(self._rounds):
                o = self._rounds[rid]
                if o.adapter == info.name:
                    out.append(Update("round", {"round": round_view(o)}, scope))
        return out

    def remove_adapter(self, name: str) -> list[Update]:
        old = self._adapters.pop(name, None)
        if old is None:
            return []
        return [Update("adapter_removed", {"name": name}, Scope(adapter=name, owner=old.owner))]

    def on_adapters(self, infos: Sequence[AdapterInfo]) -> list[Update]:
        """A complete listing of the store: adapters not in it are removed."""
        listed = {i.name for i in infos}
        out: list[Update] = []
        for name in [n for n in self._adapters if n not in listed]:
            out += self.remove_adapter(name)
        for info in sorted(infos, key=lambda i: i.name):
            out += self.on_adapter(info)
        return out

    # --- the snapshot --------------------------------------------------------------------------------------
    def snapshot(self, viewer: Viewer) -> dict[str, Any]:
        adapters = [
            adapter_view(a) for name, a in sorted(self._adapters.items()) if viewer.sees_adapter(a.owner)
        ]
        rounds = []
        for rid in sorted(self._rounds, reverse=True):
            o = self._rounds[rid]
            scope = self._adapter_scope(o.adapter)
            if viewer.sees_adapter(scope.owner, scope.owner_known):
                rounds.append(round_view(o))
        return {
            "now_unix_s": num(self.clock.now(), 3),
            "access": viewer.as_json(),
            "limits": self.limits.as_json(),
            "replicas": self.replicas_view() if viewer.cluster else None,
            "coordinator": self.coordinator_view() if viewer.cluster else None,
            "rounds": rounds,
            "adapters": adapters,
        }


def _round_key(o: RoundOutcome) -> tuple[int, float]:
    """Later states win; within a state, the later message."""
    return (_ROUND_RANK.get(o.state, 4), o.ts_unix_s)
