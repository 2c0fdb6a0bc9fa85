"""Translations between v1 wire messages and the core's dataclasses (pure: no NATS, no clock).

The service and the simulator both feed the core through these, so a field the replica reports reaches
the algorithm the same way in both. Times: the service drives the core with Unix seconds, so the
core's deadlines are Unix times already.
"""

from __future__ import annotations

from collm_common.wire.control import (
    CoordinatorDecisions,
    PlannedParticipant,
    PlannedRound,
    ReplicaDecision,
    RoutingWeights,
)
from collm_common.wire.rounds import ParticipantPlan, RoundOutcome, RoundPlan
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_coordinator.core.state import ActiveRound
from collm_coordinator.core.types import (
    Decisions,
    FastDecision,
    ReplicaObservation,
    ResidentAdapterView,
    RoundEvent,
    RoundPlanDecision,
    RoutingDecision,
    SlowDecision,
    TrainingProgress,
)


def observation(t: ReplicaTelemetry, received_s: float) -> ReplicaObservation:
    """The core's view of one telemetry snapshot, stamped with when the driver received it."""
    return ReplicaObservation(
        replica_id=t.replica_id,
        received_s=received_s,
        ts_s=t.ts_unix_s,
        interval_s=t.interval_s,
        queue_len=t.queue_len,
        running=t.running,
        max_batch=max(1, t.max_batch),
        kv_used_frac=t.kv_used_frac,
        arrivals_per_s=t.arrivals_per_s,
        tokens_per_s=t.tokens_per_s,
        prefill_tokens_per_s=t.prefill_tokens_per_s,
        finished=t.finished,
        good=t.good,
        good_alone=t.good_alone,
        slo_attainment=t.slo_attainment,
        ttft_ms_p99=t.ttft_ms_p99,
        tpot_ms_p99=t.tpot_ms_p99,
        decode_step_ms=t.decode_step_ms,
        prefill_ms_per_token=t.prefill_ms_per_token,
        train_step_ms=t.train_step_ms,
        infer_busy_frac=t.infer_busy_frac,
        train_busy_frac=t.train_busy_frac,
        ft_share=t.ft_share,
        ft_tokens_per_s=t.ft_tokens_per_s,
        ft_loss=t.ft_loss,
        adapters=tuple(ResidentAdapterView(a.name, a.version, a.in_flight) for a in t.adapters),
        training=tuple(
            TrainingProgress(j.adapter, j.state, j.round_id, j.tokens_done, j.token_budget, j.eval_loss)
            for j in t.training_jobs
        ),
        round_role=t.round_role,
        round_id=t.round_id,
        local_samples=t.local_samples,
        domains=tuple(t.domains),
    )


def round_event(o: RoundOutcome) -> RoundEvent:
    return RoundEvent(
        adapter=o.adapter,
        state=o.state,
        round_id=o.round_id,
        base_version=o.base_version,
        new_version=o.new_version,
        accepted=tuple(o.accepted),
        eval_loss_before=o.eval_loss_before,
        eval_loss_after=o.eval_loss_after,
        reason=o.reason,
    )


def routing_message(r: RoutingDecision, now_s: float, policy: str) -> RoutingWeights:
    return RoutingWeights(
        ts_unix_s=now_s,
        ttl_s=r.ttl_s,
        weights=dict(r.weights),
        adapter_weights={a: dict(w) for a, w in r.adapter_weights.items()},
        policy=policy,
    )


def round_plan_message(p: RoundPlanDecision, policy: str) -> RoundPlan:
    """round_id=0: the aggregator assigns the id and answers `RoundOutcome(state="opened")`."""
    return RoundPlan(
        round_id=0,
        adapter=p.adapter,
        base_version=p.base_version,
        participants=[
            ParticipantPlan(
                replica_id=x.replica_id, token_budget=max(1, x.token_budget), learning_rate=p.learning_rate
            )
            for x in p.participants
        ],
        quorum=min(p.quorum, len(p.participants)),
        opened_unix_s=p.opened_s,
        deadline_unix_s=p.deadline_s,
        policy=policy,
        reason=p.reason[:1000],
    )


def fast_message(d: Decisions, fast: FastDecision) -> CoordinatorDecisions:
    weights = fast.routing.weights if fast.routing is not None else {}
    replicas = [
        ReplicaDecision(
            replica_id=s.replica_id,
            ft_share=s.share,
            routing_weight=float(weights.get(s.replica_id, 0.0)),
            reason=s.reason,
            reason_code=s.reason_code,
        )
        for s in fast.shares
    ]
    replicas += [
        ReplicaDecision(
            replica_id=r,
            ft_share=0.0,
            routing_weight=0.0,
            reason="no telemetry: routed around",
            reason_code="stale",
        )
        for r in d.diagnostics.stale
    ]
    return CoordinatorDecisions(
        ts_unix_s=d.now_s,
        policy=d.policy,
        loop="fast",
        replicas=replicas,
        virtual_queue=d.diagnostics.virtual_queue,
        note=fast.reason,
    )


def slow_message(d: Decisions, slow: SlowDecision) -> CoordinatorDecisions:
    replicas = [
        ReplicaDecision(
            replica_id=p.replica_id,
            ft_share=p.share,
            routing_weight=0.0,
            reason=f"{plan.adapter}: {p.token_budget} tokens; {p.reason}",
            reason_code="planned",
        )
        for plan in slow.plans
        for p in plan.participants
    ]
    skipped = "; ".join(f"{s.adapter}: {s.reason}" for s in slow.skipped)
    return CoordinatorDecisions(
        ts_unix_s=d.now_s,
        policy=d.policy,
        loop="slow",
        replicas=replicas,
        virtual_queue=slow.virtual_queue,
        note=(slow.reason + (f"; skipped {skipped}" if skipped else ""))[:2000],
    )


def planned_round(r: ActiveRound) -> PlannedRound:
    return PlannedRound(
        adapter=r.adapter,
        round_id=r.round_id,
        state=r.state,
        base_version=r.plan.base_version,
        deadline_unix_s=r.plan.deadline_s,
        expected_gain=r.plan.expected_gain,
        participants=[
            PlannedParticipant(
                replica_id=p.replica_id, token_budget=p.token_budget, share=p.share, reason=p.reason
            )
            for p in r.plan.participants
        ],
        reason=r.plan.reason[:1000],
    )
