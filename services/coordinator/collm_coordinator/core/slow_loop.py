"""CoLLM's slow loop: one plan per federated round (participants and token budgets per adapter).

Objective, once per round (drift-plus-penalty):

    maximise   V * sum_a d_a * gain_a(x_a)  -  Z * phi(u(s))

    over       s_i in [0, room_i]               the training share of live replica i, where
                                                room_i = min(max_share, 1 - l_i / util_cap) (at least
                                                one share_step): the SLO-aware co-scheduler trains only
                                                in the time serving leaves, so on a replica serving
                                                l_i of its capacity a larger share would never be spent
    where      b_i = s_i * T * r_i              its token budget (T: round length, r_i: tokens/s when
                                                it only trains, learned from telemetry, prior from the
                                                calibration)
               x_a = sum_i e_i(b_i)             effective tokens of adapter a (quality.py: data volume
                                                and freshness of each participant)
               gain_a                           expected eval-loss decrease (quality.py: concave, learned
                                                from the loss history)
               d_a                              the adapter's share of requests (served quality counts)
               u(s) = D / sum_i (1 - (1-h) s_i) the cluster's forecast serving utilisation: D is the
                                                forecast demand of the next round (replica units; the
                                                recent mean or the window mean plus `burst_headroom_sigmas`
                                                standard deviations, whichever is larger), spread by
                                                routing over the capacity training leaves; h is the
                                                headroom (below)
               phi(u) = u / (1 - u)             SLO risk: queueing delay grows without bound as u -> 1
    subject to u(s) <= util_cap                 forecast load plus training keeps every replica at or
                                                below the utilisation at which SLOs hold
               replicas whose SLOs are at risk now while there is no headroom (with h > 0 they take
               part: the fast loop holds their share at 0 while the risk lasts, so a moment's queue
               does not cost them the whole round's training), stale replicas and
               replicas without local data for the adapter do not take part; budgets under
               `min_budget_tokens` are dropped.

Z and h come from the signed virtual queue of the long-term attainment target (target.py): q <- q +
gain * (target - attainment). Z = max(0, q), so training yields to serving exactly while attainment falls
short, and V sets how much quality one unit of SLO risk is worth. While attainment stays above the target
q goes negative and the headroom h = min(1, headroom_gain * -q) grows: a share then counts only (1 - h)
of itself against serving capacity (here, in `usable_share` and in the fast loop's burst check), because
the SLO-aware co-scheduler trains only in the requests' slack and a share is an upper bound on training,
not time taken from serving. So the target binds from both sides: below it Z prices SLO risk, above it h
lets shares grow toward `max_share`, and the fast loop's spend (spend_gain x h) has the replicas train
part of each share beyond their requests' slack, until attainment comes down to the target.

Solution: greedy in steps of `share_step`: take the (adapter, replica) step with the largest marginal
gain while its gain exceeds the marginal penalty and the cap holds. The gain is concave in each x_a
and in each b_i, and the penalty is the same for every replica, so a lazy max-heap finds each best step
in O(log n): the plan for 256 replicas costs a few thousand heap operations.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from collm_coordinator.core.quality import effective_tokens, log_gain
from collm_coordinator.core.state import ClusterView
from collm_coordinator.core.types import ParticipantBudget, RoundPlanDecision, SkippedAdapter, SlowDecision


def risk(u: float) -> float:
    return math.inf if u >= 1.0 else u / (1.0 - u)


@dataclass
class _Candidate:
    adapter: str
    replica_id: str
    rate_per_s: float
    data_tokens: float
    share: float = 0.0
    # (share, effective tokens one more share step adds at that share): kept while the share holds.
    _step: tuple[float, float] | None = None

    def tokens(self, t_s: float, share: float | None = None) -> float:
        return (self.share if share is None else share) * t_s * self.rate_per_s

    def step_tokens(self, t_s: float, share_step: float) -> float:
        """Effective tokens that one more `share_step` of share adds to this candidate."""
        if self._step is None or self._step[0] != self.share:
            before = effective_tokens(self.tokens(t_s), self.data_tokens)
            after = effective_tokens(self.tokens(t_s, self.share + share_step), self.data_tokens)
            self._step = (self.share, after - before)
        return self._step[1]


def usable_share(view: ClusterView, replica_id: str) -> float:
    """The largest share replica `replica_id` can spend: the SLO-aware co-scheduler trains only in the
    time serving leaves, so a share that displaces more than 1 - load / util_cap (its serving load kept
    at or under the cap) is never spent there; with headroom h a share displaces (1 - h) of itself
    (`ClusterView.displaced`), so the room grows to `max_share` as h -> 1. At least one `share_step` (a
    replica is never shut out of a plan by its load alone: the fast loop's risk checks guard it) and at
    most `max_share`."""
    cfg = view.config
    load = view.infer_load.get(replica_id, 0.0)
    free = 1.0 - load / cfg.util_cap
    per = view.displaced(1.0)
    room = max(0.0, free) / per if per > 0 else cfg.max_share
    steps = math.floor(min(room, cfg.max_share) / cfg.share_step + 1e-9)
    return min(cfg.max_share, max(1, steps) * cfg.share_step)


def adapters_to_plan(view: ClusterView) -> tuple[list[tuple[str, int, list[str]]], list[SkippedAdapter]]:
    """(adapter, base version, candidate replicas) of every adapter that can start a round now."""
    ready: list[tuple[str, int, list[str]]] = []
    skipped: list[SkippedAdapter] = []
    for adapter in sorted(view.adapter_domains):
        if adapter in view.rounds:
            skipped.append(SkippedAdapter(adapter, f"round in flight ({view.rounds[adapter].state})"))
            continue
        version = view.versions.get(adapter)
        if not version:
            skipped.append(SkippedAdapter(adapter, "no version known (create v1 in the store first)"))
            continue
        candidates = view.replicas_for(adapter)
        if not candidates:
            skipped.append(SkippedAdapter(adapter, "no live replica holds local data for it"))
            continue
        ready.append((adapter, version, candidates))
    return ready, skipped


def make_plan(
    view: ClusterView,
    adapter: str,
    base_version: int,
    budgets: list[tuple[str, int, float, float, str]],
    reason: str,
) -> RoundPlanDecision:
    """A plan from (replica, tokens, share, expected gain, reason) rows."""
    cfg = view.config
    parts = tuple(ParticipantBudget(r, int(b), round(s, 3), g, why) for r, b, s, g, why in budgets)
    return RoundPlanDecision(
        adapter=adapter,
        base_version=base_version,
        participants=parts,
        quorum=max(1, math.ceil(cfg.quorum_frac * len(parts))),
        opened_s=view.now_s,
        deadline_s=view.now_s + cfg.round_deadline_s,
        learning_rate=cfg.learning_rate,
        expected_gain=sum(p.expected_gain for p in parts),
        reason=reason,
    )


# Below this expected loss decrease (nats) per share step, a step is not worth its interference.
MIN_GAIN_PER_STEP = 1e-6


class _Planning:
    """One slow tick's planning state: the replicas' shares (those of rounds in flight stay committed),
    the candidates (adapter, replica) with a known training speed and the probes without one, each
    adapter's planned effective tokens `x`, and the stop reason of the greedy allocation."""

    def __init__(self, view: ClusterView, ready: list[tuple[str, int, list[str]]]) -> None:
        self.view, self.cfg = view, view.config
        self.t_s = self.cfg.round_deadline_s
        self.share = {r: view.plan_shares.get(r, 0.0) for r in view.live}
        # The sum of 1 - share over the replicas, kept while `share` holds.
        self._free_sum: float | None = None
        self.cands: dict[tuple[str, str], _Candidate] = {}
        self.probes: list[tuple[str, str]] = []
        for adapter, _, replicas in ready:
            for rid in replicas:
                if rid in view.at_risk and view.headroom <= 0:
                    continue
                rate = view.train_rate_per_s.get(rid)
                if rate is None or rate <= 0:
                    self.probes.append((adapter, rid))
                    continue
                data = view.data_tokens.get((rid, adapter), 0.0)
                self.cands[(adapter, rid)] = _Candidate(adapter, rid, rate, data)
        self.room = {r: usable_share(view, r) for r in view.live}
        self.x = {a: 0.0 for a, _, _ in ready}
        # Per adapter: (gain coefficient weighted by its demand, tokens it has trained).
        self.coef = {
            a: (
                view.quality[a].gain_coefficient * view.adapter_demand.get(a, 1.0),
                view.quality[a].trained_tokens,
            )
            for a, _, _ in ready
        }
        self.stop = "no step adds quality"

    def util(self, extra: float = 0.0) -> float:
        if self._free_sum is None:
            self._free_sum = sum(1.0 - self.view.displaced(self.share[r]) for r in self.share)
        cap = self._free_sum - self.view.displaced(extra)
        return math.inf if cap <= 0 else self.view.forecast_demand / cap

    def marginal(self, c: _Candidate) -> float:
        k, trained = self.coef[c.adapter]
        dx = c.step_tokens(self.t_s, self.cfg.share_step)
        return log_gain(k, self.cfg.quality_token_scale, trained + self.x[c.adapter], dx)

    def fits(self, rid: str) -> bool:
        return self.share[rid] + self.cfg.share_step <= self.room[rid] + 1e-9

    def take_step(self, c: _Candidate) -> None:
        self.x[c.adapter] += c.step_tokens(self.t_s, self.cfg.share_step)
        c.share += self.cfg.share_step
        self.add_share(c.replica_id, self.cfg.share_step)

    def add_share(self, rid: str, share: float) -> None:
        self.share[rid] += share
        self._free_sum = None

    def greedy(self, V: float, Z: float) -> None:
        """Share steps by largest marginal gain (a lazy heap) while the gain pays the SLO-risk penalty, the
        replica has room and utilisation stays under the cap; `stop` says what ended it."""
        cfg = self.cfg
        heap: list[tuple[float, int, str, str]] = []
        seq = 0
        for key, c in self.cands.items():
            heapq.heappush(heap, (-self.marginal(c), seq, *key))
            seq += 1
        while heap:
            _, _, adapter, rid = heapq.heappop(heap)
            c = self.cands[(adapter, rid)]
            if not self.fits(rid):
                continue  # this replica is full; other adapters' candidates on it are skipped too
            g = self.marginal(c)
            if heap and g < -heap[0][0] - 1e-12:
                heapq.heappush(heap, (-g, seq, adapter, rid))  # lazy: stale priority, re-queue
                seq += 1
                continue
            if g < MIN_GAIN_PER_STEP:
                self.stop = "marginal quality gain below the floor"
                return
            u_now, u_next = self.util(), self.util(cfg.share_step)
            if u_next > cfg.util_cap:
                self.stop = f"utilisation would exceed cap {cfg.util_cap:.2f}"
                return
            penalty = Z * (risk(u_next) - risk(u_now))
            if V * g <= penalty:
                self.stop = f"gain {V * g:.4g} <= risk penalty {penalty:.4g}"
                return
            self.take_step(c)
            heapq.heappush(heap, (-self.marginal(c), seq, adapter, rid))
            seq += 1

    def starvation_floor(self, ready: list[tuple[str, int, list[str]]]) -> set[str]:
        """An adapter whose wait without a planned round would pass `starvation_floor_s` before the next
        slow tick gets one step now on its candidate with the largest marginal gain that has room, whatever
        the risk penalty; where no step fits (its replicas' shares are full, or one more step would pass
        the utilisation cap), it takes a turn in the training time a replica already has (`_floor_inside`).
        The adapters floored."""
        view, cfg = self.view, self.cfg
        floored: set[str] = set()
        for adapter, _, _ in ready:
            waited_s = view.now_s - view.last_planned_s.get(adapter, view.now_s)
            if self.x[adapter] > 0 or waited_s + cfg.slow_interval_s <= cfg.starvation_floor_s:
                continue
            mine = [c for (a, _), c in self.cands.items() if a == adapter]
            fits = [c for c in mine if self.fits(c.replica_id)]
            if fits and self.util(cfg.share_step) <= cfg.util_cap:
                self.take_step(max(fits, key=lambda c: (self.marginal(c), c.replica_id)))
                floored.add(adapter)
            elif (inside := _floor_inside(view, mine, self.share, self.cands)) is not None:
                self.x[adapter] += effective_tokens(inside.tokens(self.t_s), inside.data_tokens)
                floored.add(adapter)
        return floored

    def rows(self, adapter: str) -> list[tuple[str, int, float, float, str]]:
        """The adapter's participants: (replica, token budget, share, 0, why), probes included (a probe
        takes its share now)."""
        cfg, t_s = self.cfg, self.t_s
        rows: list[tuple[str, int, float, float, str]] = []
        for (a, rid), c in sorted(self.cands.items()):
            if a != adapter or c.share <= 0:
                continue
            tokens = round(c.tokens(t_s))
            if tokens < cfg.min_budget_tokens:
                continue
            e = effective_tokens(tokens, c.data_tokens)
            why = f"share {c.share:.2f} x {t_s:.0f}s x {c.rate_per_s:.0f} tok/s; {e:.0f} effective"
            rows.append((rid, tokens, c.share, 0.0, why))
        # Replicas whose training speed is unknown yet: a small probe teaches it (and still trains).
        for a, rid in self.probes:
            ps = min(cfg.probe_share, cfg.max_share - self.share.get(rid, 0.0))
            if a == adapter and ps > 0 and self.util(ps) <= cfg.util_cap:
                self.add_share(rid, ps)
                rows.append((rid, cfg.probe_budget_tokens, ps, 0.0, "probe: training speed unknown"))
        return rows


def collm_slow(view: ClusterView) -> SlowDecision:
    cfg = view.config
    V, Z = cfg.quality_weight_v, view.virtual_queue
    demand = view.forecast_demand
    ready, skipped = adapters_to_plan(view)
    pl = _Planning(view, ready)
    head = (
        f"forecast demand {demand:.2f} replicas, {len(view.live)} live, Z={Z:.3f}, "
        f"headroom {view.headroom:.2f}, V={V:g}, "
        f"utilisation {pl.util():.2f} (cap {cfg.util_cap:.2f})"
    )
    if not ready:
        return SlowDecision(
            (), tuple(skipped), demand, view.forecast_arrivals_per_s, Z, head + "; nothing to plan"
        )
    pl.greedy(V, Z)
    floored = pl.starvation_floor(ready)
    plans: list[RoundPlanDecision] = []
    for adapter, version, _ in ready:
        rows = pl.rows(adapter)
        if not rows:
            why_none = _why_none(view, adapter, pl.cands, pl.probes, pl.stop)
            skipped.append(SkippedAdapter(adapter, f"no participant: {why_none}"))
            continue
        q = view.quality[adapter]
        total_gain = log_gain(q.gain_coefficient, cfg.quality_token_scale, q.trained_tokens, pl.x[adapter])
        per = total_gain / len(rows)
        rows = [(r, b, s, per, why) for r, b, s, _, why in rows]
        floor = f"; starvation floor: no round for {cfg.starvation_floor_s:g} s" if adapter in floored else ""
        why = f"{head}; expected gain {total_gain:.4f} nats; stop: {pl.stop}{floor}"
        plans.append(make_plan(view, adapter, version, rows, why))
    return SlowDecision(
        tuple(plans), tuple(skipped), demand, view.forecast_arrivals_per_s, Z, f"{head}; stop: {pl.stop}"
    )


def _floor_inside(
    view: ClusterView,
    mine: list[_Candidate],
    share: dict[str, float],
    cands: dict[tuple[str, str], _Candidate],
) -> _Candidate | None:
    """A starved adapter's turn in training time a replica already has: of `mine` (its candidates) on
    replicas that train their whole `max_share` (rounds in flight and this plan's steps, `share`), one gets
    a share of that time as large as each of the replica's jobs gets when they take turns (its
    co-scheduler runs its jobs round-robin), in steps of `share_step`. The replica's share stays
    `max_share` (`ClusterState.plan_shares` caps the sum there), so serving loses nothing the plan had not
    already given to training. None: no holder trains its whole share (where serving bounds the share, the
    floor waits for room)."""
    cfg = view.config
    busy = [c for c in mine if share[c.replica_id] >= cfg.max_share - 1e-9]
    if not busy:
        return None
    c = max(busy, key=lambda c: (share[c.replica_id], c.replica_id))
    rid = c.replica_id
    in_flight = sum(
        1
        for rnd in view.rounds.values()
        if rid not in rnd.done and any(p.replica_id == rid for p in rnd.plan.participants)
    )
    planned = sum(1 for (a, r), o in cands.items() if r == rid and a != c.adapter and o.share > 0)
    turn = share[rid] / (in_flight + planned + 1)
    c.share = max(cfg.share_step, math.floor(turn / cfg.share_step + 1e-9) * cfg.share_step)
    return c


def _why_none(
    view: ClusterView,
    adapter: str,
    cands: dict[tuple[str, str], _Candidate],
    probes: list[tuple[str, str]],
    stop: str,
) -> str:
    """Why an adapter ended without a participant: its holders' risks, a refused probe, else the
    greedy's stop (its candidates got no share step, or their budgets fell under the minimum)."""
    holders = view.replicas_for(adapter)
    at_risk = [r for r in holders if r in view.at_risk]
    if at_risk and len(at_risk) == len(holders) and view.headroom <= 0:
        return (
            "every replica holding its data is at SLO risk ("
            + "; ".join(f"{r}: {view.at_risk[r]}" for r in at_risk)
            + ")"
        )
    mine = [rid for (a, rid), c in cands.items() if a == adapter]
    if not mine and any(a == adapter for a, _ in probes):
        return f"probe refused: its share would exceed the utilisation cap {view.config.util_cap:.2f}"
    if any(cands[(adapter, r)].share > 0 for r in mine):
        return f"budget under {view.config.min_budget_tokens} tokens"
    return stop
