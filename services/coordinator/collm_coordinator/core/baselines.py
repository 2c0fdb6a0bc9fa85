"""The baselines CoLLM is measured against, behind the same interface as the two-timescale policy.

* `separate`: today's practice, a serving cluster beside a federated-training cluster. A static split
  of the known replicas (sorted by id; `separate_train_frac` of them, at least one on each side, chosen
  to cover as many data domains as possible) trains only (share 1, routing weight 0); the rest serves
  only (share 0, even routing weights). Rounds use the training replicas alone, each with the budget
  it can train in a round at full speed.
* `fixed_ratio`: co-located as Loquetier does it: K inference iterations per training step, expressed
  as the fixed share 1/(K+1) on every replica with local data (the replica's `fixed` co-scheduler
  runs one step every K iterations). No routing weights: the gateway routes least-loaded.
* `leftover`: co-located as FlexLLM does it on one GPU: training fills whatever inference leaves on
  each replica (share `leftover_share`, the replica's `leftover` co-scheduler decides per iteration),
  least-loaded routing in the gateway, no cross-replica coordination: no weights, no forecast.

All of them plan a round for every trainable adapter every slow tick, with every eligible live replica,
budget = share x round length x training speed (a probe budget while the speed is unknown); none uses
the virtual queue. `fixed_ratio` and `leftover` give their fixed share to a replica training outside
their plan too (a round the aggregator's built-in planner or an operator opened, or a local job), as a
co-located system trains whatever job it runs; `separate` keeps its split, so its serving replicas never
train. Stale replicas are dropped from plans and (where weights are published) routed
around, as in every policy.
"""

from __future__ import annotations

from collm_coordinator.core.fast_loop import normalised_routing
from collm_coordinator.core.slow_loop import adapters_to_plan, make_plan
from collm_coordinator.core.state import ClusterView
from collm_coordinator.core.types import (
    FastDecision,
    ReasonCode,
    RoundPlanDecision,
    ShareDecision,
    SkippedAdapter,
    SlowDecision,
)


def fixed_budget_plans(view: ClusterView, share: float, allowed: set[str] | None, label: str) -> SlowDecision:
    cfg = view.config
    ready, skipped = adapters_to_plan(view)
    plans: list[RoundPlanDecision] = []
    for adapter, version, replicas in ready:
        rows: list[tuple[str, int, float, float, str]] = []
        for rid in replicas:
            if allowed is not None and rid not in allowed:
                continue
            rate = view.train_rate_per_s.get(rid)
            if rate is None or rate <= 0:
                rows.append((rid, cfg.probe_budget_tokens, share, 0.0, f"{label}; probe: speed unknown"))
                continue
            tokens = round(share * cfg.round_deadline_s * rate)
            if tokens >= cfg.min_budget_tokens:
                rows.append(
                    (rid, tokens, share, 0.0, f"{label}: share {share:.2f} x {cfg.round_deadline_s:.0f}s")
                )
        if rows:
            plans.append(make_plan(view, adapter, version, rows, f"{label}: every eligible replica"))
        else:
            skipped.append(SkippedAdapter(adapter, f"{label}: no eligible replica"))
    return SlowDecision(
        tuple(plans), tuple(skipped), view.demand_now, view.arrivals_now_per_s, 0.0, f"{label}: fixed plan"
    )


def fixed_shares(view: ClusterView, share: float, code: ReasonCode, why: str) -> tuple[ShareDecision, ...]:
    out = []
    for rid in sorted(view.live):
        if view.plan_shares.get(rid, 0.0) > 0:
            out.append(ShareDecision(rid, round(share, 3), code, why))
        elif rid in view.unplanned:
            out.append(ShareDecision(rid, round(share, 3), code, f"{why}; training {view.unplanned[rid]}"))
        else:
            out.append(ShareDecision(rid, 0.0, "idle", "not training in an open round"))
    return tuple(out)


class FixedRatioPolicy:
    name = "fixed_ratio"

    def fast(self, view: ClusterView) -> FastDecision:
        k = view.config.fixed_ratio_k
        share = view.config.fixed_share
        why = f"{k} inference iterations per training step: share 1/{k + 1}"
        return FastDecision(fixed_shares(view, share, "fixed_ratio", why), None, view.config.share_ttl_s, why)

    def slow(self, view: ClusterView) -> SlowDecision:
        return fixed_budget_plans(view, view.config.fixed_share, None, "fixed_ratio")


class LeftoverPolicy:
    name = "leftover"

    def fast(self, view: ClusterView) -> FastDecision:
        share = view.config.leftover_share
        why = "training fills what inference leaves (replica-local); least-loaded routing in the gateway"
        return FastDecision(fixed_shares(view, share, "leftover", why), None, view.config.share_ttl_s, why)

    def slow(self, view: ClusterView) -> SlowDecision:
        return fixed_budget_plans(view, view.config.leftover_share, None, "leftover")


def separate_split(view: ClusterView) -> set[str]:
    """The static training set: deterministic in the known replica ids and their domains."""
    known = list(view.known)
    n = len(known)
    if n < 2:
        return set()
    n_train = min(n - 1, max(1, round(view.config.separate_train_frac * n)))
    latest = view.live
    by_domain: dict[str, list[str]] = {}
    for rid in known:
        obs = latest.get(rid)
        for d in obs.domains if obs is not None else ():
            by_domain.setdefault(d, []).append(rid)
    chosen: list[str] = []
    # Round-robin over domains first, so the training side holds as many domains' data as it can.
    lists = [by_domain[d] for d in sorted(by_domain)]
    i = 0
    while len(chosen) < n_train and any(lists):
        lst = lists[i % len(lists)]
        while lst and lst[0] in chosen:
            lst.pop(0)
        if lst:
            chosen.append(lst.pop(0))
        i += 1
    for rid in known:
        if len(chosen) >= n_train:
            break
        if rid not in chosen:
            chosen.append(rid)
    return set(chosen)


class SeparatePolicy:
    name = "separate"

    def __init__(self) -> None:
        self._split: set[str] | None = None
        self._known: tuple[str, ...] = ()

    def train_set(self, view: ClusterView) -> set[str]:
        # Static: fixed once the membership is known; recomputed only when replicas join or leave.
        if self._split is None or view.known != self._known:
            self._split = separate_split(view)
            self._known = view.known
        return self._split

    def fast(self, view: ClusterView) -> FastDecision:
        train = self.train_set(view)
        shares = []
        for rid in sorted(view.live):
            if rid in train:
                shares.append(
                    ShareDecision(
                        rid, round(view.config.max_share, 3), "train_only", "training side of the split"
                    )
                )
            else:
                shares.append(ShareDecision(rid, 0.0, "serve_only", "serving side of the split"))
        serving = [r for r in view.live if r not in train]
        raw = {r: (1.0 if r in serving else 0.0) for r in view.live}
        why = f"static split: {len(train)} train, {len(view.known) - len(train)} serve"
        routing = normalised_routing(view, raw, why)
        return FastDecision(tuple(shares), routing, view.config.share_ttl_s, why)

    def slow(self, view: ClusterView) -> SlowDecision:
        return fixed_budget_plans(view, view.config.max_share, self.train_set(view), "separate")
