"""The discrete-event cluster simulation: arrivals, replica iterations, telemetry, coordinator ticks, rounds.

Time is virtual: nothing sleeps, events are taken in time order from one heap (ties in insertion
order), and every random draw comes from generators seeded by `SimConfig.seed`, so a configuration
gives the same result on every run.

Events and what they do:

* arrival (from the workload, merged with the heap): the gateway routing policy ranks the replicas from
  their latest telemetry, this gateway's own in-flight counts and the coordinator's latest weights; the
  request joins the first ranked replica's queue, or the next one's when that queue is full (at most
  `max_retries` more), or is rejected;
* replica iteration end: the replica emits tokens, then starts its next iteration (or goes idle until a
  request, a job or a share wakes it); a run of identical decode iterations is one event (see
  `collm_sim.replica`), with the same results as one event per iteration;
* telemetry (every `telemetry_interval_s`): every replica's snapshot reaches the gateway and the
  coordinator;
* coordinator tick (when the core asks): `CoordinatorCore.on_tick`; weights go to the gateway, shares
  to the replicas (with their TTL) when the coordinator service would send them (`share_command_due`:
  changed, or half their TTL old; a share reaching a busy replica ends its training stretch at the next
  piece, as a command does on the engine), round plans to the simulated aggregator;
* round deadline / publication: participants send their updates the aggregator's publish lead before
  the round's deadline (`collm_aggregator.lead.PublishLead`: the adapter's recent close-to-publication
  times with headroom, at most a quarter of the round), so that the rest of the round fits in it; the
  aggregator closes a round when every participant sent its update
  or at the deadline (aborted under quorum), and `publish_delay_s` after its evaluators scored the
  candidate (or `eval_timeout_s` after it asked them) publishes the next version, whose eval loss is
  the quality model's loss at the adapter's total trained tokens. The evaluators are the participants
  and every replica holding the adapter's domain, as the aggregator picks them; at the opening each
  scores the current version unless it already scored it (the engine caches scores by weights), and
  after the close the candidate: work on the replica (`SimReplica.add_eval`) when the calibration has
  the evaluation cost, else none. The close is an `aggregating` event to the coordinator; with async
  rounds (the core's `rounds`) the adapter's next round then opens beside the finishing one, skips the
  pre-scoring, and at its own close is rebased onto the version published meanwhile (its evaluators
  score that version too unless they scored it as the earlier round's candidate); it publishes after
  the adapter's earlier rounds ended.

The `separate` baseline is a serving cluster beside a training cluster: by default (`separate_routing=
"serving_cluster"`) its requests are routed by the gateway's least-loaded rule over the serving replicas
only, as that cluster's own gateway would; `"weights"` instead feeds the coordinator's weights to the
shared gateway's weighted draw. `router="mask"` applies the same rule to every policy's published
weights (a what-if for a gateway that treats weights as an eligibility mask; the shipped gateway draws).

Simplifications, stated: control messages and weights arrive at once (the bus adds milliseconds);
every replica holds every domain's adapter resident (no adapter loading cost); a published version is
served by every replica at once (the live rollout is measured separately); replica-local refreshes of
an adapter (served before the round publishes) are not modelled, so served quality moves only at
publication; rounds aggregate by adding the accepted participants' tokens (a rebased round's too: the
live stack's quality per token with async rounds is measured, `bench/README.md`, Frontier).
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from collm_aggregator.lead import PublishLead
from collm_bench.goodput import summarize
from collm_bench.quality import QualityTable
from collm_bench.records import RequestRecord
from collm_common.calibration import Calibration
from collm_coordinator import convert
from collm_coordinator.core import (
    AdapterVersionView,
    RoundEvent,
    RoundPlanDecision,
    SentShare,
    TickInputs,
    share_command_due,
)
from collm_coordinator.core.types import ReplicaObservation
from collm_coordinator.priors import cost_prior, quality_prior
from collm_sim.background import EvalTask, Job
from collm_sim.config import SimConfig
from collm_sim.plugins import (
    COSCHEDULER_FOR_POLICY,
    CoordinatorCore,
    CoreConfig,
    ReplicaSnapshot,
    RoutingConfig,
    WeightsSnapshot,
    choose_evaluators,
    make_coscheduler,
    rank_replicas,
)
from collm_sim.quality import QualityModel
from collm_sim.replica import Req, SimReplica
from collm_sim.workload import Workload, build_workload

_ITER, _TELEMETRY, _TICK, _DEADLINE, _PUBLISH, _EVAL_TIMEOUT = range(6)

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


# Collector thresholds during a run (`rare_collections`): a young-generation pass every this many
# allocations, the older generations as rarely.
_GC_THRESHOLDS = (50_000, 50, 100)


@contextmanager
def rare_collections() -> Iterator[None]:
    """Python's cyclic garbage collector runs rarely while the block runs (thresholds at least
    `_GC_THRESHOLDS`), as before after it. A run allocates millions of short-lived objects, few of them
    in reference cycles, while what it keeps (requests, step records) grows: at the default thresholds
    the collector's passes over that heap take about a tenth of a large run. What it computes does not
    depend on when garbage is collected."""
    before = gc.get_threshold()
    gc.set_threshold(*(max(a, b) for a, b in zip(before, _GC_THRESHOLDS, strict=False)))
    try:
        yield
    finally:
        gc.set_threshold(*before)


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


@dataclass
class SimResult:
    config: SimConfig
    summary: dict[str, Any]
    sim: dict[str, Any]
    records: list[RequestRecord]

    def as_dict(self) -> dict[str, Any]:
        return {"summary": self.summary, "sim": self.sim}


class Simulation:
    def __init__(self, cfg: SimConfig, calibration: Calibration, workload: Workload | None = None) -> None:
        self.cfg = cfg
        self.cal = calibration
        self.quality = QualityModel(calibration.quality, cfg.quality_extrapolate, cfg.quality_max_factor)
        domains = cfg.domains or self.quality.domains
        missing = [d for d in domains if d not in self.quality.curves]
        if missing:
            raise ValueError(
                f"domains {missing} have no quality curve in the calibration ({calibration.command})"
            )
        self.domains = tuple(domains)
        self.workload = workload or build_workload(cfg.workload, self.domains)
        self.versions: dict[str, int] = dict.fromkeys(self.domains, 1)
        self.trained_tokens: dict[str, float] = dict.fromkeys(self.domains, 0.0)
        self.version_losses: dict[str, dict[str, float]] = {
            f"{d}@v1": {d: self.quality.loss(d, 0.0)} for d in self.domains
        }
        eng = cfg.engine
        cos_name = cfg.coscheduler or COSCHEDULER_FOR_POLICY[cfg.policy]
        self.replicas: dict[str, SimReplica] = {}
        for i in range(cfg.replicas):
            rid = f"r{i}"
            self.replicas[rid] = SimReplica(
                rid,
                calibration.cost,
                dataclasses.replace(eng, **cfg.engine_by_replica.get(rid, {})),  # type: ignore[arg-type]
                make_coscheduler(cos_name, eng.fixed_every_iterations, slack_frac=eng.ft_slack_frac),
                self.domains[i % len(self.domains)],
                cfg.samples_per_replica,
                self.versions,
                self.workload.ttft_slo_ms,
                self.workload.tpot_slo_ms,
                cfg.request_timeout_s,
                self._on_finish,
                self._on_job_done,
            )
        self.ids = sorted(self.replicas)
        core_kw: dict[str, Any] = {
            "cost_prior": cost_prior(calibration, eng.train_micro_tokens),
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
        self._in_flight: dict[str, int] = dict.fromkeys(self.ids, 0)
        self._pending_obs: list[ReplicaObservation] = []
        self._pending_events: list[RoundEvent] = []
        self._versions_changed = True
        self.rounds: dict[int, SimRound] = {}
        self.lead = PublishLead(
            initial_s=self.cfg.publish_lead_initial_s,
            fixed_s=self.cfg.publish_lead_s,
            max_frac=self.cfg.publish_lead_max_frac,
        )
        self._round_seq = itertools.count(1)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self.requests: list[Req] = []
        self.outstanding = 0
        self.events = 0
        self.now = 0.0
        self.rounds_stats = {"opened": 0, "published": 0, "aborted": 0, "open_refused": 0}
        self.published_tokens = 0.0
        self.quality_timeline: list[tuple[float, dict[str, float]]] = [(0.0, self._gains())]
        self.share_samples: list[float] = []
        # Per fast tick and replica: a training share in force, and a round job held with it.
        self.share_ticks = 0
        self.share_job_ticks = 0
        self.z_samples: list[float] = []
        # Versions each replica has scored (adapter, version): the engine's cache of evaluations.
        self._scored: dict[str, set[tuple[str, int]]] = {rid: set() for rid in self.ids}
        self.evals_modelled = any(r.eval_ms_each for r in self.replicas.values())

    # --- event queue ----------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: Any = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def _wake(self, rep: SimReplica, now: float) -> None:
        if rep.idle:
            rep.idle = False
            self._push(now, _ITER, (rep, rep.gen))
        else:
            end = rep.interrupt(now)  # a training stretch in progress yields to the arrival
            if end is not None:
                self._push(end, _ITER, (rep, rep.gen))

    # --- callbacks from replicas ----------------------------------------------------------------------
    def _on_finish(self, req: Req) -> None:
        self.outstanding -= 1
        if req.replica is not None:
            self._in_flight[req.replica] -= 1

    def _on_job_done(self, rep: SimReplica, job: Job, now: float) -> None:
        rnd = self.rounds.get(job.round_id)
        if rnd is None or rnd.closed:
            return  # a late update: dropped, as the aggregator's default late policy does
        if job.tokens_done > 0:
            rnd.updates[rep.replica_id] = job.tokens_done
        if len(rnd.updates) == len(rnd.participants):
            self._close_round(rnd, now)

    # --- the run --------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        with rare_collections():
            return self._run()

    def _run(self) -> SimResult:
        wall0 = time.perf_counter()
        wl = self.workload
        n = len(wl)
        arrivals = wl.arrival_s
        draws = np.random.default_rng([self.cfg.seed, 7]).random(n)
        self._push(0.0, _TELEMETRY)
        self._push(0.0, _TICK)
        interval = self.cfg.engine.telemetry_interval_s
        i = 0
        heap = self._heap
        done_arrivals = n == 0
        while True:
            t_arr = arrivals[i] if i < n else math.inf
            if heap and heap[0][0] <= t_arr:
                t, _, kind, payload = heapq.heappop(heap)
                self.now = t
                self.events += 1
                if kind == _ITER:
                    rep, gen = payload
                    if gen != rep.gen:
                        continue  # an arrival moved this iteration's end: a newer event stands for it
                    nxt = rep.step(t)
                    if nxt is not None:
                        heapq.heappush(heap, (nxt, next(self._seq), _ITER, payload))
                elif kind == _TELEMETRY:
                    self._telemetry(t, interval)
                    if not self._finished(done_arrivals):
                        self._push(t + interval, _TELEMETRY)
                elif kind == _TICK:
                    nxt_tick = self._tick(t)
                    if not self._finished(done_arrivals):
                        self._push(nxt_tick, _TICK)
                elif kind == _DEADLINE:
                    if not payload.closed:
                        self._close_round(payload, t)
                elif kind == _PUBLISH:
                    self._publish(payload, t)
                elif kind == _EVAL_TIMEOUT:
                    self._schedule_publish(payload, t)
            elif i < n:
                self.now = t = float(t_arr)
                self.events += 1
                self._arrive(i, t, float(draws[i]))
                i += 1
                done_arrivals = i >= n
            else:
                break
            if done_arrivals and self.outstanding == 0 and self.now >= wl.duration_s:
                break
        wall = time.perf_counter() - wall0
        return self._result(wall)

    def _finished(self, done_arrivals: bool) -> bool:
        return done_arrivals and self.outstanding == 0

    def _arrive(self, i: int, t: float, draw: float) -> None:
        wl = self.workload
        domain = wl.domains[int(wl.domain[i])]
        req = Req(i, t, int(wl.input_tokens[i]), int(wl.output_tokens[i]), domain)
        self.requests.append(req)
        self.outstanding += 1
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
        snaps = snapshots_at(self._gw_view, t, self._in_flight, serving)
        tries = 1 + self.cfg.gateway.max_retries  # the gateway tries no more replicas than this
        ranked = rank_replicas(snaps, weights, domain, draw, self.routing_cfg, limit=tries).replica_ids
        for rid in ranked:
            req.attempts += 1
            rep = self.replicas[rid]
            if rep.enqueue(req, t):
                self._in_flight[rid] += 1
                self._wake(rep, t)
                return
        req.status = "rejected" if ranked else "error"
        req.t_end = t
        self.outstanding -= 1

    def _telemetry(self, t: float, interval: float) -> None:
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

    def _tick(self, t: float) -> float:
        versions: tuple[AdapterVersionView, ...] = ()
        if self._versions_changed:
            versions = tuple(
                AdapterVersionView(d, v, self.version_losses.get(f"{d}@v{v}", {}))
                for d, v in self.versions.items()
            )
            self._versions_changed = False
        inputs = TickInputs(tuple(self._pending_obs), tuple(self._pending_events), versions)
        self._pending_obs, self._pending_events = [], []
        d = self.core.on_tick(t, inputs)
        if d.slow is not None:
            for plan in d.slow.plans:
                self._open_round(plan, t)
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
                    self._wake(rep, t)
            self.share_samples.append(sum(s.share for s in fast.shares))
            for rep in self.replicas.values():
                if rep.share_now(t) > 0:
                    self.share_ticks += 1
                    self.share_job_ticks += rep.has_job
            self.z_samples.append(d.diagnostics.virtual_queue)
        return max(d.next_tick_s, t + 1e-6)

    # --- the simulated aggregator ---------------------------------------------------------------------
    def _open_round(self, plan: RoundPlanDecision, t: float) -> None:
        current = self.versions.get(plan.adapter)
        if current is None or current != plan.base_version:
            self.rounds_stats["open_refused"] += 1
            self._pending_events.append(
                RoundEvent(plan.adapter, "aborted", reason="base version is not current")
            )
            return
        rid = next(self._round_seq)
        parts = tuple(p.replica_id for p in plan.participants)
        rnd = SimRound(
            rid, plan.adapter, plan.base_version, parts, min(plan.quorum, len(parts)), plan.deadline_s
        )
        self.rounds[rid] = rnd
        self.rounds_stats["opened"] += 1
        self._pending_events.append(
            RoundEvent(plan.adapter, "opened", round_id=rid, base_version=plan.base_version)
        )
        # As the aggregator: participants send `lead` before the round's deadline, so that the rest of
        # the round (aggregate, evaluate, publish) fits in it; the collection still closes at the deadline.
        send_by_s = plan.deadline_s - self.lead.lead_s(plan.adapter, plan.deadline_s - t)
        for p in plan.participants:
            rep = self.replicas[p.replica_id]
            rep.start_job(plan.adapter, rid, plan.base_version, max(1, p.token_budget), send_by_s, t)
            self._wake(rep, t)
        # As the aggregator: the current version is scored while participants train, unless an earlier
        # round of the adapter is still finishing (async rounds): this round is then rebased onto the
        # version that one publishes, whose evaluators score it as their candidate.
        if not any(
            r.adapter == rnd.adapter and r.state == "opened" and r.closed for r in self.rounds.values()
        ):
            for e in self._evaluators(rnd):
                if (rnd.adapter, rnd.base_version) not in self._scored[e]:
                    self._ask_eval(rnd, e, t, self._current_scored)
        self._push(plan.deadline_s, _DEADLINE, rnd)

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
        self._wake(rep, t)

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
            self._schedule_publish(rnd, t)

    def _schedule_publish(self, rnd: SimRound, t: float) -> None:
        if rnd.publishing or rnd.state != "opened":
            return
        rnd.publishing = True
        self._push(t + self.cfg.publish_delay_s, _PUBLISH, rnd)

    def _close_round(self, rnd: SimRound, t: float) -> None:
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
            self._pending_events.append(
                RoundEvent(rnd.adapter, "aborted", round_id=rnd.round_id, reason="quorum not reached")
            )
            return
        self._pending_events.append(RoundEvent(rnd.adapter, "aggregating", round_id=rnd.round_id))
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
            self._schedule_publish(rnd, t)
        else:  # the aggregator waits for the reports at most this long
            self._push(t + self.cfg.eval_timeout_s, _EVAL_TIMEOUT, rnd)

    def _publish(self, rnd: SimRound, t: float) -> None:
        d = rnd.adapter
        if any(
            r.adapter == d and r.round_id < rnd.round_id and r.state == "opened" for r in self.rounds.values()
        ):
            # As the aggregator: a round publishes after its adapter's earlier rounds have ended.
            self._push(t + 1.0, _PUBLISH, rnd)
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
        self._versions_changed = True
        rnd.state = "published"
        self.rounds_stats["published"] += 1
        if rnd.closed_s is not None:
            self.lead.observe(d, t - rnd.closed_s)
        self._pending_events.append(
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
        self.quality_timeline.append((t, self._gains()))

    def _gains(self) -> dict[str, float]:
        return {d: self.quality.gain(d, self.trained_tokens[d]) for d in self.domains}

    # --- results --------------------------------------------------------------------------------------
    def records(self) -> list[RequestRecord]:
        out = []
        slo_ttft, slo_tpot = self.workload.ttft_slo_ms, self.workload.tpot_slo_ms
        for r in self.requests:
            ok = r.status == "ok"
            ttft = (r.t_first - r.arrival_s) * 1e3 if ok and r.t_first is not None else None
            e2e = (r.t_end - r.arrival_s) * 1e3 if ok and r.t_end is not None else None
            status = r.status if r.status in ("ok", "rejected", "timeout") else "error"
            out.append(
                RequestRecord(
                    request_id=f"r{r.idx:06d}",
                    index=r.idx,
                    domain=r.domain,
                    model=r.domain,
                    status=status,  # type: ignore[arg-type]
                    scheduled_s=r.arrival_s,
                    sent_s=r.arrival_s,
                    first_token_s=r.t_first,
                    end_s=r.t_end,
                    ttft_ms=ttft,
                    e2e_ms=e2e,
                    prompt_tokens=r.prompt_len if ok else None,
                    completion_tokens=r.generated if ok else None,
                    usage_reported=ok,
                    target_input_tokens=r.prompt_len,
                    max_tokens=r.out_len,
                    adapter_version=r.version,
                    replica=r.replica,
                    served_model=r.domain,
                    slo_ttft_ms=slo_ttft,
                    slo_tpot_ms=slo_tpot,
                )
            )
        return out

    def quality_table(self) -> QualityTable:
        base = {d: self.quality.base_loss(d) for d in self.domains}
        return QualityTable(versions={k: dict(v) for k, v in self.version_losses.items()}, base=base)

    def _result(self, wall_s: float) -> SimResult:
        records = self.records()
        summary = summarize(records, quality=self.quality_table(), timeline_bin_s=None)
        wl = self.workload
        counts = (
            np.bincount(wl.domain, minlength=len(self.domains)) if len(wl) else np.zeros(len(self.domains))
        )
        weights = counts / counts.sum() if counts.sum() else np.full(len(self.domains), 1 / len(self.domains))
        gains = self._gains()
        gain_mix = float(sum(w * gains[d] for w, d in zip(weights, self.domains, strict=True)))
        hours = wl.duration_s / 3600.0
        sim = {
            "policy": self.cfg.policy,
            "replicas": self.cfg.replicas,
            "coscheduler": self.cfg.coscheduler or COSCHEDULER_FOR_POLICY[self.cfg.policy],
            "workload": wl.description,
            "requests": len(wl),
            "offered_rate_rps": len(wl) / wl.duration_s if wl.duration_s else None,
            "sim_time_s": self.now,
            "wall_s": wall_s,
            "speedup": self.now / wall_s if wall_s > 0 else None,
            "events": self.events,
            "iterations": sum(r.iterations_total for r in self.replicas.values()),
            "ft_tokens": sum(r.ft_tokens_total for r in self.replicas.values()),
            "ft_tokens_published": self.published_tokens,
            "ft_tokens_per_s": sum(r.ft_tokens_total for r in self.replicas.values())
            / max(wl.duration_s, 1e-9),
            "rounds": dict(self.rounds_stats),
            "quality_gain_by_domain": gains,
            "quality_extrapolate": self.cfg.quality_extrapolate,
            "trained_tokens_by_domain": dict(self.trained_tokens),
            "tokens_past_measured_by_domain": {
                d: max(0.0, t - self.quality.measured_tokens(d)) for d, t in self.trained_tokens.items()
            },
            "quality_gain_mix": gain_mix,
            "quality_gain_per_hour": gain_mix / hours if hours > 0 else None,
            "quality_timeline": [[t, g] for t, g in self.quality_timeline],
            "mean_total_share": float(np.mean(self.share_samples)) if self.share_samples else 0.0,
            "mean_virtual_queue": float(np.mean(self.z_samples)) if self.z_samples else 0.0,
            "evaluations_modelled": self.evals_modelled,
            # Replica-seconds holding an active round job (by how each job ended), and their share of
            # all replica-seconds.
            "job_s": {
                why: round(sum(rep.bg.job_s[why] for rep in self.replicas.values()), 3)
                for why in ("budget", "stop", "replaced")
            },
            "job_time_frac": (
                sum(sum(rep.bg.job_s.values()) for rep in self.replicas.values())
                / (len(self.replicas) * self.now)
                if self.replicas and self.now > 0
                else 0.0
            ),
            # Of the fast ticks at which a replica has a training share in force, the share at which it
            # holds a round job (None: no share ever).
            "job_time_of_share_frac": (self.share_job_ticks / self.share_ticks if self.share_ticks else None),
            "busy_s_by_replica": {
                rid: {k: round(ms / 1e3, 3) for k, ms in rep.busy_ms.items()}
                for rid, rep in self.replicas.items()
            },
        }
        return SimResult(self.cfg, summary, sim, records)


def simulate(cfg: SimConfig, calibration: Calibration, workload: Workload | None = None) -> SimResult:
    return Simulation(cfg, calibration, workload).run()
