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

`RoundRunner` drives the steps, announces each and retries store steps across a Redis outage; the work of
each step is its collaborator's: `collection.UpdateCollection` (2), `aggregation.CandidateAggregation`
(3), `publication.RoundPublication` (storing the candidate, 4; publishing, 5) and
`scoring.CandidateScoring` (the evaluation, 4).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import redis.exceptions
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from collm_aggregator import metrics
from collm_aggregator.aggregation import CandidateAggregation
from collm_aggregator.collection import UpdateCollection
from collm_aggregator.evaluation import EvalSummary, GateRule
from collm_aggregator.machine import Close, Phase, RoundMachine, RoundRules
from collm_aggregator.publication import CANDIDATE_ID, RoundPublication
from collm_aggregator.scoring import CandidateScoring
from collm_aggregator.settings import AggregatorSettings
from collm_aggregator.strategies import Strategy
from collm_aggregator.validation import Rejection
from collm_common import subjects, tracing
from collm_common.bus import Bus
from collm_common.clock import Clock
from collm_common.store import AdapterStore
from collm_common.wire.admin import UpdateRecord
from collm_common.wire.rounds import RejectedUpdate, RoundOutcome, RoundPlan

from .lead import PublishLead
from .records import RoundRecords

log = logging.getLogger(__name__)
_blas_limited = False


def limit_blas_threads(threads: int | None) -> None:
    """Cap the BLAS threads of this process once (`AggregatorSettings.blas_threads`; None: leave them)."""
    global _blas_limited
    if threads is None or _blas_limited:
        return
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads, user_api="blas")
    _blas_limited = True


# Redis unreachable (down or restarting): a round step that needs the store waits for it (`_through_outage`).
STORE_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, ConnectionError)
T = TypeVar("T")


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
class RoundRunner:
    """One round from its plan to its final state (module docstring); `resumed_state`: the state the
    round's record holds when the service resumes it after a restart (None: a new round)."""

    deps: RoundDeps
    plan: RoundPlan
    resumed_state: str | None = None
    machine: RoundMachine = field(init=False)
    _collection: UpdateCollection = field(init=False)
    _scoring: CandidateScoring = field(init=False)
    _aggregation: CandidateAggregation = field(init=False)
    _publication: RoundPublication = field(init=False)
    _summary: EvalSummary | None = None
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
        deps, plan, m = self.deps, self.plan, self.machine
        self._collection = UpdateCollection(deps, plan, m)
        self._scoring = CandidateScoring(deps, plan, m, self._through_outage)
        self._aggregation = CandidateAggregation(deps, plan, m, self._scoring, self._through_outage)
        self._publication = RoundPublication(deps, plan, m, self._aggregation.product_error)
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
            new_version_quality=dict(self._publication.new_quality),
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
            self._scoring.stop_prescore()  # the round ended before its evaluation (aborted)
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
        m, clock, collection = self.machine, self.deps.clock, self._collection
        if not await collection.start():
            return
        closed_before = self.resumed_state in ("aggregating", "evaluating")
        with tracer.start_as_current_span("round.collect") as span:
            await self._announce()
            if self.resumed_state is not None:
                await collection.replay()
            if self.resumed_state in (None, "opened"):
                # New, or recorded but stopped before anyone was told: (re)start the participants.
                await collection.start_participants()
            # The current version is scored while participants train, unless an earlier round of the
            # adapter is still finishing: this one is then rebased onto what that one publishes, whose
            # scores as that round's candidate stand for the current version's (`aggregation.rebase`).
            if (
                not closed_before
                and self.deps.settings.eval_prescore_current
                and not self.deps.earlier_rounds(m.adapter, self.round_id)
            ):
                self._scoring.start_prescore()
            await collection.take_carried()
            decision = (
                Close("resumed after the collection had closed")
                if closed_before
                else await collection.wait_for_close()
            )
            span.set_attribute("collm.decision", type(decision).__name__)
            accepted = await collection.close(decision)
            if not accepted:
                return
            await self._announce()
        base, expected = collection.base, collection.expected
        assert base is not None and expected is not None
        with tracer.start_as_current_span("round.aggregate") as span:
            earlier = self.deps.earlier_rounds(m.adapter, self.round_id)
            if earlier:
                await asyncio.gather(*(r.ended.wait() for r in earlier))
            onto = await self._aggregation.rebase(expected.tensors)
            span.set_attribute("collm.base_version", m.base_version)
            updates = collection.weighted(accepted)
            blob = await self._aggregation.aggregate(updates, base, expected.tensors, onto)
            span.set_attribute("collm.updates", len(accepted))
        m.candidate_ready(clock.now())
        await self._announce()
        with tracer.start_as_current_span("round.evaluate"):
            key, sha = await self._through_outage(
                "storing the candidate", lambda: self._publication.store_candidate(blob)
            )
            self._summary = summary = await self._scoring.evaluate(key, sha)
        gate = m.decide(summary)
        if not gate.publish:
            m.held_back(clock.now())
            return
        with tracer.start_as_current_span("round.publish"):
            # Safe to repeat: the publication first recognises a version this round already made current.
            await self._through_outage(
                "publishing", lambda: self._publication.publish(blob, base.base_model, summary)
            )

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

    # --- updates ----------------------------------------------------------------------------------------
    async def deliver(self, rec: UpdateRecord) -> str:
        """An update durably recorded for this round: validate it and enter it in the machine.

        Returns "accepted", "rejected", "late" or "seen" (a redelivery already processed)."""
        return await self._collection.deliver(rec)

    def refuse(self, replica_id: str, rejection: Rejection) -> None:
        """Record an update refused before it reached `deliver` (e.g. subject and sender disagree)."""
        self._collection.refuse(replica_id, rejection)
