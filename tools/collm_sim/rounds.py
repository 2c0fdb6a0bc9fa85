"""The simulated aggregator: federated rounds, their evaluations and the versions they publish.

A round opens from the coordinator's plan (refused unless its base version is current); its participants
train until they must send their updates, the aggregator's publish lead before the round's deadline
(`collm_aggregator.lead.PublishLead`: the adapter's recent close-to-publication times with headroom, at
most a quarter of the round), so that the rest of the round fits in it. A round closes when every
participant sent its update or at the deadline (aborted under quorum), and `publish_delay_s` after its
evaluators scored the candidate (or `eval_timeout_s` after it asked them) publishes the next version,
whose eval loss is the quality model's loss at the adapter's total trained tokens. The evaluators are the
participants and every replica holding the adapter's domain, as the aggregator picks them
(`choose_evaluators`); at the opening each scores the current version unless it already scored it (the
engine caches scores by weights), and after the close the candidate: work on the replica
(`SimReplica.add_eval`) when the calibration has the evaluation cost, else none. With async rounds the
adapter's next round opens beside the finishing one, skips the pre-scoring, and at its own close is
rebased onto the version published meanwhile (its evaluators score that version too unless they scored
it as the earlier round's candidate); it publishes after the adapter's earlier rounds ended. Rounds
aggregate by adding the accepted participants' tokens.

What the coordinator learns of rounds (`RoundEvent`s, and the adapters' versions when they changed) waits
in `events` and `version_views` for its next tick.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from collm_aggregator.lead import PublishLead
from collm_coordinator.core import AdapterVersionView, RoundEvent, RoundPlanDecision
from collm_sim.background import EvalTask, Job
from collm_sim.config import SimConfig
from collm_sim.events import DEADLINE, EVAL_TIMEOUT, PUBLISH, EventQueue
from collm_sim.plugins import choose_evaluators
from collm_sim.quality import QualityModel
from collm_sim.replica import SimReplica
from collm_workload.quality import QualityTable


@dataclass
class SimRound:
    round_id: int
    adapter: str
    base_version: int
    participants: tuple[str, ...]
    quorum: int
    deadline_s: float
    updates: dict[str, int] = field(default_factory=dict)
    closed: bool = False
    closed_s: float | None = None  # when the collection closed (every update in, or the deadline)
    state: str = "opened"
    evals_pending: int = 0  # evaluations of this round not reported yet
    scored_candidate: list[str] = field(default_factory=list)
    publishing: bool = False


class SimAggregator:
    """The rounds over `replicas`, timed through `queue`; `versions` (each adapter's current version,
    shared with the replicas) changes as rounds publish, and `trained_tokens` counts each adapter's
    published training tokens."""

    def __init__(
        self,
        cfg: SimConfig,
        quality: QualityModel,
        domains: tuple[str, ...],
        replicas: dict[str, SimReplica],
        versions: dict[str, int],
        queue: EventQueue,
    ) -> None:
        self.cfg = cfg
        self.quality = quality
        self.domains = domains
        self.replicas = replicas
        self.versions = versions
        self.queue = queue
        self.trained_tokens: dict[str, float] = dict.fromkeys(domains, 0.0)
        self.version_losses: dict[str, dict[str, float]] = {
            f"{d}@v1": {d: quality.loss(d, 0.0)} for d in domains
        }
        self.versions_changed = True  # since the coordinator's last tick
        self.events: list[RoundEvent] = []  # not told to the coordinator yet
        self.rounds: dict[int, SimRound] = {}
        self.lead = PublishLead(
            initial_s=cfg.publish_lead_initial_s,
            fixed_s=cfg.publish_lead_s,
            max_frac=cfg.publish_lead_max_frac,
        )
        self._round_seq = itertools.count(1)
        self.rounds_stats = {"opened": 0, "published": 0, "aborted": 0, "open_refused": 0}
        self.published_tokens = 0.0
        self.quality_timeline: list[tuple[float, dict[str, float]]] = [(0.0, self.gains())]
        # Versions each replica has scored (adapter, version): the engine's cache of evaluations.
        self._scored: dict[str, set[tuple[str, int]]] = {rid: set() for rid in sorted(replicas)}
        self.evals_modelled = any(r.eval_ms_each for r in replicas.values())

    def version_views(self) -> tuple[AdapterVersionView, ...]:
        """The adapters' current versions and their losses when they changed since the last call, else
        none."""
        if not self.versions_changed:
            return ()
        self.versions_changed = False
        losses = self.version_losses
        return tuple(AdapterVersionView(d, v, losses.get(f"{d}@v{v}", {})) for d, v in self.versions.items())

    def take_events(self) -> tuple[RoundEvent, ...]:
        """The round events since the last call."""
        events, self.events = tuple(self.events), []
        return events

    def on_job_done(self, rep: SimReplica, job: Job, now: float) -> None:
        rnd = self.rounds.get(job.round_id)
        if rnd is None or rnd.closed:
            return  # a late update: dropped, as the aggregator's default late policy does
        if job.tokens_done > 0:
            rnd.updates[rep.replica_id] = job.tokens_done
        if len(rnd.updates) == len(rnd.participants):
            self.close_round(rnd, now)

    def open_round(self, plan: RoundPlanDecision, t: float) -> None:
        current = self.versions.get(plan.adapter)
        if current is None or current != plan.base_version:
            self.rounds_stats["open_refused"] += 1
            self.events.append(RoundEvent(plan.adapter, "aborted", reason="base version is not current"))
            return
        rid = next(self._round_seq)
        parts = tuple(p.replica_id for p in plan.participants)
        rnd = SimRound(
            rid, plan.adapter, plan.base_version, parts, min(plan.quorum, len(parts)), plan.deadline_s
        )
        self.rounds[rid] = rnd
        self.rounds_stats["opened"] += 1
        self.events.append(RoundEvent(plan.adapter, "opened", round_id=rid, base_version=plan.base_version))
        # As the aggregator: participants send `lead` before the round's deadline, so that the rest of
        # the round (aggregate, evaluate, publish) fits in it; the collection still closes at the deadline.
        send_by_s = plan.deadline_s - self.lead.lead_s(plan.adapter, plan.deadline_s - t)
        for p in plan.participants:
            rep = self.replicas[p.replica_id]
            rep.start_job(plan.adapter, rid, plan.base_version, max(1, p.token_budget), send_by_s, t)
            self.queue.wake(rep, t)
        # As the aggregator: the current version is scored while participants train, unless an earlier
        # round of the adapter is still finishing (async rounds): this round is then rebased onto the
        # version that one publishes, whose evaluators score it as their candidate.
        if not any(
            r.adapter == rnd.adapter and r.state == "opened" and r.closed for r in self.rounds.values()
        ):
            for e in self._evaluators(rnd):
                if (rnd.adapter, rnd.base_version) not in self._scored[e]:
                    self._ask_eval(rnd, e, t, self._current_scored)
        self.queue.push(plan.deadline_s, DEADLINE, rnd)

    def _evaluators(self, rnd: SimRound) -> list[str]:
        if not self.evals_modelled:
            return []
        holders = [rid for rid, rep in self.replicas.items() if rep.domain == rnd.adapter]
        return sorted(choose_evaluators(rnd.participants, holders, self.cfg.eval_max_replicas))

    def _ask_eval(
        self, rnd: SimRound, rid: str, t: float, on_done: Callable[[SimReplica, EvalTask, float], None]
    ) -> None:
        rep = self.replicas[rid]
        ms = rep.eval_ms_each
        if not ms:
            return
        rnd.evals_pending += 1
        rep.add_eval(EvalTask(rnd.round_id, ms, t, t + self.cfg.eval_timeout_s, on_done))
        self.queue.wake(rep, t)

    def _current_scored(self, rep: SimReplica, task: EvalTask, t: float) -> None:
        rnd = self.rounds[task.round_id]
        self._scored[rep.replica_id].add((rnd.adapter, rnd.base_version))
        self._eval_reported(rnd, t)

    def _candidate_scored(self, rep: SimReplica, task: EvalTask, t: float) -> None:
        rnd = self.rounds[task.round_id]
        rnd.scored_candidate.append(rep.replica_id)
        self._eval_reported(rnd, t)

    def _eval_reported(self, rnd: SimRound, t: float) -> None:
        rnd.evals_pending -= 1
        if rnd.closed and rnd.state == "opened" and rnd.evals_pending <= 0:
            self.schedule_publish(rnd, t)

    def schedule_publish(self, rnd: SimRound, t: float) -> None:
        if rnd.publishing or rnd.state != "opened":
            return
        rnd.publishing = True
        self.queue.push(t + self.cfg.publish_delay_s, PUBLISH, rnd)

    def close_round(self, rnd: SimRound, t: float) -> None:
        rnd.closed = True
        rnd.closed_s = t
        # Participants still training at the deadline send what they have (their job stops at the margin).
        for rid in rnd.participants:
            rep = self.replicas[rid]
            job = rep.job
            if job is not None and job.round_id == rnd.round_id and job.active:
                rep.bg.finish_job(t, "stop")  # the round is closed: its callback records nothing
                if job.tokens_done > 0:
                    rnd.updates.setdefault(rid, job.tokens_done)
        if len(rnd.updates) < rnd.quorum:
            rnd.state = "aborted"
            self.rounds_stats["aborted"] += 1
            self.events.append(
                RoundEvent(rnd.adapter, "aborted", round_id=rnd.round_id, reason="quorum not reached")
            )
            return
        self.events.append(RoundEvent(rnd.adapter, "aggregating", round_id=rnd.round_id))
        current = self.versions[rnd.adapter]
        rebased = current != rnd.base_version
        # As the aggregator: a round opened while its adapter's previous round was finishing (async rounds)
        # is rebased onto the version that round published; its evaluators then score that version too.
        rnd.base_version = current
        evaluators = self._evaluators(rnd)
        for e in evaluators:
            if rebased and (rnd.adapter, current) not in self._scored[e]:
                self._ask_eval(rnd, e, t, self._current_scored)
            self._ask_eval(rnd, e, t, self._candidate_scored)
        if rnd.evals_pending <= 0:
            self.schedule_publish(rnd, t)
        else:  # the aggregator waits for the reports at most this long
            self.queue.push(t + self.cfg.eval_timeout_s, EVAL_TIMEOUT, rnd)

    def publish(self, rnd: SimRound, t: float) -> None:
        d = rnd.adapter
        if any(
            r.adapter == d and r.round_id < rnd.round_id and r.state == "opened" for r in self.rounds.values()
        ):
            # As the aggregator: a round publishes after its adapter's earlier rounds have ended.
            self.queue.push(t + 1.0, PUBLISH, rnd)
            return
        tokens = float(sum(rnd.updates.values()))
        before = self.quality.loss(d, self.trained_tokens[d])
        self.trained_tokens[d] += tokens
        after = self.quality.loss(d, self.trained_tokens[d])
        self.published_tokens += tokens
        self.versions[d] += 1
        v = self.versions[d]
        self.version_losses[f"{d}@v{v}"] = {d: after}
        for e in rnd.scored_candidate:  # the candidate they scored is this version
            self._scored[e].add((d, v))
        self.versions_changed = True
        rnd.state = "published"
        self.rounds_stats["published"] += 1
        if rnd.closed_s is not None:
            self.lead.observe(d, t - rnd.closed_s)
        self.events.append(
            RoundEvent(
                d,
                "published",
                round_id=rnd.round_id,
                base_version=rnd.base_version,
                new_version=v,
                accepted=tuple(sorted(rnd.updates)),
                eval_loss_before=before,
                eval_loss_after=after,
            )
        )
        self.quality_timeline.append((t, self.gains()))

    def gains(self) -> dict[str, float]:
        return {d: self.quality.gain(d, self.trained_tokens[d]) for d in self.domains}

    def quality_table(self) -> QualityTable:
        base = {d: self.quality.base_loss(d) for d in self.domains}
        return QualityTable(versions={k: dict(v) for k, v in self.version_losses.items()}, base=base)
