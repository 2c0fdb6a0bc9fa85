"""CoLLM's fast loop: each replica's fine-tuning share and the gateway's routing weights, every tick.

Shares. The slow loop planned a share p_i for every round participant. Each tick the fast loop grants
at most that, and less at once when SLOs are at risk:

* a replica whose own SLOs are at risk (queue at or above `queue_risk_frac` x its batch, measured
  attainment under the target with `risk_attainment_z` sigmas of confidence, TTFT/TPOT p99 within
  `slo_risk_frac` of the SLO, serving load above `util_cap`) gets share 0 in this very tick
  (`slo_risk`);
* when the cluster's demand D (the mean of the last `burst_window_s`, or this second's demand over
  `burst_spike_factor` when that is larger, so a real burst counts in its first tick) exceeds the
  inference capacity left by the planned shares, burst_util * sum_i (1 - p_i) (p_i = 0 for replicas at
  risk; burst_util >= util_cap, because the plan already keeps a margin for ordinary fluctuation),
  every remaining planned share is scaled by the same factor f < 1 so that the capacity covers D again
  (`burst`): a share above f * p_i drops to it at once, one below it rises toward it by at most
  `share_recover_per_tick` per tick (a burst keeps training within the capacity D leaves; it does not
  pin a share that an SLO risk or a plan's start left at 0 there for as long as it lasts);
* otherwise a share rises back toward its plan by at most `share_recover_per_tick` per tick
  (`recovering`, then `slack`): decrease at once, increase gradually, so a burst that comes back does
  not meet replicas that already resumed full training. Such a share carries the cluster's spend
  (`AttainmentTarget` in target.py: spend_gain x headroom): the part of it the replica's co-scheduler trains
  beyond its requests' slack, at their latency's cost, which spends the SLO budget the attainment target
  leaves and so brings attainment down to it; a share cut by a risk or a burst carries none.

A replica that trains outside the plan (a running job of a round the coordinator did not plan: the
aggregator's built-in planner or an operator opened it; or a local job) gets the same rule with a target
instead of a plan: an even split of the slack the plan leaves at the forecast demand,
(sum_i (1 - p_i) - D_forecast / util_cap) / n_unplanned, floored to `share_step` and at most `max_share`
(0 when there is none). Its share is cut at once by SLO risk and bursts like a participant's and rises
back as gradually. The coordinator's own plan comes first: the slow loop sizes it without these jobs,
and their targets shrink as soon as it commits more.

Routing. The gateway's own rule without weights is least-loaded (join the shortest queue, with a penalty
for a non-resident adapter), and its rule with weights is a weighted random draw. Every replica runs the
SLO-aware co-scheduler under collm, so training yields to whatever load arrives and the instantaneous
balance of least-loaded matters more than steering load off training replicas: in simulation, published
weights cost 16-18% of goodput against the gateway's least-loaded rule at 60-75% of the estimated capacity
(bench/README.md, Simulator). So the collm
fast loop computes its weights every tick (decisions, `status`) but publishes them to the gateway only
with `publish_weights` (COLLM_COORDINATOR_PUBLISH_WEIGHTS=true). A replica's weight is h_i * (0.5 * c_i +
free_i), where c_i = 1 - share_i is the capacity it keeps for serving, free_i = max(0, util_cap * c_i -
load_i) its slack right now, and h_i = 1 / (1 + queue_i / batch_i), halved when its SLOs are at risk. So
load goes where there is slack and away from replicas that train or already queue. Per adapter, replicas
that hold the adapter keep their weight and the others get `non_resident_factor` of it (affinity saves an
adapter load and keeps fewer distinct adapters per batch). Stale replicas get no weight at all.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

from collm_coordinator.core.state import ClusterView
from collm_coordinator.core.types import FastDecision, RoutingDecision, ShareDecision


class SentShare(NamedTuple):
    """The last share command a replica accepted: its share, its spend and when it was sent."""

    share: float
    spend: float
    when_s: float


def share_command_due(last: SentShare | None, share: float, spend: float, now_s: float, ttl_s: float) -> bool:
    """Whether a replica's share is sent to it at this tick: never sent (`last`: the last one it accepted),
    share or spend changed by 1e-3 or more, or half its TTL old (so it never expires while the
    coordinator runs). An unchanged share is not sent every tick: a command reaching a replica ends its
    stretch of training at the next piece, as a new request does."""
    return (
        last is None
        or abs(last.share - share) >= 1e-3
        or abs(last.spend - spend) >= 1e-3
        or now_s - last.when_s >= ttl_s / 2
    )


def _q(x: float) -> float:
    return round(max(0.0, min(1.0, x)), 3)


def unplanned_targets(view: ClusterView) -> tuple[dict[str, float], str]:
    """The share each replica training outside the plan aims at (module docstring), and why."""
    cfg = view.config
    if not view.unplanned:
        return {}, ""
    free = sum(1.0 - view.plan_shares.get(r, 0.0) for r in view.live)
    slack = free - view.forecast_demand / cfg.util_cap
    each = max(0.0, min(cfg.max_share, slack / len(view.unplanned)))
    each = math.floor(each / cfg.share_step + 1e-9) * cfg.share_step
    why = (
        f"slack {max(0.0, slack):.2f} left by the plan at forecast demand {view.forecast_demand:.2f} "
        f"over {len(view.unplanned)} replica(s) training outside it"
    )
    return dict.fromkeys(view.unplanned, each), why


def collm_shares(view: ClusterView) -> tuple[list[ShareDecision], str]:
    cfg = view.config
    live = sorted(view.live)
    extra, extra_why = unplanned_targets(view)
    # What each replica aims at: its planned share, else its target as a replica training outside the plan.
    target = {r: view.plan_shares.get(r, 0.0) or extra.get(r, 0.0) for r in live}
    # Replicas at risk train nothing this tick, so their whole capacity counts toward the burst check.
    plan = {r: (0.0 if r in view.at_risk else target[r]) for r in live}
    # What the planned shares take from serving: (1 - h) of each with headroom h (ClusterView.displaced).
    displaced = sum(view.displaced(p) for p in plan.values())
    free = len(plan) - displaced
    capacity = cfg.burst_util * free
    factor = 1.0
    demand = max(view.demand_short, view.demand_now / cfg.burst_spike_factor)
    why = f"demand {demand:.2f} within capacity {capacity:.2f} at planned shares"
    if sum(plan.values()) > 0 and demand > capacity:
        needed = demand / cfg.burst_util - free
        factor = max(0.0, 1.0 - needed / displaced) if displaced > 0 else 0.0
        why = f"burst: demand {demand:.2f} > capacity {capacity:.2f} at planned shares; shares x{factor:.2f}"
    # The SLO budget left unspent, spent beyond the slack (target.py).
    spend = round(view.spend, 3)
    out: list[ShareDecision] = []
    for rid in live:
        p = target[rid]
        prev = view.prev_shares.get(rid, 0.0)
        risk = view.at_risk.get(rid)
        outside = view.unplanned.get(rid) if view.plan_shares.get(rid, 0.0) <= 0 else None
        aim = f"target {p:.2f} for {outside}" if outside else f"planned {p:.2f}"
        if outside and risk:
            out.append(ShareDecision(rid, 0.0, "slo_risk", f"{risk} (training {outside})"))
        elif outside and p <= 0:
            out.append(ShareDecision(rid, 0.0, "slack", f"no share for {outside}: {extra_why}"))
        elif p <= 0:
            out.append(ShareDecision(rid, 0.0, "idle", "not training in an open round"))
        elif risk:
            out.append(ShareDecision(rid, 0.0, "slo_risk", risk))
        elif factor < 1.0:
            # Down to the cut share at once; a share under it (after an SLO risk, or a plan that has
            # just begun) rises toward it as gradually as toward a plan, never past it.
            share = min(p * factor, prev + cfg.share_recover_per_tick)
            out.append(ShareDecision(rid, _q(share), "burst", f"{aim}, cut: {why}"))
        elif prev + cfg.share_recover_per_tick < p:
            share = prev + cfg.share_recover_per_tick
            out.append(ShareDecision(rid, _q(share), "recovering", f"rising toward {aim}", spend))
        else:
            out.append(ShareDecision(rid, _q(p), "slack", f"{aim}; {extra_why if outside else why}", spend))
    return out, why


def routing_weights(view: ClusterView, shares: dict[str, float], reason: str) -> RoutingDecision | None:
    """Weights toward slack (see module docstring); None when no replica is live."""
    cfg = view.config
    raw: dict[str, float] = {}
    for rid, obs in view.live.items():
        c = max(0.0, 1.0 - shares.get(rid, 0.0))
        free = max(0.0, cfg.util_cap * c - view.infer_load.get(rid, 0.0))
        h = 1.0 / (1.0 + obs.queue_len / max(1, obs.max_batch))
        if rid in view.at_risk:
            h *= 0.5
        raw[rid] = h * (0.5 * c + free)
    return normalised_routing(view, raw, reason)


def normalised_routing(view: ClusterView, raw: dict[str, float], reason: str) -> RoutingDecision | None:
    cfg = view.config
    if not view.live:
        return None
    total = sum(raw.values())
    if total <= 0:
        # Every live replica is fully committed: spread evenly rather than publish nothing.
        raw = dict.fromkeys(view.live, 1.0)
        total = float(len(raw))
        reason = f"{reason}; no replica has serving capacity left: even weights"
    weights = {r: round(w / total, 4) for r, w in sorted(raw.items())}
    adapter_weights: dict[str, dict[str, float]] = {}
    adapters = sorted({a.name for o in view.live.values() for a in o.adapters})
    for name in adapters:
        aw = {}
        for rid, w in weights.items():
            resident = any(a.name == name for a in view.live[rid].adapters)
            aw[rid] = w if resident else w * cfg.non_resident_factor
        s = sum(aw.values())
        if s > 0:
            adapter_weights[name] = {r: round(w / s, 4) for r, w in aw.items()}
    return RoutingDecision(weights, adapter_weights, cfg.routing_ttl_s, reason)


def collm_fast(view: ClusterView) -> FastDecision:
    shares, why = collm_shares(view)
    by_id = {s.replica_id: s.share for s in shares}
    routing = routing_weights(view, by_id, "toward slack and resident adapters")
    if routing is not None and not view.config.publish_weights:
        routing = replace(routing, publish=False)
    stale = f"; routed around stale {','.join(view.stale)}" if view.stale else ""
    return FastDecision(tuple(shares), routing, view.config.share_ttl_s, why + stale)
