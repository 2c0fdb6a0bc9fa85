"""The two arrival rates of the benchmark, found with the simulator (pure: attainment comes in as a function).

Rates are not picked to flatter any policy: they are defined by the *best baseline* (the baseline with
the highest SLO attainment at that rate):

* light: the highest rate at which the best baseline keeps >= 95% attainment;
* heavy: the rate at which the best baseline sits nearest 85%: of the last request count at or above
  85% and the first below it (on the way up), the one whose attainment is nearer 85%.

A replayed slice at rate R over D seconds is the N = round(R x D) consecutive trace requests
time-scaled into D, so the search runs over the integer N: a grid of N from fractions of the estimated
cluster capacity, scanned upward to the first N where the best baseline falls below the target (the
grid is extended downward by halving when even its lowest point is below), then bisection on N
between the last point at or above the target and that first point below it, down to neighbouring N
(`rate_search.search` with `rate_search.count_bisection`).
The answer is the largest N known to hold the target on the way up; the best baseline's attainment
there is reported with it. Simulated attainment is not monotone in the rate at this scale (a few dozen
requests), hence "first crossing", not "any rate that holds".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .rate_search import count_bisection, search

# attainment(policy, n_requests) -> SLO attainment of that policy's simulated run.
AttainmentFn = Callable[[str, int], float]


@dataclass(frozen=True)
class RateChoice:
    label: str
    target: float
    n_requests: int
    rate_rps: float
    best_baseline: str
    attainment: float
    by_policy: dict[str, float]
    how: str
    evaluated: list[tuple[int, str, float]] = field(default_factory=list)  # (n, best baseline, attainment)

    def as_dict(self) -> dict[str, object]:
        return {
            "label": self.label,
            "target": self.target,
            "n_requests": self.n_requests,
            "rate_rps": self.rate_rps,
            "best_baseline": self.best_baseline,
            "attainment": self.attainment,
            "by_policy": self.by_policy,
            "how": self.how,
            "evaluated": [list(e) for e in self.evaluated],
        }


class BestBaseline:
    """The best baseline's attainment at N requests, memoised (each point costs one simulation per
    baseline)."""

    def __init__(self, attainment: AttainmentFn, baselines: Sequence[str]) -> None:
        if not baselines:
            raise ValueError("no baselines to search with")
        self.attainment = attainment
        self.baselines = tuple(baselines)
        self.cache: dict[int, dict[str, float]] = {}

    def at(self, n: int) -> tuple[str, float, dict[str, float]]:
        if n not in self.cache:
            self.cache[n] = {b: float(self.attainment(b, n)) for b in self.baselines}
        by = self.cache[n]
        best = max(self.baselines, key=lambda b: (by[b], -self.baselines.index(b)))
        return best, by[best], dict(by)


def grid_counts(capacity_rps: float, duration_s: float, fractions: Sequence[float]) -> list[int]:
    """Distinct request counts N >= 1 of rates at `fractions` of the estimated capacity."""
    if not capacity_rps > 0 or not duration_s > 0:
        raise ValueError("capacity and duration must be > 0")
    return sorted({max(1, round(f * capacity_rps * duration_s)) for f in fractions if f > 0})


def search_rate(
    best: BestBaseline,
    label: str,
    target: float,
    grid: Sequence[int],
    duration_s: float,
    max_halvings: int = 6,
    nearest: bool = False,
) -> RateChoice:
    """The largest N (first crossing) at which the best baseline keeps attainment >= target
    (`rate_search.search` over the grid, `count_bisection`); with `nearest`, whichever of that N and the
    next one (the first below the target) is nearer the target."""
    if not grid:
        raise ValueError("empty rate grid")
    counts = sorted(set(grid))
    crossing = search(lambda n: best.at(n)[1], target, counts, count_bisection(max_halvings))
    evaluated = [(n, best.at(n)[0], a) for n, a in crossing.tried]
    lo, hi = crossing.meets, crossing.misses
    if lo is None:
        n = hi if hi is not None else counts[0]
        b, a, by = best.at(n)
        return RateChoice(
            label, target, n, n / duration_s, b, a, by,
            f"below {target:.0%} even at {n} requests ({n / duration_s:.3g} req/s): the lowest rate tried",
            evaluated,
        )  # fmt: skip
    if hi is None:
        how = f">= {target:.0%} up to the highest grid rate ({lo / duration_s:.3g} req/s): a lower bound"
    else:
        how = (
            f"first crossing of {target:.0%} between {lo} and {hi} requests in {duration_s:g} s "
            f"(bisection on the request count)"
        )
        if nearest and abs(best.at(hi)[1] - target) < abs(best.at(lo)[1] - target):
            lo = hi
            how += f"; {hi} is the nearer to {target:.0%}"
    b, a, by = best.at(lo)
    return RateChoice(label, target, lo, lo / duration_s, b, a, by, how, evaluated)


def capacity_estimate_rps(
    prefill_ms_per_token: float,
    decode_ms_full_batch: float,
    max_batch: int,
    lora_overhead_frac: float,
    mean_input_tokens: float,
    mean_output_tokens: float,
    replicas: int,
) -> float:
    """Requests/s the cluster serves at full batch efficiency for these mean lengths: the one capacity
    formula, which only places the headline's search grid and the frontier's loads (the searches
    themselves run the simulator)."""
    per_req_ms = mean_input_tokens * prefill_ms_per_token
    per_req_ms += max(0.0, mean_output_tokens - 1) * decode_ms_full_batch / max(1, max_batch)
    per_req_ms *= 1.0 + lora_overhead_frac
    if per_req_ms <= 0:
        return math.inf
    return replicas * 1000.0 / per_req_ms


def calibrated_capacity_rps(
    cal: Any, max_batch: int, mean_input_tokens: float, mean_output_tokens: float, replicas: int
) -> float:
    """`capacity_estimate_rps` at a calibration's costs (its decode step at `max_batch`)."""
    return capacity_estimate_rps(
        cal.cost.prefill_ms_per_token,
        cal.cost.decode_ms(max_batch),
        max_batch,
        cal.cost.lora_overhead_frac_per_adapter,
        mean_input_tokens,
        mean_output_tokens,
        replicas,
    )


def workload_capacity_rps(cal: Any, wl: Any, max_batch: int, replicas: int) -> float:
    """`calibrated_capacity_rps` for a simulator workload's mean lengths."""
    return calibrated_capacity_rps(
        cal, max_batch, float(wl.input_tokens.mean()), float(wl.output_tokens.mean()), replicas
    )
