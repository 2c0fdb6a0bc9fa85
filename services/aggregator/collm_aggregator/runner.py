"""One round, driven end to end: the I/O shell around `RoundMachine`.

Timeline of a round (each step publishes `RoundOutcome` on `subjects.round_event(N, state)` and saves it):

1. **opened**: the plan is recorded in Redis (by the service, before the reply to `open_round`).
2. **collecting**: `StartTraining` goes to every participant; a participant that cannot be reached is
   recorded as rejected (`not_started`) so the round need not wait for it. Updates arrive from the
   service's JetStream consumer (already durably recorded) through `deliver`, are validated against the
   base version (decode, keys, shapes, spec, base model, finite, norm bound) and entered in the machine.
3. **aggregating**: when the machine closes (all heard / quorum+grace / deadline), the strategy runs in a
   worker thread on the accepted updates, weighted by samples (and staleness).
4. **evaluating**: the candidate blob is stored (`put_update(N, "_candidate")`), replicas holding eval
   data for the adapter's domains score it (`EvaluateCandidate` -> `EvalReport`), and the gate decides.
   The current version was already scored during collection (`eval_prescore_current`: asked at the
   opening, in parallel with training, kept for the round), so after the close replicas score only the
   candidate; a replica whose held-out set changed since (the eval-set digests differ), or that was not
   pre-scored, scores both versions together.
5. **published** (CAS from the base version; `AdapterPublished`; quality recorded) or **held_back**; any
   failure or a moved pointer ends in **aborted**. A candidate is published only from this step, so a
   half-aggregated version can never become current.

After a restart the service builds a fresh runner for every round not final, which replays the round's
recorded updates; a round that had closed skips straight to aggregation (deterministic, so the same
candidate), and a publication that already happened is recognised by the current version's round id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import redis.exceptions
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from collm_aggregator import metrics
from collm_aggregator.evaluation import (
    EvalSummary,
    GateRule,
)
from collm_aggregator.machine import (
    Abort,
    Admitted,
    Close,
    Entry,
    Late,
    Phase,
    RoundMachine,
    RoundRules,
)
from collm_aggregator.scoring import CandidateScoring, record_round_quality
from collm_aggregator.settings import AggregatorSettings
from collm_aggregator.strategies import Strategy, WeightedUpdate, product_error, rebase_aggregate
from collm_aggregator.validation import (
    DIGEST,
    MISSING_BLOB,
    SENDER_MISMATCH,
    UNDECODABLE,
    Expected,
    Rejection,
    check_tensors,
)
from collm_common import subjects, tracing
from collm_common.bus import Bus, BusError
from collm_common.clock import Clock
from collm_common.lora import AdapterWeights, decode_adapter, encode_adapter
from collm_common.store import AdapterStore, Conflict, CorruptBlob, NotFound, StoreError, version_id
from collm_common.wire.adapters import AdapterPublished
from collm_common.wire.admin import UpdateRecord
from collm_common.wire.control import ControlReply, StartTraining
from collm_common.wire.rounds import (
    EvalReport,
    RejectedUpdate,
    RoundOutcome,
    RoundPlan,
)

from .lead import PublishLead
from .records import RoundRecords

log = logging.getLogger(__name__)
CANDIDATE_ID = "_candidate"
_blas_limited = False


def limit_blas_threads(threads: int | None) -> None:
    """Cap the BLAS threads of this process once (`AggregatorSettings.blas_threads`; None: leave them)."""
    global _blas_limited
    if threads is None or _blas_limited:
        return
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads, user_api="blas")
    _blas_limited = True


NOT_STARTED = "not_started"
# Redis unreachable (down or restarting): a round step that needs the store waits for it (`_through_outage`).
STORE_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, ConnectionError)
T = TypeVar("T")


def to_numpy(weights: AdapterWeights) -> dict[str, np.ndarray]:
    return {k: v.detach().to("cpu").float().numpy() for k, v in weights.tensors.items()}


@dataclass
class RoundDeps:
    """What a runner needs from the service (injected, so tests can drive one round directly)."""

    bus: Bus
    store: AdapterStore
    records: RoundRecords
    settings: AggregatorSettings
    clock: Clock
    strategy: Strategy
    eval_replicas: Callable[[str, Sequence[str], Collection[str]], Awaitable[list[str]]]
    on_final: Callable[[int], None] = lambda _rid: None
    lead: PublishLead = field(default_factory=PublishLead)
    # The runners of the adapter's earlier rounds that have not ended (async rounds: the previous round
    # aggregates, evaluates and publishes while this one collects).
    earlier_rounds: Callable[[str, int], Sequence[RoundRunner]] = lambda _a, _rid: ()
    # Told of each publication (adapter, version, parent): the task-metric probe (`quality_probe`).
    published: Callable[[str, int, int | None], None] = lambda _a, _v, _p: None


@dataclass
class _Accepted:
    tensors: dict[str, np.ndarray]
    sha256: str


@dataclass
class RoundRunner:
    deps: RoundDeps
    plan: RoundPlan
    resumed_state: str | None = None
    machine: RoundMachine = field(init=False)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _tensors: dict[str, _Accepted] = field(default_factory=dict)
    _seen: dict[str, str] = field(default_factory=dict)
    _expected: Expected | None = None
    _new_quality: dict[str, float] = field(default_factory=dict)  # the published version's (store record)
    _older: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    _base: AdapterWeights | None = None
    _summary: EvalSummary | None = None
    _product_error: float | None = None
    _product_error_task: asyncio.Task[None] | None = None
    _scoring: CandidateScoring = field(init=False)
    _prescore: asyncio.Task[None] | None = None
    _root: trace.Span | None = None
    _link: Link | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set when `run` returns

    def __post_init__(self) -> None:
        s = self.deps.settings
        limit_blas_threads(s.blas_threads)
        rules = RoundRules(
            quorum=self.plan.quorum,
            deadline_unix_s=self.plan.deadline_unix_s,
            quorum_grace_s=s.quorum_grace_s,
            late_policy=s.late_policy,
            staleness_weight=s.staleness_weight,
            max_staleness=s.max_staleness,
            norm_outlier_factor=s.norm_outlier_factor,
            gate=GateRule(s.gate_min_gain_nats, s.gate_z, s.publish_without_eval),
        )
        self.machine = RoundMachine(
            self.plan.round_id,
            self.plan.adapter,
            self.plan.base_version,
            tuple(p.replica_id for p in self.plan.participants),
            rules,
            self.plan.opened_unix_s,
        )
        self._scoring = CandidateScoring(self.deps, self.plan, self.machine, self._through_outage)
        span_ctx = trace.get_current_span().get_span_context()
        self._link = Link(span_ctx) if span_ctx.is_valid else None

    @property
    def round_id(self) -> int:
        return self.plan.round_id

    # --- outcome ----------------------------------------------------------------------------------------
    def outcome(self) -> RoundOutcome:
        m = self.machine
        summary = self._summary
        rejected = [
            RejectedUpdate(replica_id=e.replica_id, reason=e.rejection.reason, code=e.rejection.code)
            for e in m.all_rejections
            if e.rejection is not None
        ]
        trace_id = None
        if self._root is not None and self._root.get_span_context().is_valid:
            trace_id = format(self._root.get_span_context().trace_id, "032x")
        paired = summary.paired if summary else None
        return RoundOutcome(
            round_id=m.round_id,
            adapter=m.adapter,
            state=m.phase.value,
            base_version=m.base_version,
            new_version=m.new_version,
            accepted=[e.replica_id for e in m.accepted] if m.phase is not Phase.COLLECTING else [],
            rejected=rejected,
            late=sorted(m.late),
            eval_loss_before=summary.before if summary else None,
            eval_loss_after=summary.after if summary else None,
            strategy=self.deps.strategy.name,
            reason=m.reason,
            ts_unix_s=self.deps.clock.now(),
            participants=list(m.participants),
            domain_losses_before=dict(summary.domains_before) if summary else {},
            domain_losses_after=dict(summary.domains_after) if summary else {},
            timeline=dict(m.timeline),
            deadline_unix_s=self.plan.deadline_unix_s,
            trace_id=trace_id,
            policy=self.plan.policy,
            gain_diff_nats=paired.diff_nats if paired is not None else None,
            gain_se_nats=paired.se_nats if paired is not None else None,
            gain_examples=paired.examples if paired is not None else 0,
            new_version_quality=dict(self._new_quality),
        )

    async def _announce(self) -> None:
        """Save the outcome and publish it on the round's event subject (best effort on the bus)."""
        out = self.outcome()
        await self._through_outage("saving the outcome", lambda: self.deps.records.save_outcome(out))
        try:
            await self.deps.bus.publish(subjects.round_event(self.round_id, out.state), out)
        except Exception as exc:  # the record in Redis is the source of truth; the event is a notification
            log.warning("round %s: could not publish %s event: %s", self.round_id, out.state, exc)

    # --- the round --------------------------------------------------------------------------------------
    async def run(self) -> None:
        tracer = tracing.tracer("collm.aggregator")
        self._root = tracer.start_span(
            "round",
            context=otel_context.Context(),  # one trace per round, linked to the plan's request
            kind=SpanKind.INTERNAL,
            links=[self._link] if self._link else None,
            attributes={"collm.round_id": self.round_id, "collm.adapter": self.plan.adapter},
        )
        ctx = trace.set_span_in_context(self._root)
        token = otel_context.attach(ctx)
        try:
            await self._run(tracer)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("round %s failed", self.round_id)
            self._root.record_exception(exc)
            if not self.machine.final:
                self.machine.abort(f"aggregator error: {type(exc).__name__}: {exc}", self.deps.clock.now())
        finally:
            otel_context.detach(token)
            if self._prescore is not None and not self._prescore.done():
                self._prescore.cancel()  # the round ended before its evaluation (aborted)
            if self.machine.final:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._finish())
            self._root.set_attribute("collm.round_state", self.machine.phase.value)
            if self.machine.phase is Phase.ABORTED:
                self._root.set_status(Status(StatusCode.ERROR, self.machine.reason))
            self._root.end()
            self.ended.set()

    async def _finish(self) -> None:
        m = self.machine
        # Counted before the announcement: whoever sees a round's final event sees it in the metrics too.
        metrics.ROUNDS.labels(m.adapter, m.phase.value).inc()
        for phase, nxt in zip(list(m.timeline), list(m.timeline)[1:], strict=False):
            metrics.PHASE_SECONDS.labels(phase).observe(max(0.0, m.timeline[nxt] - m.timeline[phase]))
        await self._announce()
        closed, ended = m.timeline.get(Phase.AGGREGATING.value), m.timeline.get(m.phase.value)
        if m.phase in (Phase.PUBLISHED, Phase.HELD_BACK) and closed is not None and ended is not None:
            self.deps.lead.observe(m.adapter, ended - closed)
        await self._drop_blobs()
        log.info(
            "round %s %s: %s", self.round_id, m.phase.value, m.reason,
            extra={"round_id": self.round_id, "adapter": m.adapter, "state": m.phase.value},
        )  # fmt: skip
        self.deps.on_final(self.round_id)

    async def _drop_blobs(self) -> None:
        """Delete the update and candidate blobs of the finished round (a published version has its own
        blob): at one blob per participant and round they would otherwise fill Redis until their TTL.
        Late updates stay: one may be carried into the adapter's next round. Best effort."""
        records = self.deps.records
        try:
            keys = [r.update.blob_key for r in await records.updates(self.round_id) if not r.late]
            cand = await records.candidate(self.round_id)
            keys += [cand[0]] if cand else []
            keys.append(self.deps.store.update_key(self.round_id, CANDIDATE_ID))
            await self.deps.store.delete_updates(keys)
        except Exception as exc:  # noqa: BLE001 - they expire with their TTL anyway
            log.warning("round %s: its update blobs were not deleted: %s", self.round_id, exc)

    async def _run(self, tracer: trace.Tracer) -> None:
        m = self.machine
        clock = self.deps.clock
        async with self._lock:
            m.start_collecting(clock.now())
        try:
            if not await self._load_base():
                return
        finally:
            self._ready.set()
        closed_before = self.resumed_state in ("aggregating", "evaluating")
        with tracer.start_as_current_span("round.collect") as span:
            await self._announce()
            if self.resumed_state is not None:
                for rec in await self.deps.records.updates(self.round_id):
                    if not rec.late:
                        await self.deliver(rec)
            if self.resumed_state in (None, "opened"):
                # New, or recorded but stopped before anyone was told: (re)start the participants.
                await self._start_participants()
            # The current version is scored while participants train, unless an earlier round of the
            # adapter is still finishing: this one is then rebased onto what that one publishes, whose
            # scores as that round's candidate stand for the current version's (`_rebase`).
            if (
                not closed_before
                and self.deps.settings.eval_prescore_current
                and not self.deps.earlier_rounds(m.adapter, self.round_id)
            ):
                self._prescore = asyncio.create_task(self._scoring.score_current())
            await self._take_carried()
            decision = (
                Close("resumed after the collection had closed") if closed_before else await self._collect()
            )
            span.set_attribute("collm.decision", type(decision).__name__)
            async with self._lock:
                if isinstance(decision, Abort):
                    m.abort(decision.reason, clock.now())
                    return
                accepted = m.close(clock.now())
            if not accepted:
                return
            await self._announce()
        with tracer.start_as_current_span("round.aggregate") as span:
            earlier = self.deps.earlier_rounds(m.adapter, self.round_id)
            if earlier:
                await asyncio.gather(*(r.ended.wait() for r in earlier))
            onto = await self._rebase()
            span.set_attribute("collm.base_version", m.base_version)
            blob = await self._aggregate(accepted, onto)
            span.set_attribute("collm.updates", len(accepted))
        m.candidate_ready(clock.now())
        await self._announce()
        with tracer.start_as_current_span("round.evaluate"):
            key, sha = await self._through_outage(
                "storing the candidate", lambda: self._store_candidate(blob)
            )
            self._summary = await self._scoring.evaluate(key, sha, self._prescore)
        assert self._summary is not None
        gate = m.decide(self._summary)
        if not gate.publish:
            m.held_back(clock.now())
            return
        with tracer.start_as_current_span("round.publish"):
            # Safe to repeat: `_publish` first recognises a version this round already made current.
            await self._through_outage("publishing", lambda: self._publish(blob))

    async def _through_outage(self, what: str, step: Callable[[], Awaitable[T]]) -> T:
        """Run a store step; while Redis is unreachable (a restart), retry it with backoff for up to
        `store_outage_s`, then let the error end the round (aborted). Only idempotent steps come here."""
        clock = self.deps.clock
        give_up_s = clock.monotonic() + self.deps.settings.store_outage_s
        delay_s = 0.1
        while True:
            try:
                return await step()
            except STORE_UNREACHABLE as exc:
                if clock.monotonic() + delay_s > give_up_s:
                    raise
                log.warning(
                    "round %s: adapter store unreachable while %s (%s); retrying", self.round_id, what, exc
                )
                await clock.sleep(delay_s)
                delay_s = min(2 * delay_s, 1.0)

    async def _load_base(self) -> bool:
        m, store, s = self.machine, self.deps.store, self.deps.settings
        try:
            rec = await store.get_version(m.adapter, m.base_version)
            base = decode_adapter(await store.get_blob(m.adapter, m.base_version))
        except (NotFound, CorruptBlob, ValueError) as exc:
            m.abort(
                f"base version {version_id(m.adapter, m.base_version)} is unusable: {exc}",
                self.deps.clock.now(),
            )
            return False
        self._base = base
        self._expected = Expected(
            tensors=to_numpy(base),
            spec_json=base.spec.to_json(),
            base_model=base.base_model or rec.base_model,
            max_delta_norm=s.max_delta_norm,
        )
        return True

    async def _start_participants(self) -> None:
        s = self.deps.settings
        deadline = self.plan.deadline_unix_s
        lead_s = self.deps.lead.lead_s(self.plan.adapter, deadline - self.machine.opened_unix_s)
        if lead_s > 0:
            log.info("round %s: participants send %.1f s before the deadline", self.round_id, lead_s)

        async def start(p: Any) -> None:
            cmd = StartTraining(
                adapter=self.plan.adapter,
                token_budget=p.token_budget,
                learning_rate=p.learning_rate,
                base_version=self.plan.base_version,
                round_id=self.round_id,
                deadline_unix_s=deadline - lead_s,  # the rest of the round: aggregate, evaluate, publish
            )
            subject = subjects.replica(p.replica_id, "control")
            try:
                reply = await self.deps.bus.request(subject, cmd, ControlReply, timeout_s=s.control_timeout_s)
                problem = None if reply.ok else f"refused StartTraining: {reply.message}"
            except BusError as exc:
                problem = f"StartTraining failed ({exc.code}): {exc.message}"
            if problem is not None:
                async with self._lock:
                    if p.replica_id not in self.machine.entries and self.machine.phase is Phase.COLLECTING:
                        self.machine.reject(
                            p.replica_id, Rejection(NOT_STARTED, problem), self.deps.clock.now()
                        )
                        metrics.REJECTED.labels(NOT_STARTED).inc()
                self._wake.set()

        await asyncio.gather(*(start(p) for p in self.plan.participants))

    async def _take_carried(self) -> None:
        if self.deps.settings.late_policy != "staleness":
            return
        for rec in await self.deps.records.take_carry(self.plan.adapter):
            u = rec.update
            verdict = self.machine._base_check(u.base_version)
            if not isinstance(verdict, Admitted):
                continue
            tensors, rejection, norm = await self._validate(rec)
            if rejection is not None:
                continue
            entry = Entry(
                u.replica_id,
                u.base_version,
                u.num_samples,
                rec.received_unix_s,
                delta_norm=norm,
                carried_from=u.round_id,
            )
            async with self._lock:
                if isinstance(self.machine.carry(entry), Admitted):
                    self._tensors[f"{u.replica_id}@r{u.round_id}"] = _Accepted(tensors, u.sha256)

    async def _collect(self) -> Close | Abort:
        clock = self.deps.clock
        while True:
            async with self._lock:
                decision = self.machine.poll(clock.now())
            if not isinstance(decision, Close | Abort):
                self._wake.clear()
                delay = max(0.0, decision.until_unix_s - clock.now())
                sleeper = asyncio.ensure_future(clock.sleep(delay))
                waker = asyncio.ensure_future(self._wake.wait())
                try:
                    await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    sleeper.cancel()
                    waker.cancel()
                continue
            return decision

    # --- updates ----------------------------------------------------------------------------------------
    async def deliver(self, rec: UpdateRecord) -> str:
        """An update durably recorded for this round: validate it and enter it in the machine.

        Returns "accepted", "rejected", "late" or "seen" (a redelivery already processed)."""
        u = rec.update
        await self._ready.wait()
        async with self._lock:
            if self._seen.get(u.replica_id) == u.sha256:
                return "seen"
            self._seen.setdefault(u.replica_id, u.sha256)
            m = self.machine
            verdict = m.admit(u.replica_id, u.adapter, u.base_version)
            now = self.deps.clock.now()
            if isinstance(verdict, Late):
                m.mark_late(u.replica_id, now)
                metrics.LATE.inc()
                metrics.UPDATES.labels("late").inc()
                return "late"
            if isinstance(verdict, Rejection):
                m.reject(u.replica_id, verdict, now, u.base_version)
                self._count_reject(verdict)
                self._wake.set()
                return "rejected"
            tensors, rejection, norm = await self._validate(rec)
            status = "rejected"
            now = self.deps.clock.now()
            if rejection is not None:
                m.reject(u.replica_id, rejection, now, u.base_version)
                self._count_reject(rejection)
            else:
                entry = m.record(
                    u.replica_id,
                    u.base_version,
                    u.num_samples,
                    now,
                    staleness=verdict.staleness,
                    delta_norm=norm,
                )
                if entry.rejection is None:
                    self._tensors[u.replica_id] = _Accepted(tensors, u.sha256)
                    metrics.UPDATES.labels("accepted").inc()
                    status = "accepted"
                else:
                    self._count_reject(entry.rejection)
            self._wake.set()
            return status

    def refuse(self, replica_id: str, rejection: Rejection) -> None:
        """Record an update refused before it reached `deliver` (e.g. subject and sender disagree)."""
        self.machine.reject(replica_id, rejection, self.deps.clock.now())
        self._count_reject(rejection)
        self._wake.set()  # a participant refused this way counts as heard from: the round may close

    @staticmethod
    def _count_reject(rejection: Rejection) -> None:
        metrics.REJECTED.labels(rejection.code).inc()
        metrics.UPDATES.labels("rejected").inc()

    async def _validate(self, rec: UpdateRecord) -> tuple[dict[str, np.ndarray], Rejection | None, float]:
        u = rec.update
        assert self._expected is not None
        try:
            blob = await self.deps.store.get_update(u.blob_key, u.sha256)
        except CorruptBlob as exc:
            return {}, Rejection(DIGEST, str(exc)), math.nan
        except (NotFound, StoreError) as exc:
            return {}, Rejection(MISSING_BLOB, str(exc)), math.nan
        if u.blob_key != self.deps.store.update_key(u.round_id, u.replica_id):
            return (
                {},
                Rejection(SENDER_MISMATCH, f"blob {u.blob_key} is not {u.replica_id}'s update key"),
                math.nan,
            )
        metrics.BYTES_RECEIVED.inc(len(blob))
        expected = self._expected
        if u.base_version != self.machine.base_version:
            # A stale update (late_policy=staleness): its change is measured from the version it was
            # trained from, so the norm checks judge the local training step, not how far behind it is.
            try:
                older = await self._older_base(u.base_version)
            except (NotFound, CorruptBlob, ValueError) as exc:
                return (
                    {},
                    Rejection(MISSING_BLOB, f"base version v{u.base_version} is unusable: {exc}"),
                    math.nan,
                )
            expected = Expected(older, expected.spec_json, expected.base_model, expected.max_delta_norm)

        def check() -> tuple[dict[str, np.ndarray], Rejection | None, float]:
            try:
                w = decode_adapter(blob)
                tensors = to_numpy(w)
            except Exception as exc:  # safetensors raises several types for garbage
                return (
                    {},
                    Rejection(UNDECODABLE, f"blob is not an adapter: {type(exc).__name__}: {exc}"),
                    math.nan,
                )
            rejection, norm = check_tensors(tensors, w.spec.to_json(), w.base_model, expected)
            return tensors, rejection, norm

        return await asyncio.to_thread(check)

    async def _rebase(self) -> dict[str, np.ndarray] | None:
        """Async rounds: if an earlier round published from this round's base while this one collected,
        this round is rebased onto that version: the machine's base moves to it (the updates count as
        that much staler), that round's candidate scores stand for the current version's, and the
        tensors of the version are returned for `_aggregate` to apply the candidate's change to
        (`strategies.rebase_aggregate`, times `rebase_scale`). Any other move of the pointer (a
        rollback, an import) is left to `_publish`, which then aborts; so is this round's own
        publication before a restart, which `_publish` recognises."""
        m, store = self.machine, self.deps.store
        assert self._expected is not None
        current = await self._through_outage("reading the current version", lambda: store.current(m.adapter))
        if current is None or current <= m.base_version:
            return None
        try:
            rec = await store.get_version(m.adapter, current)
            if rec.source != "round" or rec.parent != m.base_version or rec.round_id == self.round_id:
                return None
            newer = decode_adapter(await store.get_blob(m.adapter, current))
        except (NotFound, CorruptBlob, ValueError) as exc:
            log.warning("round %s: not rebased onto v%s: %s", self.round_id, current, exc)
            return None
        old, new = self._expected.tensors, to_numpy(newer)
        if new.keys() != old.keys() or any(new[k].shape != old[k].shape for k in new):
            log.warning("round %s: not rebased onto v%s: its tensors differ from v%s's", self.round_id,
                        current, m.base_version)  # fmt: skip
            return None
        log.info("round %s: rebased from v%s onto v%s (round %s)", self.round_id, m.base_version, current,
                 rec.round_id)  # fmt: skip
        m.rebase(current)
        if self._prescore is not None:  # the old base's scores no longer judge the candidate
            self._prescore.cancel()
            self._prescore = None
        reports: list[EvalReport] = []
        if rec.round_id is not None:
            with contextlib.suppress(Exception):
                reports = await self.deps.records.evals(rec.round_id)
        self._scoring.rebase(current, reports)
        metrics.REBASED.inc()
        return new

    async def _older_base(self, version: int) -> dict[str, np.ndarray]:
        if version not in self._older:
            blob = await self.deps.store.get_blob(self.plan.adapter, version)
            self._older[version] = to_numpy(decode_adapter(blob))
        return self._older[version]

    # --- aggregate, evaluate, publish ------------------------------------------------------------------
    async def _aggregate(self, accepted: Sequence[Entry], onto: dict[str, np.ndarray] | None = None) -> bytes:
        """The candidate blob: the strategy over the accepted updates from the round's base; with `onto`
        (the tensors of the version the round was rebased onto), its change applied to that version."""
        assert self._expected is not None and self._base is not None
        updates = [
            WeightedUpdate(
                e.replica_id,
                self._tensors[e.replica_id].tensors,
                e.weight(self.machine.rules.staleness_weight),
            )
            # In replica order, not arrival order: a round resumed after a restart replays its updates in
            # another order, and must compute the same candidate (float sums depend on the order).
            for e in sorted(accepted, key=lambda e: e.replica_id)
        ]
        base_np = self._expected.tensors
        strategy = self.deps.strategy
        t0 = time.perf_counter()
        agg = await asyncio.to_thread(strategy.aggregate, updates, base_np)
        agg_s = time.perf_counter() - t0
        metrics.AGGREGATION_SECONDS.labels(strategy.name).observe(agg_s)
        # A diagnostic of the aggregate, not needed to evaluate it: computed while replicas evaluate, off
        # the path from the close to the publication (awaited before publishing, for the version's meta).
        self._product_error_task = asyncio.create_task(self._measure_product_error(agg, updates, base_np))
        if onto is not None:
            scale = self.deps.settings.rebase_scale
            agg = await asyncio.to_thread(rebase_aggregate, agg, base_np, onto, scale, strategy.products)
        import torch

        weights = AdapterWeights(
            tensors={k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in agg.items()},
            spec=self._base.spec,
            base_model=self._base.base_model,
            extra={"collm.round_id": str(self.round_id), "collm.strategy": strategy.name},
        )
        blob = encode_adapter(weights)
        log.info(
            "round %s: %s of %d updates in %.2f s (%.2f s with encoding)",
            self.round_id, strategy.name, len(updates), agg_s, time.perf_counter() - t0,
        )  # fmt: skip
        return blob

    async def _measure_product_error(
        self, agg: dict[str, np.ndarray], updates: list[WeightedUpdate], base_np: dict[str, np.ndarray]
    ) -> None:
        try:
            err = await asyncio.to_thread(product_error, agg, updates, base_np, self.deps.strategy.server_lr)
        except Exception as exc:  # noqa: BLE001 - a diagnostic only
            log.warning("round %s: product error not measured: %s", self.round_id, exc)
            return
        self._product_error = err.get("rel_delta")
        if self._product_error is not None:
            metrics.PRODUCT_ERROR.labels(self.plan.adapter).set(self._product_error)

    async def _store_candidate(self, blob: bytes) -> tuple[str, str]:
        store, records = self.deps.store, self.deps.records
        known = await records.candidate(self.round_id)
        if known is not None:
            with contextlib.suppress(StoreError):
                await store.get_update(*known)
                return known
        try:
            key, sha = await store.put_update(
                self.round_id, CANDIDATE_ID, blob, ttl_s=self.deps.settings.update_ttl_s
            )
        except Conflict:
            # Written before a restart but not recorded: reuse it if it is byte-identical; else (another
            # process, other float rounding) store this one beside it: candidate blobs are write-once.
            key = store.update_key(self.round_id, CANDIDATE_ID)
            from collm_common.store import sha256_hex

            sha = sha256_hex(blob)
            try:
                await store.get_update(key, sha)
            except CorruptBlob:
                other = f"{CANDIDATE_ID}-{sha[:16]}"
                try:
                    key, sha = await store.put_update(
                        self.round_id, other, blob, ttl_s=self.deps.settings.update_ttl_s
                    )
                except Conflict:  # stored by an earlier restart: the name is its digest
                    key = store.update_key(self.round_id, other)
                    await store.get_update(key, sha)
        await records.save_candidate(self.round_id, key, sha)
        return key, sha

    async def _publish(self, blob: bytes) -> None:
        m, store = self.machine, self.deps.store
        now = self.deps.clock.now
        assert self._base is not None
        current = await store.current(m.adapter)
        if current != m.base_version:
            if current is not None:
                rec = await store.get_version(m.adapter, current)
                if rec.round_id == self.round_id and rec.source == "round":
                    m.published(current, now())  # published before a restart
                    return
            m.abort(
                f"{m.adapter} moved from v{m.base_version} to v{current} during the round; not published",
                now(),
            )
            return
        if self._product_error_task is not None:
            with contextlib.suppress(Exception):
                await self._product_error_task
        meta = {
            "strategy": self.deps.strategy.name,
            "accepted": ",".join(e.replica_id for e in m.accepted),
            "product_error_rel_delta": self._product_error,
        }
        try:
            rec = await store.publish(
                m.adapter,
                blob,
                expected_current=m.base_version,
                base_model=self._base.base_model,
                source="round",
                round_id=self.round_id,
                parent=m.base_version,
                meta=meta,
            )
        except Conflict as exc:
            m.abort(f"publication lost a compare-and-set: {exc}; not published", now())
            return
        m.published(rec.version, now())
        metrics.PUBLICATIONS.labels("round").inc()
        summary = self._summary
        if summary is not None:
            try:
                self._new_quality = await record_round_quality(
                    store, m.adapter, rec.version, m.base_version, summary.entries
                )
            except Exception as exc:  # noqa: BLE001 - the version is published; its record is best effort
                log.warning("round %s: quality of %s@v%d not recorded: %s", self.round_id, m.adapter,
                            rec.version, exc)  # fmt: skip
        self.deps.published(m.adapter, rec.version, m.base_version)
        event = AdapterPublished(
            name=m.adapter,
            version=rec.version,
            version_id=rec.id,
            sha256=rec.sha256,
            base_model=rec.base_model,
            source="round",
            round_id=self.round_id,
            created_unix_s=rec.created_unix_s,
        )
        await self.deps.bus.publish(subjects.adapter_published(m.adapter), event)
