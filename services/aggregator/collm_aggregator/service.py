"""The aggregator service: NATS endpoints, the durable update consumer, built-in plans, restarts.

* Micro service `collm-aggregator` with endpoints `open_round`, `status`, `rounds`, `round`, `rollback`,
  `import` on `subjects.aggregator(verb)` (schemas: `collm_common.wire.admin`, `wire.rounds`).
* A durable JetStream pull consumer (`consumer_name`) on `subjects.updates_all()` (`intake.UpdateIntake`):
  each `LocalUpdate` is recorded in Redis for its round and only then acknowledged, then handed to the
  round's runner.
* Telemetry from `subjects.telemetry_all()` tells which replicas are alive, hold local data and cover
  which domains (built-in plans and the choice of evaluators).
* At start, every round that was not final is resumed from its durable record (see `runner`).
* Its collaborators: `runner.RoundRunner` drives each round, `builtin.BuiltinPlans` opens rounds when no
  coordinator plans (`default_plan`), `imports.import_version` answers `import`, and
  `quality_probe.QualityProbe` scores published versions on their tasks.

Only one aggregator instance should run per Redis prefix: round ids come from one counter, but two
instances would both drive the same active rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import Collection, Coroutine, Mapping, Sequence
from typing import Any

from collm_aggregator import metrics
from collm_aggregator.builtin import BuiltinPlans
from collm_aggregator.imports import import_version
from collm_aggregator.intake import UpdateIntake
from collm_aggregator.lead import PublishLead
from collm_aggregator.machine import Phase
from collm_aggregator.planner import ReplicaView, choose_evaluators, eligible
from collm_aggregator.quality_probe import QualityProbe
from collm_aggregator.runner import RoundDeps, RoundRunner
from collm_aggregator.settings import AggregatorSettings
from collm_aggregator.strategies import make_strategy
from collm_common import subjects
from collm_common.bus import Bus, MicroService, ServiceFailure
from collm_common.clock import Clock
from collm_common.store import AdapterStore, Conflict, NotFound, StoreError, VersionRecord
from collm_common.streams import ensure_streams
from collm_common.wire.adapters import AdapterPublished
from collm_common.wire.admin import (
    ActiveRound,
    AdapterVersionInfo,
    AggregatorStatus,
    GetRound,
    ImportAdapter,
    ListRounds,
    RollbackAdapter,
    RoundDetail,
    RoundList,
    StatusRequest,
)
from collm_common.wire.control import CoordinatorDecisions
from collm_common.wire.rounds import RoundOutcome, RoundPlan
from collm_common.wire.telemetry import ReplicaTelemetry

from .records import RoundRecords

log = logging.getLogger(__name__)
VERSION = "0.1.0"


def version_info(rec: VersionRecord) -> AdapterVersionInfo:
    return AdapterVersionInfo(
        name=rec.name,
        version=rec.version,
        version_id=rec.id,
        sha256=rec.sha256,
        size_bytes=rec.size_bytes,
        base_model=rec.base_model,
        source=rec.source,
        parent=rec.parent,
        round_id=rec.round_id,
        created_unix_s=rec.created_unix_s,
    )


class Aggregator:
    def __init__(
        self,
        settings: AggregatorSettings,
        bus: Bus,
        store: AdapterStore,
        clock: Clock,
        instance_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.store = store
        self.clock = clock
        self.instance_id = instance_id or uuid.uuid4().hex[:8]
        self.records = RoundRecords(store.r, settings.redis_prefix, settings.rounds_kept)
        self.strategy = make_strategy(settings.strategy, settings.clip_norm, settings.server_lr)
        self.lead = PublishLead(
            initial_s=settings.publish_lead_initial_s,
            fixed_s=settings.publish_lead_s,
            max_frac=settings.publish_lead_max_frac,
        )
        self.started_unix_s = clock.now()
        self.runners: dict[int, RoundRunner] = {}
        self.replicas: dict[str, ReplicaView] = {}
        self.last_coordinator_plan_unix_s: float | None = None
        # When the coordinator last published a decision (it decides every fast tick, planning or not).
        self.last_coordinator_seen_unix_s: float | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._bg: list[asyncio.Task[None]] = []
        self._open_lock = asyncio.Lock()
        self.svc: MicroService | None = None
        self.intake = UpdateIntake(settings, bus, store, self.records, clock, self.runners)
        self.probe = QualityProbe(bus, store, settings, clock, self.eval_replicas, self._spawn_task)
        self.builtin = BuiltinPlans(
            settings, bus, store, clock, self.replicas, self.runners, self._coordinator_heard, self._open
        )

    # --- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        await ensure_streams(self.bus.js, self.settings.nats_stream_replicas)
        await self.bus.subscribe(subjects.telemetry_all(), ReplicaTelemetry, self._on_telemetry)
        await self.bus.subscribe(subjects.coordinator_decisions(), CoordinatorDecisions, self._on_decisions)
        await self._resume()
        svc = await self.bus.service(
            subjects.SERVICE_AGGREGATOR,
            VERSION,
            "CoLLM federated rounds: collect, validate, aggregate, evaluate, publish",
            {"instance_id": self.instance_id, "strategy": self.strategy.name},
        )
        self.svc = svc
        endpoints = (
            ("open_round", RoundPlan, self.open_round),
            ("status", StatusRequest, self.status),
            ("rounds", ListRounds, self.list_rounds),
            ("round", GetRound, self.show_round),
            ("rollback", RollbackAdapter, self.rollback),
            ("import", ImportAdapter, self.import_adapter),
        )
        for name, req_type, handler in endpoints:
            await svc.endpoint(name, subjects.aggregator(name), req_type, handler)
        self._bg.append(asyncio.create_task(self.intake.run(), name="aggregator-consumer"))
        if self.settings.default_plan:
            self._bg.append(asyncio.create_task(self.builtin.run(), name="aggregator-planner"))

    async def stop(self) -> None:
        for t in [*self._bg, *self._tasks]:
            t.cancel()
        for t in [*self._bg, *self._tasks]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._bg.clear()
        self._tasks.clear()
        await self.intake.close()

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _spawn(self, runner: RoundRunner) -> None:
        self.runners[runner.round_id] = runner
        metrics.ACTIVE_ROUNDS.set(len(self.runners))
        task = asyncio.create_task(runner.run(), name=f"round-{runner.round_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _round_done(self, round_id: int) -> None:
        self.runners.pop(round_id, None)
        metrics.ACTIVE_ROUNDS.set(len(self.runners))

    def _deps(self) -> RoundDeps:
        return RoundDeps(
            bus=self.bus,
            store=self.store,
            records=self.records,
            settings=self.settings,
            clock=self.clock,
            strategy=self.strategy,
            eval_replicas=self.eval_replicas,
            on_final=self._round_done,
            lead=self.lead,
            earlier_rounds=self._earlier_rounds,
            published=self.probe.published,
        )

    def _earlier_rounds(self, adapter: str, round_id: int) -> list[RoundRunner]:
        return [
            r
            for r in self.runners.values()
            if r.plan.adapter == adapter and r.round_id < round_id and not r.ended.is_set()
        ]

    async def _resume(self) -> None:
        for rid in await self.records.active_ids():
            plan = await self.records.plan(rid)
            outcome = await self.records.outcome(rid)
            if plan is None or outcome is None:
                continue
            log.info("resuming round %s (%s) from its durable record", rid, outcome.state)
            self._spawn(RoundRunner(self._deps(), plan, resumed_state=outcome.state))

    # --- telemetry and domains --------------------------------------------------------------------------
    async def _on_decisions(self, _d: CoordinatorDecisions, _msg: object) -> None:
        self.last_coordinator_seen_unix_s = self.clock.now()

    def _coordinator_heard(self) -> float:
        """When a coordinator last planned or decided; this service's start if never (`BuiltinPlans`)."""
        seen = [t for t in (self.last_coordinator_plan_unix_s, self.last_coordinator_seen_unix_s) if t]
        return max(seen, default=self.started_unix_s)

    async def _on_telemetry(self, t: ReplicaTelemetry, _msg: object) -> None:
        # Receive time, not the replica's clock: staleness must not depend on clock skew.
        self.replicas[t.replica_id] = ReplicaView(
            t.replica_id, self.clock.now(), t.local_samples, tuple(t.domains)
        )

    async def adapter_domains(self, adapter: str) -> list[str]:
        if adapter in self.settings.default_plan_adapters:
            return list(self.settings.default_plan_adapters[adapter])
        with contextlib.suppress(StoreError):
            meta = await self.store.meta(adapter)
            return [d for d in meta.get("domains", "").split(",") if d]
        return []

    async def eval_replicas(
        self, adapter: str, participants: Sequence[str], exclude: Collection[str] = ()
    ) -> list[str]:
        """Live replicas with local data for the adapter's domains and the participants, none of `exclude`,
        at most `eval_max_replicas` (`choose_evaluators`)."""
        domains = await self.adapter_domains(adapter)
        live = eligible(
            list(self.replicas.values()), domains, self.clock.now(), self.settings.telemetry_stale_s
        )
        return sorted(choose_evaluators(participants, live, self.settings.eval_max_replicas, exclude))

    # --- opening rounds ----------------------------------------------------------------------------------
    async def open_round(self, plan: RoundPlan, _headers: Mapping[str, str]) -> RoundOutcome:
        """Coordinator plans (policy != "builtin"); replies as soon as the round is recorded."""
        if plan.policy != "builtin":
            self.last_coordinator_plan_unix_s = self.clock.now()
        return await self._open(plan)

    async def _open(self, plan: RoundPlan) -> RoundOutcome:
        try:
            subjects.check_token(plan.adapter, "adapter name")
            for p in plan.participants:
                subjects.check_token(p.replica_id, "replica id")
        except ValueError as exc:
            raise ServiceFailure(400, str(exc)) from None
        ids = [p.replica_id for p in plan.participants]
        if len(set(ids)) != len(ids):
            raise ServiceFailure(400, f"participants repeat a replica: {ids}")
        if plan.quorum > len(ids):
            raise ServiceFailure(400, f"quorum {plan.quorum} exceeds the {len(ids)} participants")
        now = self.clock.now()
        if not math.isfinite(plan.deadline_unix_s) or plan.deadline_unix_s <= now:
            raise ServiceFailure(400, f"deadline {plan.deadline_unix_s} is not in the future (now {now:.3f})")
        async with self._open_lock:
            # Only a round still collecting holds its adapter: one that closed its collection aggregates,
            # evaluates and publishes beside the next (async rounds; that one is rebased onto what this
            # one publishes), and one that announced its end may still be cleaning up.
            running = [
                r
                for r in self.runners.values()
                if r.plan.adapter == plan.adapter and r.machine.phase in (Phase.OPENED, Phase.COLLECTING)
            ]
            for r in running:
                if r.plan.policy == "builtin" and plan.policy != "builtin":
                    await self._supersede(r)
                else:
                    raise ServiceFailure(
                        409, f"round {r.round_id} of adapter {plan.adapter!r} is still running"
                    )
            if plan.round_id == 0:
                round_id = await self.records.next_round_id()
            else:
                if await self.records.exists(plan.round_id):
                    raise ServiceFailure(409, f"round {plan.round_id} already exists")
                await self.records.reserve_round_id(plan.round_id)
                round_id = plan.round_id
            plan = plan.model_copy(update={"round_id": round_id, "opened_unix_s": now})
            current = await self.store.current(plan.adapter)
            reason = ""
            if current is None:
                reason = (
                    f"adapter {plan.adapter!r} has no current version yet (replicas create v1); round skipped"
                )
            elif current != plan.base_version:
                reason = (
                    f"plan is based on v{plan.base_version}, {plan.adapter} is at v{current}; round skipped"
                )
            state = "aborted" if reason else "opened"
            outcome = RoundOutcome(
                round_id=round_id,
                adapter=plan.adapter,
                state=state,
                base_version=plan.base_version,
                strategy=self.strategy.name,
                reason=reason or plan.reason,
                ts_unix_s=now,
                participants=ids,
                timeline={"opened": now, **({"aborted": now} if reason else {})},
                deadline_unix_s=plan.deadline_unix_s,
                policy=plan.policy,
            )
            if not await self.records.create(plan, outcome):
                raise ServiceFailure(409, f"round {round_id} already exists")
            metrics.ROUNDS_OPENED.labels(plan.policy).inc()
            if reason:  # counted before the event, as a runner's final state (RoundRunner._finish)
                metrics.ROUNDS.labels(plan.adapter, "aborted").inc()
            with contextlib.suppress(Exception):
                await self.bus.publish(subjects.round_event(round_id, state), outcome)
            if reason:
                log.info("round %s aborted at open: %s", round_id, reason)
                return outcome
            self._spawn(RoundRunner(self._deps(), plan))
            log.info("round %s opened for %s@v%s with %s", round_id, plan.adapter, plan.base_version, ids)
            return outcome

    async def _supersede(self, runner: RoundRunner) -> None:
        task = next((t for t in self._tasks if t.get_name() == f"round-{runner.round_id}"), None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if not runner.machine.final:
            runner.machine.abort("superseded by a coordinator plan", self.clock.now())
            await runner._finish()
        self._round_done(runner.round_id)

    # --- admin endpoints ------------------------------------------------------------------------------------
    async def status(self, _req: StatusRequest, _headers: Mapping[str, str]) -> AggregatorStatus:
        active = []
        for r in sorted(self.runners.values(), key=lambda r: r.round_id):
            m = r.machine
            active.append(
                ActiveRound(
                    round_id=r.round_id,
                    adapter=m.adapter,
                    state=m.phase.value,
                    base_version=m.base_version,
                    participants=list(m.participants),
                    received=sorted(m.entries),
                    quorum=m.rules.quorum,
                    deadline_unix_s=m.rules.deadline_unix_s,
                    policy=r.plan.policy,
                )
            )
        return AggregatorStatus(
            instance_id=self.instance_id,
            started_unix_s=self.started_unix_s,
            strategy=self.strategy.name,
            late_policy=self.settings.late_policy,
            default_plan=self.settings.default_plan,
            last_coordinator_plan_unix_s=self.last_coordinator_plan_unix_s,
            active=active,
            last_round_id=await self.records.last_round_id(),
            rounds_by_state=await self.records.count_by_state(),
        )

    async def list_rounds(self, req: ListRounds, _headers: Mapping[str, str]) -> RoundList:
        return RoundList(rounds=await self.records.list_outcomes(req.adapter, req.state, req.limit))

    async def show_round(self, req: GetRound, _headers: Mapping[str, str]) -> RoundDetail:
        plan = await self.records.plan(req.round_id)
        if plan is None:
            raise ServiceFailure(404, f"round {req.round_id} is not on record")
        runner = self.runners.get(req.round_id)
        outcome = runner.outcome() if runner is not None else await self.records.outcome(req.round_id)
        assert outcome is not None
        cand = await self.records.candidate(req.round_id)
        return RoundDetail(
            plan=plan,
            outcome=outcome,
            updates=await self.records.updates(req.round_id),
            evals=await self.records.evals(req.round_id),
            candidate_key=cand[0] if cand else None,
            candidate_sha256=cand[1] if cand else None,
        )

    async def _announce_version(self, rec: VersionRecord, source: str) -> None:
        metrics.PUBLICATIONS.labels(source).inc()
        await self.bus.publish(
            subjects.adapter_published(rec.name),
            AdapterPublished(
                name=rec.name,
                version=rec.version,
                version_id=rec.id,
                sha256=rec.sha256,
                base_model=rec.base_model,
                source=source,  # type: ignore[arg-type]
                round_id=rec.round_id,
                created_unix_s=rec.created_unix_s,
            ),
        )

    async def rollback(self, req: RollbackAdapter, _headers: Mapping[str, str]) -> AdapterVersionInfo:
        try:
            subjects.check_token(req.adapter, "adapter name")
            rec = await self.store.rollback(req.adapter, req.to_version)
        except ValueError as exc:
            raise ServiceFailure(400, str(exc)) from None
        except NotFound as exc:
            raise ServiceFailure(404, str(exc)) from None
        except Conflict as exc:
            raise ServiceFailure(409, f"{exc}; retry the rollback") from None
        log.info(
            "rolled %s back to the content of v%s as %s (%s)", req.adapter, req.to_version, rec.id, req.reason
        )
        await self._announce_version(rec, "rollback")
        return version_info(rec)

    async def import_adapter(self, req: ImportAdapter, _headers: Mapping[str, str]) -> AdapterVersionInfo:
        """A PEFT directory as the next version of `req.adapter` (checks and statuses:
        `collm_aggregator.imports`)."""
        rec = await import_version(self.store, self.settings, req)
        await self._announce_version(rec, "import")
        return version_info(rec)
