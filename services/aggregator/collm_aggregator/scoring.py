"""A round's federated evaluation: the candidate and the current version scored on the replicas.

The evaluators are the round's (`RoundDeps.eval_replicas`: the first holders of the adapter's domains by
name, so the same sites round after round) less any replica whose update the round refused. The current
version is scored while participants train (`score_current`, kept for the round); after the close each
evaluator scores only the candidate and the two are paired on the same eval set (equal digests), or,
when its held-out set changed or it was not pre-scored, it scores both together (`evaluate`). Each
request carries the deadline the replica paces its scoring to (`eval_timeout_s`); a replica that fails
is left out. A round rebased onto a newer version (async rounds, `rebase`) is judged against that one,
whose scores as the candidate of the round that published it stand for the pre-scores. A published
round's scores are recorded per site and chained into the version's comparable loss
(`record_round_quality`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from collm_aggregator import metrics
from collm_aggregator.evaluation import EvalSummary, LossEntry, ScoredDomain, pair_with_current, summarize
from collm_aggregator.machine import RoundMachine
from collm_aggregator.quality_ledger import SiteScore, chained
from collm_common import subjects
from collm_common.bus import BusError
from collm_common.store import AdapterStore
from collm_common.wire.rounds import EvalReport, EvaluateCandidate, RoundPlan

if TYPE_CHECKING:
    from collm_aggregator.runner import RoundDeps

log = logging.getLogger(__name__)


class CandidateScoring:
    """See module docstring. `deps`: the round's `RoundDeps`; `through_outage(what, step)`: the runner's
    wait for the store across an outage."""

    def __init__(
        self,
        deps: RoundDeps,
        plan: RoundPlan,
        machine: RoundMachine,
        through_outage: Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]],
    ) -> None:
        self.deps = deps
        self.plan = plan
        self.machine = machine
        self.through_outage = through_outage
        self.current: dict[str, EvalReport] = {}  # the pre-scored current version, by replica
        self.current_version = plan.base_version  # the version the candidate is judged against
        self._prescore: asyncio.Task[None] | None = None  # `score_current`, while it runs

    def rebase(self, version: int, reports: Sequence[EvalReport]) -> None:
        """Judge the candidate against `version` (the round was rebased onto it); `reports`: that version's
        scores as the candidate of the round that published it (each replica's candidate losses), which
        stand for its pre-scores on the same eval sets."""
        self.current_version = version
        self.current = {r.replica_id: r for r in reports}

    @property
    def round_id(self) -> int:
        return self.plan.round_id

    async def evaluators(self) -> list[str]:
        """The replicas that judge the candidate: the round's evaluators, less those whose update this
        round refused."""
        refused = {e.replica_id for e in self.machine.all_rejections}
        return await self.deps.eval_replicas(self.plan.adapter, self.machine.participants, refused)

    async def ask(self, rid: str, req: EvaluateCandidate) -> EvalReport | None:
        s = self.deps.settings
        # The replica paces its scoring to answer before this request times out.
        req = req.model_copy(update={"deadline_unix_s": self.deps.clock.now() + s.eval_timeout_s})
        try:
            return await self.deps.bus.request(
                subjects.replica(rid, "evaluate"), req, EvalReport, timeout_s=s.eval_timeout_s
            )
        except BusError as exc:
            log.warning("round %s: %s could not evaluate: %s", self.round_id, rid, exc.message)
            return None

    def start_prescore(self) -> None:
        """Start `score_current` beside the collection; `evaluate` awaits it."""
        self._prescore = asyncio.create_task(self.score_current())

    def stop_prescore(self) -> None:
        """Cancel the pre-scoring if it still runs and forget it: the round ended before its evaluation,
        or its scores no longer judge the candidate (`evaluate` then scores both versions)."""
        if self._prescore is not None:
            self._prescore.cancel()
            self._prescore = None

    async def score_current(self) -> None:
        """Score the current (base) version on every evaluator while participants train: it does not
        depend on the round's outcome, so it need not wait for the close (kept for this round)."""
        s = self.deps.settings
        req = EvaluateCandidate(
            adapter=self.plan.adapter,
            candidate_key="",
            candidate_sha256="",
            candidate_version=self.current_version,
            score_current=False,
            round_id=self.round_id,
            max_examples=s.eval_max_examples,
            max_tokens=s.eval_max_tokens,
        )

        async def one(rid: str) -> None:
            rep = await self.ask(rid, req)
            if rep is not None:
                self.current[rid] = rep

        try:
            await asyncio.gather(*(one(r) for r in await self.evaluators()))
        except Exception as exc:  # noqa: BLE001 - only an optimisation: the close scores both instead
            log.warning("round %s: pre-scoring the current version failed: %s", self.round_id, exc)

    def with_current(self, rid: str, cand: EvalReport) -> EvalReport | None:
        """`cand` (candidate only) completed with the pre-scored current losses of the same eval sets."""
        pre = self.current.get(rid)
        if pre is None:
            return None
        current = pair_with_current(
            [ScoredDomain(d.domain, d.eval_set, d.candidate_loss) for d in pre.losses],
            [ScoredDomain(d.domain, d.eval_set, d.candidate_loss) for d in cand.losses],
        )
        if current is None:
            return None
        # Same eval set (equal digests): the per-example losses are in the same order.
        pre_examples = {d.domain: d.candidate_example_loss for d in pre.losses}
        losses = [
            d.model_copy(
                update={"current_loss": current[d.domain], "current_example_loss": pre_examples[d.domain]}
            )
            for d in cand.losses
        ]
        return cand.model_copy(update={"losses": losses})

    async def evaluate(self, key: str, sha: str) -> EvalSummary:
        """The candidate under `key` (digest `sha`) scored against the current version on every evaluator,
        the reports saved on the round's record; the pre-scoring of the current version, if started, is
        awaited first (it normally finished while participants trained)."""
        s = self.deps.settings
        if self._prescore is not None:
            await self._prescore
        who = await self.evaluators()
        both = EvaluateCandidate(
            adapter=self.plan.adapter,
            candidate_key=key,
            candidate_sha256=sha,
            current_version=self.current_version,
            round_id=self.round_id,
            max_examples=s.eval_max_examples,
            max_tokens=s.eval_max_tokens,
        )
        only_candidate = both.model_copy(update={"score_current": False})

        t0 = time.perf_counter()
        took: dict[str, float] = {}

        async def ask(rid: str) -> EvalReport | None:
            try:
                if rid in self.current:
                    rep = await self.ask(rid, only_candidate)
                    if rep is None:
                        return None
                    paired = self.with_current(rid, rep)
                    if paired is not None:
                        return paired
                    log.info("round %s: %s's held-out set changed; scoring both versions", self.round_id, rid)
                return await self.ask(rid, both)
            finally:
                took[rid] = time.perf_counter() - t0

        reports = [r for r in await asyncio.gather(*(ask(r) for r in who)) if r is not None]
        log.info(
            "round %s: candidate scored in %.2f s (%s)", self.round_id, time.perf_counter() - t0,
            ", ".join(f"{r} {t:.2f} s" for r, t in sorted(took.items())),
        )  # fmt: skip
        await self.through_outage(
            "saving the evaluations", lambda: self.deps.records.save_evals(self.round_id, reports)
        )
        entries = [
            LossEntry(
                r.replica_id,
                d.domain,
                d.num_examples,
                d.current_loss,
                d.candidate_loss,
                tuple(d.example_tokens),
                tuple(d.candidate_example_loss),
                tuple(d.current_example_loss),
                tokens=d.num_tokens,
                eval_set=d.eval_set,
            )  # fmt: skip
            for r in reports
            for d in r.losses
        ]
        summary = summarize(entries)
        for which, v in (("before", summary.before), ("after", summary.after)):
            if v is not None and math.isfinite(v):
                metrics.EVAL_LOSS.labels(self.plan.adapter, which).set(v)
        return summary


async def record_round_quality(
    store: AdapterStore, adapter: str, version: int, parent: int | None, entries: Sequence[LossEntry]
) -> dict[str, float]:
    """Record a published round's scores per site for the new version and its parent, and the new
    version's comparable loss per domain chained onto the parent's (`quality_ledger.chained`; the
    parent's own first scores anchor it); returns the new version's."""
    after = [SiteScore(e.domain, e.replica_id, e.eval_set, e.candidate_loss, e.tokens, e.num_examples)
             for e in entries]  # fmt: skip
    before = [
        SiteScore(e.domain, e.replica_id, e.eval_set, e.current_loss, e.tokens, e.num_examples)
        for e in entries
        if e.current_loss is not None
    ]
    parent_quality = await store.quality(adapter, parent) if parent is not None else {}
    ch = chained(parent_quality, before, after)
    if parent is not None:
        await store.record_site_quality(adapter, parent, {s.key: s.to_json() for s in before})
        anchors = {d: v for d, v in ch.parent_quality.items() if d not in parent_quality}
        await store.record_quality(adapter, parent, anchors)
    await store.record_site_quality(adapter, version, {s.key: s.to_json() for s in after})
    await store.record_quality(adapter, version, ch.quality)
    if ch.restarted and parent_quality:
        log.info("%s@v%d: no site scored it and v%s both for %s; its quality restarts there",
                 adapter, version, parent, ", ".join(ch.restarted))  # fmt: skip
    return ch.quality
