"""The coordinator service: a thin shell that feeds the pure core and carries out its decisions.

* Collects `ReplicaTelemetry` (`subjects.telemetry_all()`) and round events (`subjects.round_events_all()`)
  into the inputs of the next tick; reads current adapter versions and their quality records from the
  adapter store every `coordinator_store_refresh_s` (optional: without Redis the versions replicas
  report are used).
* Calls `CoordinatorCore.on_tick(clock.now(), inputs)` when the core asks (`Decisions.next_tick_s`).
* Publishes `RoutingWeights` (`subjects.routing_weights()`, when the policy's decision says to publish
  them: always for `separate`, for `collm` with `coordinator_publish_weights`) and `CoordinatorDecisions`
  (`subjects.coordinator_decisions()`); sends `SetFineTuneShare` to each replica's control endpoint,
  concurrently, each with `coordinator_control_timeout_s`, from tasks the tick never awaits: a slow or
  dead replica cannot delay the tick, and a replica whose previous command has not answered is skipped
  (counted) rather than queued. A share is re-sent when it changes and every half TTL.
* Sends each planned round to the aggregator (`subjects.aggregator("open_round")`); the reply (or the
  failure: no aggregator, a refusal) goes back to the core as a round event at the next tick, so a
  missing aggregator never stops the fast loop, it only means rounds cannot open (logged, and shown by
  `status`). Each plan is a `round.plan` span (the root of its trace: adapter, base version,
  participants, budgets, expected gain, and the outcome of opening), the parent of the open_round
  request; the aggregator's round trace links to that request.
* NATS micro service `collm-coordinator`: `status` (last decisions, reasons, rounds in flight) and
  `policy` (read, or set at run time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Mapping
from typing import Any

from nats.aio.msg import Msg
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from collm_common import subjects, tracing
from collm_common.bus import Bus, BusError, MicroService, NoResponders, ServiceFailure
from collm_common.calibration import Calibration
from collm_common.clock import Clock
from collm_common.store import AdapterStore
from collm_common.wire.control import (
    ControlReply,
    CoordinatorStatus,
    CoordinatorStatusRequest,
    PolicyReply,
    RoutingWeights,
    SetFineTuneShare,
    SetPolicy,
    SyncAdapter,
)
from collm_common.wire.rounds import RoundOutcome
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_coordinator import convert, metrics
from collm_coordinator.core import (
    POLICIES,
    CoordinatorCore,
    Decisions,
    SentShare,
    TickInputs,
    share_command_due,
)
from collm_coordinator.core.types import (
    AdapterCreation,
    AdapterVersionView,
    ReplicaObservation,
    RoundEvent,
    RoundPlanDecision,
)
from collm_coordinator.priors import cost_prior, quality_prior
from collm_coordinator.settings import CoordinatorSettings

log = logging.getLogger(__name__)


def build_core(s: CoordinatorSettings) -> CoordinatorCore:
    """The core with its priors from the calibration file when one is configured."""
    if s.coordinator_calibration_path is not None:
        cal = Calibration.load(s.coordinator_calibration_path)
        cfg = s.core_config(
            cost_prior(cal, s.coordinator_train_micro_tokens),
            quality_prior(cal, s.coordinator_quality_token_scale),
        )
    else:
        cfg = s.core_config()
    return CoordinatorCore(cfg, s.coordinator_policy)


def plan_attributes(plan: RoundPlanDecision, policy: str) -> dict[str, str | int | float | tuple[str, ...]]:
    """Span attributes of a planned round (what the slow loop decided, and why)."""
    return {
        "collm.adapter": plan.adapter,
        "collm.base_version": plan.base_version,
        "collm.policy": policy,
        "collm.participants": tuple(p.replica_id for p in plan.participants),
        "collm.participant_count": len(plan.participants),
        "collm.quorum": plan.quorum,
        "collm.token_budget_tokens": sum(p.token_budget for p in plan.participants),
        "collm.expected_gain_nats": plan.expected_gain,
        "collm.round_deadline_s": plan.deadline_s - plan.opened_s,
        "collm.plan_reason": plan.reason[:500],
    }


class Coordinator:
    def __init__(
        self, settings: CoordinatorSettings, bus: Bus, clock: Clock, store: AdapterStore | None = None
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.clock = clock
        self.store = store
        self.core = build_core(settings)
        self._telemetry: list[ReplicaObservation] = []
        self._events: list[RoundEvent] = []
        self._versions: list[AdapterVersionView] = []
        self._share_tasks: dict[str, asyncio.Task[None]] = {}
        self._last_sent: dict[str, SentShare] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._bg: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self.routing: RoutingWeights | None = None
        self.aggregator_available: bool | None = None
        self.svc: MicroService | None = None
        metrics.POLICY.state(self.core.policy)

    # --- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.bus.subscribe(subjects.telemetry_all(), ReplicaTelemetry, self._on_telemetry)
        await self.bus.subscribe(subjects.round_events_all(), RoundOutcome, self._on_round_event)
        svc = await self.bus.service(
            subjects.SERVICE_COORDINATOR,
            self.settings.coordinator_micro_version,
            "CoLLM two-timescale coordinator: routing weights, fine-tuning shares, round plans",
            {"policy": self.core.policy},
        )
        await svc.endpoint("status", subjects.coordinator("status"), CoordinatorStatusRequest, self._status)
        await svc.endpoint("policy", subjects.coordinator("policy"), SetPolicy, self._policy)
        self.svc = svc
        self._bg.append(asyncio.create_task(self._tick_loop(), name="coordinator-tick"))
        if self.store is not None:
            self._bg.append(asyncio.create_task(self._store_loop(), name="coordinator-store"))
        log.info("coordinator started", extra={"policy": self.core.policy})

    async def stop(self) -> None:
        for t in [*self._bg, *self._tasks, *self._share_tasks.values()]:
            t.cancel()
        for t in [*self._bg, *self._tasks, *self._share_tasks.values()]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._bg.clear()

    # --- inputs ---------------------------------------------------------------------------------------
    async def _on_telemetry(self, t: ReplicaTelemetry, _msg: Msg) -> None:
        self._telemetry.append(convert.observation(t, self.clock.now()))

    async def _on_round_event(self, o: RoundOutcome, _msg: Msg) -> None:
        self._events.append(convert.round_event(o))

    async def _store_loop(self) -> None:
        assert self.store is not None
        warned = False
        while True:
            try:
                names = sorted(set(self.core.state.adapter_domains()) | set(self.core.state.rounds))
                found = []
                for name in names:
                    v = await self.store.current(name)
                    if v is None:
                        continue
                    losses = await self.store.quality(name, v)
                    found.append(AdapterVersionView(name, v, losses))
                self._versions.extend(found)
                warned = False
            except Exception as exc:  # Redis down: keep using the versions replicas report
                if not warned:
                    log.warning("cannot read adapter versions from the store: %s", exc)
                    warned = True
            await self.clock.sleep(self.settings.coordinator_store_refresh_s)

    # --- the tick -------------------------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        while True:
            next_s = self.clock.now() + self.settings.coordinator_fast_interval_s
            try:
                next_s = self.tick()
            except Exception:
                log.exception("coordinator tick failed")
            delay = max(0.0, next_s - self.clock.now())
            self._wake.clear()
            # A policy change wakes the loop early; otherwise sleep until the core's next tick.
            sleeper = asyncio.create_task(self.clock.sleep(delay))
            waker = asyncio.create_task(self._wake.wait())
            try:
                await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleeper.cancel()
                waker.cancel()

    def tick(self) -> float:
        """Run the core once on what arrived since the last tick and act on its decisions."""
        now = self.clock.now()
        inputs = TickInputs(tuple(self._telemetry), tuple(self._events), tuple(self._versions))
        self._telemetry, self._events, self._versions = [], [], []
        t0 = time.perf_counter()
        d = self.core.on_tick(now, inputs)
        metrics.TICK_SECONDS.observe(time.perf_counter() - t0)
        self._act(d)
        return d.next_tick_s

    def _act(self, d: Decisions) -> None:
        diag = d.diagnostics
        metrics.VIRTUAL_QUEUE.set(diag.virtual_queue)
        metrics.HEADROOM.set(diag.headroom)
        metrics.SPEND.set(diag.spend)
        metrics.DEMAND.set(diag.demand)
        metrics.LIVE.set(len(diag.live))
        metrics.STALE.set(len(diag.stale))
        if diag.attainment is not None:
            metrics.ATTAINMENT.set(diag.attainment)
        target = self.core.state.target
        metrics.TARGET.set(target.effective_target)
        if target.attainable is not None:
            metrics.ATTAINABLE.set(target.attainable)
        for note in diag.notes:
            log.info("coordinator: %s", note)
        for c in d.creates:
            self._spawn(self._create_adapter(c))
        if d.slow is not None:
            metrics.TICKS.labels("slow").inc()
            metrics.FORECAST.set(d.slow.forecast_demand)
            self._spawn(self.bus.publish(subjects.coordinator_decisions(), convert.slow_message(d, d.slow)))
            for s in d.slow.skipped:
                log.info("no round for %s: %s", s.adapter, s.reason)
            for plan in d.slow.plans:
                for p in plan.participants:
                    metrics.PLANNED_TOKENS.labels(plan.adapter).inc(p.token_budget)
                self._spawn(self._open_round(plan))
        if d.fast is None:
            return
        metrics.TICKS.labels("fast").inc()
        fast = d.fast
        if fast.routing is not None:
            for rid, w in fast.routing.weights.items():
                metrics.WEIGHT.labels(rid).set(w)
            if fast.routing.publish:
                self.routing = convert.routing_message(fast.routing, d.now_s, d.policy)
                self._spawn(self.bus.publish(subjects.routing_weights(), self.routing))
        self._spawn(self.bus.publish(subjects.coordinator_decisions(), convert.fast_message(d, fast)))
        for rid in diag.stale:
            metrics.REASON.labels(rid).state("stale")
            metrics.SHARE.labels(rid).set(0.0)
        for s in fast.shares:
            metrics.SHARE.labels(s.replica_id).set(s.share)
            metrics.REASON.labels(s.replica_id).state(s.reason_code)
            metrics.DECISIONS.labels(s.reason_code).inc()
            self._send_share(s.replica_id, s.share, s.spend, fast.share_ttl_s, s.reason, d.now_s)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- share commands -------------------------------------------------------------------------------
    def _send_share(
        self, rid: str, share: float, spend: float, ttl_s: float, reason: str, now_s: float
    ) -> None:
        if not share_command_due(self._last_sent.get(rid), share, spend, now_s, ttl_s):
            return
        running = self._share_tasks.get(rid)
        if running is not None and not running.done():
            metrics.CONTROL_SKIPPED.labels(rid).inc()
            return
        cmd = SetFineTuneShare(share=share, ttl_s=ttl_s, reason=reason[:200], spend=spend)
        self._share_tasks[rid] = asyncio.create_task(self._share_request(rid, cmd, now_s))

    async def _share_request(self, rid: str, cmd: SetFineTuneShare, now_s: float) -> None:
        try:
            reply = await self.bus.request(
                subjects.replica(rid, "control"),
                cmd,
                ControlReply,
                timeout_s=self.settings.coordinator_control_timeout_s,
            )
        except BusError as exc:
            metrics.CONTROL_FAILURES.labels(rid, str(exc.code)).inc()
            log.debug("share command to %s failed: %s", rid, exc.message)
            return
        if reply.ok:
            self._last_sent[rid] = SentShare(cmd.share, cmd.spend, now_s)
        else:
            metrics.CONTROL_FAILURES.labels(rid, "refused").inc()
            log.warning("replica %s refused its share: %s", rid, reply.message)

    # --- rounds ---------------------------------------------------------------------------------------
    async def _create_adapter(self, c: AdapterCreation) -> None:
        """Ask a replica holding the adapter's data to create its v1 (`SyncAdapter` with `create`)."""
        try:
            reply = await self.bus.request(
                subjects.replica(c.replica_id, "control"),
                SyncAdapter(adapter=c.adapter, create=True),
                ControlReply,
                timeout_s=self.settings.coordinator_open_round_timeout_s,
            )
        except BusError as exc:
            log.warning("could not have %s create %s: %s %s", c.replica_id, c.adapter, exc.code, exc.message)
            return
        log.info("asked %s to create %s: %s", c.replica_id, c.adapter, reply.message)

    async def _open_round(self, plan: RoundPlanDecision) -> None:
        with tracing.tracer("collm.coordinator").start_as_current_span(
            "round.plan", kind=SpanKind.INTERNAL, attributes=plan_attributes(plan, self.core.policy)
        ) as span:
            await self._request_round(plan, span)

    async def _request_round(self, plan: RoundPlanDecision, span: Span) -> None:
        msg = convert.round_plan_message(plan, self.core.policy)
        try:
            outcome = await self.bus.request(
                subjects.aggregator("open_round"),
                msg,
                RoundOutcome,
                timeout_s=self.settings.coordinator_open_round_timeout_s,
            )
        except NoResponders:
            if self.aggregator_available is not False:
                log.warning("no aggregator answers %s: rounds cannot open", subjects.aggregator("open_round"))
            self.aggregator_available = False
            metrics.ROUNDS.labels("no_aggregator").inc()
            span.set_status(Status(StatusCode.ERROR, "no aggregator"))
            self._events.append(RoundEvent(plan.adapter, "open_failed", reason="no aggregator"))
            return
        except BusError as exc:
            log.warning("aggregator refused the round of %s: %s %s", plan.adapter, exc.code, exc.message)
            metrics.ROUNDS.labels(f"refused_{exc.code}").inc()
            span.set_status(Status(StatusCode.ERROR, f"{exc.code} {exc.message}"))
            self._events.append(RoundEvent(plan.adapter, "open_failed", reason=exc.message))
            return
        self.aggregator_available = True
        metrics.ROUNDS.labels(outcome.state).inc()
        span.set_attributes({"collm.round_id": outcome.round_id, "collm.round_state": outcome.state})
        log.info(
            "round %d of %s: %s (%d participants)",
            outcome.round_id,
            plan.adapter,
            outcome.state,
            len(plan.participants),
        )
        self._events.append(convert.round_event(outcome))

    # --- endpoints ------------------------------------------------------------------------------------
    async def _status(self, _req: CoordinatorStatusRequest, _headers: Mapping[str, str]) -> CoordinatorStatus:
        core = self.core
        d = core.last
        fast = (
            convert.fast_message(d, core.last_fast) if d is not None and core.last_fast is not None else None
        )
        slow = (
            convert.slow_message(d, core.last_slow) if d is not None and core.last_slow is not None else None
        )
        return CoordinatorStatus(
            ts_unix_s=self.clock.now(),
            policy=core.policy,
            live=list(d.diagnostics.live) if d else [],
            stale=list(d.diagnostics.stale) if d else [],
            virtual_queue=core.state.target.virtual_queue,
            headroom=core.state.target.headroom,
            spend=core.state.target.spend,
            attainment=core.state.target.last_attainment,
            target=core.state.target.effective_target,
            attainable=core.state.target.attainable,
            demand=d.diagnostics.demand if d else 0.0,
            fast=fast,
            slow=slow,
            rounds=[
                convert.planned_round(r)
                for r in [*core.state.rounds.values(), *core.state.finishing.values()]
            ],
            routing=self.routing,
            aggregator_available=self.aggregator_available,
            notes=list(d.diagnostics.notes) if d else [],
        )

    async def _policy(self, req: SetPolicy, _headers: Mapping[str, str]) -> PolicyReply:
        previous = self.core.policy
        if req.policy is not None:
            if req.policy not in POLICIES:
                raise ServiceFailure(
                    400, f"unknown policy {req.policy!r}: choose one of {', '.join(POLICIES)}"
                )
            self.core.set_policy(req.policy)
            metrics.POLICY.state(req.policy)
            if req.policy != previous:
                log.info("policy changed from %s to %s", previous, req.policy)
                self._wake.set()
        return PolicyReply(policy=self.core.policy, previous=previous, policies=list(POLICIES))
