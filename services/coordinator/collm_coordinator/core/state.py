"""What the coordinator remembers between ticks, and the read-only view its policies decide from.

`ClusterState` ingests `TickInputs` (telemetry snapshots, round events, adapter versions) and keeps:
the latest snapshot of every replica and when it arrived (liveness), a short history of cluster demand
(for the load forecast), the attainment target (`AttainmentTarget`, target.py), the rounds in flight, and the
quality estimate of every adapter. Each tick it freezes what the policies need into a `ClusterView`.

Load is measured in *replica-utilisation units*: the inference demand D is the number of replicas that
would be fully busy serving the current load (the sum of each replica's load as a fraction of its
serving capacity, plus the backlog of queued requests spread over `backlog_horizon_s`). Training on
replica i with share s_i removes s_i of a replica from inference capacity.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from collm_coordinator.core.config import CoreConfig
from collm_coordinator.core.quality import AdapterQuality, effective_tokens
from collm_coordinator.core.target import AttainmentTarget
from collm_coordinator.core.types import (
    CLOSED_ROUND_STATES,
    FINAL_ROUND_STATES,
    AdapterVersionView,
    ParticipantBudget,
    ReplicaObservation,
    RoundEvent,
    RoundPlanDecision,
)

DONE_JOB_STATES = ("done", "stopped", "failed")
# A job in this state trains now (a paused job waits for the replica's operator, not for a share).
ACTIVE_JOB_STATES = ("running",)
# Ids of finished rounds remembered, so a job still reported running for one gets no share.
CLOSED_ROUNDS_KEPT = 4096


def attainment_upper_bound(attainment: float, n: int, z: float) -> float:
    """Upper end of the Wilson score interval of a proportion measured over n requests, z sigmas wide
    (z = 0: the proportion itself)."""
    if z <= 0 or n <= 0:
        return attainment
    z2 = z * z
    centre = (attainment + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(attainment * (1 - attainment) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return min(1.0, centre + half)


@dataclass
class ActiveRound:
    """A round the coordinator planned and has not yet seen finish."""

    adapter: str
    plan: RoundPlanDecision
    state: str = "planned"
    round_id: int | None = None
    # Useful local data tokens of each participant when planned (for the quality update).
    data_tokens: dict[str, float] = field(default_factory=dict)
    tokens_done: dict[str, int] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)

    @property
    def deadline_s(self) -> float:
        return self.plan.deadline_s

    def budget(self, replica_id: str) -> ParticipantBudget | None:
        for p in self.plan.participants:
            if p.replica_id == replica_id:
                return p
        return None


@dataclass(frozen=True)
class ClusterView:
    """A frozen snapshot of the cluster for one tick; policies read only this."""

    now_s: float
    config: CoreConfig
    live: Mapping[str, ReplicaObservation]
    stale: tuple[str, ...]
    known: tuple[str, ...]
    infer_load: Mapping[str, float]
    train_rate_per_s: Mapping[str, float | None]
    demand_now: float
    # Mean demand over the last `burst_window_s` (what the fast loop's burst check compares).
    demand_short: float
    arrivals_now_per_s: float
    forecast_demand: float
    forecast_arrivals_per_s: float
    attainment: float | None
    at_risk: Mapping[str, str]
    virtual_queue: float
    rounds: Mapping[str, ActiveRound]
    plan_shares: Mapping[str, float]
    # Live replicas that train outside the coordinator's plan (no planned share, a running job of a
    # round it did not plan or a local job): replica -> what it trains.
    unplanned: Mapping[str, str]
    prev_shares: Mapping[str, float]
    versions: Mapping[str, int]
    quality: Mapping[str, AdapterQuality]
    adapter_demand: Mapping[str, float]
    adapter_domains: Mapping[str, tuple[str, ...]]
    data_tokens: Mapping[tuple[str, str], float]
    # h in [0, 1]: how little a share counts against serving capacity (AttainmentTarget.headroom).
    headroom: float = 0.0
    # The part of a share trained beyond the requests' slack (AttainmentTarget.spend).
    spend: float = 0.0
    # Per adapter: when its last round was planned, or when it was first seen (the starvation floor).
    last_planned_s: Mapping[str, float] = field(default_factory=dict)

    def displaced(self, share: float) -> float:
        """The serving capacity a training share takes in the loops' utilisation model: (1 - h) x share."""
        return (1.0 - self.headroom) * share

    def replicas_for(self, adapter: str) -> list[str]:
        """Live replicas that hold local data for `adapter`, sorted by id."""
        domains = self.adapter_domains.get(adapter, (adapter,))
        out = []
        for rid in sorted(self.live):
            obs = self.live[rid]
            if obs.local_samples <= 0:
                continue
            if "*" in domains or any(d in domains for d in obs.domains):
                out.append(rid)
        return out


def train_rate_of(obs: ReplicaObservation) -> float | None:
    """Tokens/s a replica trains at when it only trains, from what it reports (None: it says nothing)."""
    if obs.ft_tokens_per_s <= 0:
        return None
    if obs.train_busy_frac is not None and obs.train_busy_frac >= 0.05:
        return obs.ft_tokens_per_s / obs.train_busy_frac
    if obs.ft_share >= 0.05:
        return obs.ft_tokens_per_s / obs.ft_share
    return None


def forecast(
    cfg: CoreConfig,
    history: Sequence[tuple[float, float, float]],
    now_s: float,
    demand: float,
    arrivals: float,
) -> tuple[float, float]:
    """(demand, arrivals/s) for the next round, from `history` ((t, demand, arrivals) per fast tick):
    the larger of the recent mean and the window mean plus `burst_headroom_sigmas` standard deviations
    of the window's `recent_window_s` averages (bursts seen in the window will come again; one-second
    samples would mostly measure noise: one long prompt is a spike of prefill on one replica, not load
    the next round must be planned for)."""
    hist = list(history) or [(now_s, demand, arrivals)]
    recent = [h for h in hist if now_s - h[0] <= cfg.recent_window_s] or hist[-1:]
    rd = sum(h[1] for h in recent) / len(recent)
    ra = sum(h[2] for h in recent) / len(recent)
    buckets: dict[int, list[tuple[float, float, float]]] = {}
    for h in hist:
        buckets.setdefault(int((now_s - h[0]) // cfg.recent_window_s), []).append(h)
    means_d = [sum(x[1] for x in b) / len(b) for b in buckets.values()]
    means_a = [sum(x[2] for x in b) / len(b) for b in buckets.values()]
    md, sd = _mean_std(means_d)
    ma, sa = _mean_std(means_a)
    k = cfg.burst_headroom_sigmas
    return max(rd, md + k * sd), max(ra, ma + k * sa)


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    m = sum(values) / len(values)
    var = sum((v - m) ** 2 for v in values) / len(values)
    return m, math.sqrt(var)


class ClusterState:
    """Mutable memory of the core (see module docstring). Not shared with anything else."""

    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self.latest: dict[str, ReplicaObservation] = {}
        self.first_seen_s: dict[str, float] = {}
        # (t, demand, arrivals) per fast tick, for the forecast.
        self.demand_history: deque[tuple[float, float, float]] = deque()
        # (received, serving load) of each replica's snapshots over the last `burst_window_s`.
        self.load_history: dict[str, deque[tuple[float, float]]] = {}
        # The long-term attainment target: virtual queue, headroom, spend (target.py).
        self.target = AttainmentTarget(config)
        # The round of each adapter still collecting updates (planned, opened, training) ...
        self.rounds: dict[str, ActiveRound] = {}
        # ... and, in async mode, rounds whose collection closed (aggregating, evaluating), by id.
        self.finishing: dict[int, ActiveRound] = {}
        # Adapters whose round closed its collection since the last tick (async: planned again at once).
        self.freed: set[str] = set()
        self.versions: dict[str, int] = {}
        self.version_losses: dict[str, Mapping[str, float]] = {}
        self.quality: dict[str, AdapterQuality] = {}
        self.train_rate: dict[str, float] = {}
        self.adapter_inflight_ewma: dict[str, float] = {}
        # Samples a replica held when it last finished a round of an adapter (freshness).
        self.samples_at_last_round: dict[tuple[str, str], int] = {}
        # Per adapter: when its last round was planned, or when it was first seen (starvation floor).
        self.last_planned_s: dict[str, float] = {}
        self.shares: dict[str, float] = {}
        # Ids of rounds seen to finish, oldest first (bounded by CLOSED_ROUNDS_KEPT).
        self.closed_rounds: dict[int, None] = {}
        self.work_per_request_s = 0.0
        self.notes: list[str] = []

    # --- ingestion --------------------------------------------------------------------------------
    def ingest_telemetry(self, obs: ReplicaObservation) -> None:
        prev = self.latest.get(obs.replica_id)
        if prev is not None and obs.received_s < prev.received_s:
            return  # an older snapshot arriving late changes nothing
        self.latest[obs.replica_id] = obs
        self.first_seen_s.setdefault(obs.replica_id, obs.received_s)
        hist = self.load_history.setdefault(obs.replica_id, deque())
        hist.append((obs.received_s, self.infer_load(obs)))
        while obs.received_s - hist[0][0] > self.config.burst_window_s:
            hist.popleft()
        self.target.count(obs.good, obs.finished, obs.good_alone)
        self._learn_train_rate(obs)
        for a in obs.adapters:
            self.adapter_inflight_ewma.setdefault(a.name, 0.0)
        for job in obs.training:
            rnd = self._round_of(job.adapter, job.round_id)
            if rnd is None or rnd.round_id is None or job.round_id != rnd.round_id:
                continue
            rnd.tokens_done[obs.replica_id] = max(rnd.tokens_done.get(obs.replica_id, 0), job.tokens_done)
            if job.state in DONE_JOB_STATES:
                rnd.done.add(obs.replica_id)

    def _learn_train_rate(self, obs: ReplicaObservation) -> None:
        rate = train_rate_of(obs)
        if rate is None:
            return
        old = self.train_rate.get(obs.replica_id)
        self.train_rate[obs.replica_id] = rate if old is None else 0.8 * old + 0.2 * rate

    def _round_of(self, adapter: str, round_id: int | None) -> ActiveRound | None:
        """The round a job or an event belongs to: a finishing round by its id, else the adapter's
        collecting round (whose id the caller still checks: it may be unknown yet, or another)."""
        if round_id is not None and round_id in self.finishing:
            return self.finishing[round_id]
        return self.rounds.get(adapter)

    def ingest_round_event(self, ev: RoundEvent) -> None:
        if ev.round_id is not None and ev.state in FINAL_ROUND_STATES:
            # Any round, planned here or not: a job of it that telemetry still reports is not trained.
            self.closed_rounds[ev.round_id] = None
            while len(self.closed_rounds) > CLOSED_ROUNDS_KEPT:
                del self.closed_rounds[next(iter(self.closed_rounds))]
        rnd = self._round_of(ev.adapter, ev.round_id)
        if rnd is None:
            return
        if rnd.round_id is not None and ev.round_id is not None and ev.round_id != rnd.round_id:
            return  # an event of an older round of this adapter
        if ev.round_id is not None:
            rnd.round_id = ev.round_id
        rnd.state = ev.state
        if ev.state in FINAL_ROUND_STATES:
            self._finish_round(rnd, ev)
        elif (
            ev.state in CLOSED_ROUND_STATES
            and self.config.rounds == "async"
            and rnd.round_id is not None
            and self.rounds.get(rnd.adapter) is rnd
        ):
            # Its collection closed: the adapter is free for its next round while this one finishes.
            del self.rounds[rnd.adapter]
            self.finishing[rnd.round_id] = rnd
            self.freed.add(rnd.adapter)

    def _finish_round(self, rnd: ActiveRound, ev: RoundEvent | None) -> None:
        cfg = self.config
        if self.rounds.get(rnd.adapter) is rnd:
            del self.rounds[rnd.adapter]
        if rnd.round_id is not None:
            self.finishing.pop(rnd.round_id, None)
        if ev is None or ev.state in ("aborted", "open_failed"):
            return
        accepted = ev.accepted or tuple(p.replica_id for p in rnd.plan.participants)
        x = 0.0
        for rid in accepted:
            p = rnd.budget(rid)
            tokens = rnd.tokens_done.get(rid, p.token_budget if p else 0)
            x += effective_tokens(tokens, rnd.data_tokens.get(rid, 0.0))
            obs = self.latest.get(rid)
            if obs is not None:
                self.samples_at_last_round[(rid, rnd.adapter)] = obs.local_samples
        q = self.quality_of(rnd.adapter)
        q.observe_round(
            cfg.quality_token_scale, x, ev.state == "published", ev.eval_loss_before, ev.eval_loss_after
        )
        if ev.state == "published" and ev.new_version is not None:
            self.versions[rnd.adapter] = max(self.versions.get(rnd.adapter, 0), ev.new_version)

    def ingest_version(self, v: AdapterVersionView) -> None:
        self.versions[v.adapter] = v.version
        self.version_losses[v.adapter] = dict(v.losses)

    def quality_of(self, adapter: str) -> AdapterQuality:
        """The adapter's quality model. Its prior: the calibration's curve of its domains when there is
        one; else, while it has no round of its own observed, the mean gain coefficient of the adapters
        that have (what training on this cluster has shown so far), else `quality_prior_gain`. An adapter
        without evidence thus competes for training on the evidence of the others instead of a fixed
        prior that an adapter with large observed gains would outbid for many rounds."""
        q = self.quality.get(adapter)
        cfg = self.config
        domains = self.adapter_domains().get(adapter, (adapter,))
        priors = [cfg.quality_prior[d] for d in domains if d in cfg.quality_prior]
        if q is None:
            prior = (
                sum(priors) / len(priors)
                if priors
                else cfg.quality_prior.get(adapter, cfg.quality_prior_gain)
            )
            q = AdapterQuality(
                prior_gain=prior, prior_weight=cfg.quality_prior_weight, memory=cfg.quality_memory
            )
            self.quality[adapter] = q
        if q.rounds_observed == 0 and not priors and adapter not in cfg.quality_prior:
            observed = [o.gain_coefficient for o in self.quality.values() if o.rounds_observed > 0]
            q.prior_gain = sum(observed) / len(observed) if observed else cfg.quality_prior_gain
        return q

    def add_plan(self, plan: RoundPlanDecision, data_tokens: Mapping[str, float]) -> None:
        self.rounds[plan.adapter] = ActiveRound(plan.adapter, plan, data_tokens=dict(data_tokens))
        self.last_planned_s[plan.adapter] = plan.opened_s

    # --- derived quantities -----------------------------------------------------------------------
    def live_ids(self, now_s: float) -> list[str]:
        return sorted(r for r, o in self.latest.items() if now_s - o.received_s <= self.config.stale_after_s)

    def adapter_domains(self) -> dict[str, tuple[str, ...]]:
        """The adapters to train and the domains whose data trains each (configured, else one per
        domain that live replicas report, named after it)."""
        if self.config.adapters:
            return {a: tuple(d) for a, d in self.config.adapters.items()}
        domains = sorted({d for o in self.latest.values() for d in o.domains})
        return {d: (d,) for d in domains}

    def infer_load(self, obs: ReplicaObservation) -> float:
        """The replica's serving load as a fraction of its serving capacity (1.0: saturated).

        Capacity is throughput at the full batch: decode tokens/s over max_batch / decode_step_ms(max_batch)
        plus prefill tokens/s times prefill_ms_per_token. (The fraction of time the engine is busy is not
        the load of a batching engine: one running request keeps it busy all the time at a small fraction
        of what it could serve.) Step costs come from the calibration prior when there is one, else from
        the replica's own measurements; without either, the batch occupancy running / max_batch.
        """
        prior = self.config.cost_prior
        decode_ms = (
            prior.decode_step_ms(obs.max_batch) if prior.decode_step_ms is not None else obs.decode_step_ms
        )
        prefill_ms = (
            obs.prefill_ms_per_token if obs.prefill_ms_per_token is not None else prior.prefill_ms_per_token
        )
        if decode_ms is not None and prefill_ms is not None:
            busy_ms = obs.prefill_tokens_per_s * prefill_ms + obs.tokens_per_s * decode_ms / max(
                1, obs.max_batch
            )
            return max(0.0, min(1.5, busy_ms / 1000.0))
        return min(1.0, obs.running / max(1, obs.max_batch))

    def risk_load(self, replica_id: str, load_now: float) -> float:
        """The serving load the risk check judges: the larger of the latest one-second load and the mean
        over `burst_window_s`. One-second samples of a batching engine swing with the prompts that land
        in them (over 1.07-1.22 and at most 1.0 in turn on a saturated replica): the latest alone would
        clear the risk every other second, and a round planned in such a second finds no slack to train
        in for its whole window; a spike still counts at once."""
        hist = self.load_history.get(replica_id)
        if not hist:
            return load_now
        return max(load_now, sum(x for _, x in hist) / len(hist))

    def risk_of(self, obs: ReplicaObservation, load: float) -> str | None:
        """Why this replica's SLOs are at risk right now, or None."""
        cfg = self.config
        if obs.queue_len >= max(1.0, cfg.queue_risk_frac * obs.max_batch):
            return f"queue {obs.queue_len} >= {cfg.queue_risk_frac:g} x batch {obs.max_batch}"
        floor = cfg.risk_attainment if cfg.risk_attainment is not None else self.target.effective_target
        if obs.slo_attainment is not None and obs.finished >= cfg.min_finished_for_attainment:
            upper = attainment_upper_bound(obs.slo_attainment, obs.finished, cfg.risk_attainment_z)
            if upper < floor:
                return (
                    f"attainment {obs.slo_attainment:.2f} of {obs.finished} < {floor:.2f}"
                    f" (upper bound {upper:.2f})"
                )
        # While the SLO budget is being spent (headroom with a spend), tails past the SLO are the price
        # paid for training and the attainment check above is the guard; otherwise a p99 near the SLO is.
        tails = not (self.target.headroom > 0 and cfg.spend_gain > 0)
        ttft_p99, tpot_p99 = obs.ttft_ms_p99, obs.tpot_ms_p99
        if tails and cfg.ttft_slo_ms and ttft_p99 and ttft_p99 > cfg.slo_risk_frac * cfg.ttft_slo_ms:
            return f"TTFT p99 {ttft_p99:.0f} ms near SLO {cfg.ttft_slo_ms:.0f} ms"
        if tails and cfg.tpot_slo_ms and tpot_p99 and tpot_p99 > cfg.slo_risk_frac * cfg.tpot_slo_ms:
            return f"TPOT p99 {tpot_p99:.0f} ms near SLO {cfg.tpot_slo_ms:.0f} ms"
        if load > cfg.util_cap and load + obs.ft_share > 1.0:
            return f"serving load {load:.2f} above cap {cfg.util_cap:.2f}"
        return None

    def expire(self, now_s: float) -> None:
        """Rounds whose outcome never came are forgotten a grace period after their deadline (a longer
        one while the aggregator reports it aggregating or evaluating: its outcome is on its way)."""
        cfg = self.config
        for rnd in [*self.rounds.values(), *self.finishing.values()]:
            closing = rnd.state in ("aggregating", "evaluating")
            grace = (
                cfg.evaluation_grace_s if closing else max(cfg.outcome_grace_s, 0.25 * cfg.round_deadline_s)
            )
            if now_s > rnd.deadline_s + grace:
                self.notes.append(f"round of {rnd.adapter} had no outcome {grace:.0f}s after its deadline")
                self._finish_round(rnd, None)
        # Replicas silent for much longer than the staleness bound are forgotten entirely.
        forget = max(60.0, 20 * self.config.stale_after_s)
        for rid, obs in list(self.latest.items()):
            if now_s - obs.received_s > forget:
                del self.latest[rid]
                self.shares.pop(rid, None)

    def plan_shares(self, live: list[str]) -> dict[str, float]:
        """The share each live replica should train at under the rounds in flight (0 when done), at most
        `max_share` (a starved adapter's turn shares a full replica's time: slow_loop._floor_inside)."""
        out = dict.fromkeys(live, 0.0)
        cap = self.config.max_share
        for rnd in self.rounds.values():
            for p in rnd.plan.participants:
                if p.replica_id in out and p.replica_id not in rnd.done:
                    out[p.replica_id] = min(cap, out[p.replica_id] + p.share)
        return out

    def unplanned_training(
        self, live: Mapping[str, ReplicaObservation], plan: Mapping[str, float]
    ) -> dict[str, str]:
        """Replicas without a planned share that run a training job: a round the coordinator did not
        plan (the aggregator's built-in planner, an operator's `open_round`) or a local job. Jobs of
        rounds seen to finish are left out (a straggler may report one until its own deadline)."""
        out: dict[str, str] = {}
        for rid in sorted(live):
            if plan.get(rid, 0.0) > 0:
                continue
            jobs = [
                (
                    f"round {j.round_id} of {j.adapter}"
                    if j.round_id is not None
                    else f"a local job of {j.adapter}"
                )
                for j in live[rid].training
                if j.state in ACTIVE_JOB_STATES
                and (j.round_id is None or j.round_id not in self.closed_rounds)
            ]
            if jobs:
                out[rid] = ", ".join(jobs)
        return out

    def data_tokens(self, rid: str, adapter: str) -> float:
        """Useful local data tokens of a replica for an adapter (fresh samples count fully)."""
        cfg = self.config
        obs = self.latest.get(rid)
        if obs is None or obs.local_samples <= 0:
            return 0.0
        last = self.samples_at_last_round.get((rid, adapter))
        fresh = obs.local_samples if last is None else max(0, obs.local_samples - last)
        old = obs.local_samples - fresh
        return (fresh + cfg.stale_data_weight * old) * cfg.data_tokens_per_sample * cfg.data_useful_epochs

    def view(self, now_s: float, record_history: bool) -> ClusterView:
        """Freeze the cluster for the policies; `record_history` (fast ticks) also advances the
        demand history and the per-adapter demand averages."""
        cfg = self.config
        live_ids = self.live_ids(now_s)
        live = {r: self.latest[r] for r in live_ids}
        stale = tuple(sorted(set(self.latest) - set(live_ids)))
        loads = {r: self.infer_load(o) for r, o in live.items()}
        arrivals = sum(o.arrivals_per_s for o in live.values())
        # Backlog: queued requests need serving too; spread them over the recent window.
        work_per_req = self._work_per_request(live, loads, learn=record_history)
        backlog = sum(o.queue_len for o in live.values()) * work_per_req / cfg.backlog_horizon_s
        demand = sum(loads.values()) + backlog
        if record_history:
            self.demand_history.append((now_s, demand, arrivals))
            while self.demand_history and now_s - self.demand_history[0][0] > cfg.forecast_window_s:
                self.demand_history.popleft()
        fd, fa = forecast(self.config, self.demand_history, now_s, demand, arrivals)
        short = [h[1] for h in self.demand_history if now_s - h[0] < cfg.burst_window_s] or [demand]
        demand_short = sum(short) / len(short)
        risks: dict[str, str] = {}
        for r, o in live.items():
            why = self.risk_of(o, self.risk_load(r, loads[r]))
            if why:
                risks[r] = why
        rates: dict[str, float | None] = {}
        known_rates = sorted(self.train_rate.values())
        fallback = cfg.cost_prior.train_tokens_per_s
        if fallback is None and known_rates:
            fallback = known_rates[len(known_rates) // 2]
        for r in live_ids:
            rates[r] = self.train_rate.get(r, fallback)
        if record_history:
            inflight: dict[str, int] = {}
            for o in live.values():
                for x in o.adapters:
                    inflight[x.name] = inflight.get(x.name, 0) + x.in_flight
            for a in self.adapter_inflight_ewma:
                self.adapter_inflight_ewma[a] = 0.9 * self.adapter_inflight_ewma[a] + 0.1 * inflight.get(a, 0)
        domains = self.adapter_domains()
        total = sum(self.adapter_inflight_ewma.get(a, 0.0) for a in domains)
        n = max(1, len(domains))
        adapter_demand = {
            a: (self.adapter_inflight_ewma.get(a, 0.0) + 1.0) / (total + n) * n for a in domains
        }
        data = {(r, a): self.data_tokens(r, a) for r in live_ids for a in domains}
        plan = self.plan_shares(live_ids)
        return ClusterView(
            now_s=now_s,
            config=cfg,
            live=live,
            stale=stale,
            known=tuple(sorted(self.latest)),
            infer_load=loads,
            train_rate_per_s=rates,
            demand_now=demand,
            demand_short=demand_short,
            arrivals_now_per_s=arrivals,
            forecast_demand=fd,
            forecast_arrivals_per_s=fa,
            attainment=self.target.last_attainment,
            at_risk=risks,
            virtual_queue=self.target.virtual_queue,
            headroom=self.target.headroom,
            spend=self.target.spend,
            rounds=dict(self.rounds),
            plan_shares=plan,
            unplanned=self.unplanned_training(live, plan),
            prev_shares=dict(self.shares),
            versions=dict(self.versions) | self._versions_from_telemetry(live),
            quality={a: self.quality_of(a) for a in domains},
            adapter_demand=adapter_demand,
            adapter_domains=domains,
            data_tokens=data,
            last_planned_s={a: self.last_planned_s.setdefault(a, now_s) for a in domains},
        )

    def _versions_from_telemetry(self, live: Mapping[str, ReplicaObservation]) -> dict[str, int]:
        """Adapters the store did not tell us about: the newest version a replica holds."""
        out: dict[str, int] = {}
        for o in live.values():
            for a in o.adapters:
                if a.name not in self.versions:
                    out[a.name] = max(out.get(a.name, 0), a.version)
        return out

    def _work_per_request(
        self, live: Mapping[str, ReplicaObservation], loads: Mapping[str, float], learn: bool
    ) -> float:
        """Capacity-seconds one request costs, from replicas that are serving but not saturated."""
        if not learn:
            return self.work_per_request_s
        arr = sum(o.arrivals_per_s for r, o in live.items() if o.queue_len == 0)
        busy = sum(loads[r] for r, o in live.items() if o.queue_len == 0)
        if arr > 0.05 and busy > 0:
            w = busy / arr
            self.work_per_request_s = (
                w if self.work_per_request_s == 0 else 0.8 * self.work_per_request_s + 0.2 * w
            )
        return self.work_per_request_s
