"""The frontier's arithmetic (pure): knob grids, points, Pareto dominance, each policy's frontier,
readings of one metric where another reaches a level, and the goals.

A point is one run of one policy at one knob setting: its SLO attainment, goodput (good requests / run
duration, req/s), fine-tuning tokens and mean served quality gain (nats per token; docs/architecture.md,
Goodput and SLO attainment, Served quality). Every metric is higher-is-better. A missing metric (None: a
run that served no joined request has no quality gain) is worse than any value.

Readings on a frontier treat the knob as continuous: between two frontier points, a metric is read by
linear interpolation along the segment joining them (`value_at`); "at least x" (`best_at_least`) is the
best the frontier reaches with the other metric >= x, the segment's crossing of x included.

Goals (`evaluate_goals`), with serving-alone = the `serving_only` reference run (collm's coordinator,
fine-tuning off on every replica):

* at SLO attainment >= 0.9 x serving-alone's, collm's fine-tuning tokens >= 2 x the best baseline's
  (the baseline whose frontier trains the most there; a policy none of whose knobs attains that much
  counts 0 there), and its time-to-quality <= 0.5 x the best baseline's (`time_to_quality`: the
  baseline's minutes over collm's >= 2);
* at equal quality gain (the highest gain both frontiers reach), collm's goodput >= 3 x separate's
  and >= 1.3 x the best co-located baseline's (of fixed_ratio and leftover, the one collm leads by the
  least).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from collm_bench.experiment.config import BASELINES, CO_LOCATED
from collm_bench.experiment.rate_search import geometric_bisection, search
from collm_common.stats import ratio
from collm_coordinator.core.config import CoreConfig

SERVING_ALONE = "serving_only"
# The axes of the trade-off each policy's frontier is drawn on: serving (goodput) against training
# (served quality gain), and attainment against fine-tuning tokens.
QUALITY_AXES = ("quality_gain_nats", "goodput_rps")
TRAINING_AXES = ("slo_attainment", "finetune_tokens")
ATTAINMENT_FRACTION = 0.9
GOALS: dict[str, float] = {
    "finetune_tokens_vs_best_baseline": 2.0,
    "time_to_quality_vs_best_baseline": 2.0,
    "goodput_vs_separate": 3.0,
    "goodput_vs_best_colocated": 1.3,
}
# Knob grids (the coordinator's names, `collm_coordinator.core.config.CoreConfig`).
FIXED_RATIO_SHARES = (0.05, 0.1, 0.2, 1 / 3, 0.5)
SEPARATE_TRAIN_FRACS = (0.125, 0.25, 0.375, 0.5)
COLLM_QUALITY_WEIGHTS = (5.0, 20.0, 80.0)
COLLM_ATTAINMENT_TARGETS = (0.9, 0.95, 0.98)


@dataclass(frozen=True)
class Knob:
    """One setting of one policy: `core` are CoreConfig overrides (`fixed_ratio_k` also sets the
    replicas' fixed co-scheduler, as the services share COLLM_FIXED_RATIO_K)."""

    policy: str
    label: str
    core: Mapping[str, float | int] = field(default_factory=dict)


def _fixed_ratio_label(k: int) -> str:
    return f"K={k} (share {1 / (k + 1):.2f})"


def fixed_ratio_knobs(shares: Sequence[float] = FIXED_RATIO_SHARES) -> list[Knob]:
    """Training share s of the fixed-ratio baseline as its K (one training step per K inference
    iterations: share 1/(K+1)), K = round(1/s - 1) >= 1; shares giving the same K run once."""
    out: dict[int, Knob] = {}
    for s in shares:
        if not 0 < s <= 0.5:
            raise ValueError(f"fixed_ratio's training share must be in (0, 0.5] (got {s})")
        k = max(1, round(1 / s - 1))
        out.setdefault(k, Knob("fixed_ratio", _fixed_ratio_label(k), {"fixed_ratio_k": k}))
    return sorted(out.values(), key=lambda kn: -int(kn.core["fixed_ratio_k"]))


def separate_knobs(replicas: int, fracs: Sequence[float] = SEPARATE_TRAIN_FRACS) -> list[Knob]:
    """Training replicas of the static split: round(f x replicas), at least one and at most all but
    one (`separate_split`); fractions giving the same count run once. None with fewer than 2 replicas."""
    if replicas < 2:
        return []
    counts = sorted({min(replicas - 1, max(1, round(f * replicas))) for f in fracs})
    return [
        Knob("separate", f"{n} of {replicas} train", {"separate_train_frac": n / replicas}) for n in counts
    ]


def collm_knobs(
    weights: Sequence[float] = COLLM_QUALITY_WEIGHTS, targets: Sequence[float] = COLLM_ATTAINMENT_TARGETS
) -> list[Knob]:
    """The two-timescale policy's quality weight V and long-term attainment target, every pair."""
    return [
        Knob("collm", f"V={v:g}, target {a:g}", {"quality_weight_v": v, "attainment_target": a})
        for a in targets
        for v in weights
    ]


def knob_grid(
    policies: Sequence[str],
    replicas: int,
    fixed_shares: Sequence[float] = FIXED_RATIO_SHARES,
    separate_fracs: Sequence[float] = SEPARATE_TRAIN_FRACS,
    collm_weights: Sequence[float] = COLLM_QUALITY_WEIGHTS,
    collm_targets: Sequence[float] = COLLM_ATTAINMENT_TARGETS,
) -> list[Knob]:
    """Every (policy, knob) to run, in the order of `policies`; `leftover` and `serving_only` run as
    they are (leftover grants the share 1: training fills whatever inference leaves)."""
    out: list[Knob] = []
    for p in policies:
        if p == "fixed_ratio":
            out += fixed_ratio_knobs(fixed_shares)
        elif p == "separate":
            out += separate_knobs(replicas, separate_fracs)
        elif p == "collm":
            out += collm_knobs(collm_weights, collm_targets)
        elif p == "leftover":
            out.append(Knob("leftover", "share 1 (as is)"))
        elif p == SERVING_ALONE:
            out.append(Knob(SERVING_ALONE, "fine-tuning off"))
        else:
            raise ValueError(f"no knob grid for {p!r}")
    return out


def default_knobs(policies: Sequence[str], replicas: int) -> list[Knob]:
    """One point per policy at the settings it runs with when nobody sets its knob (the coordinator's
    CoreConfig defaults: collm's V and target, fixed_ratio's K, separate's split): the headline
    preset. The label names the setting; `core` is empty, so the services' own defaults apply."""
    d = CoreConfig()
    grid = {k.policy: k for k in separate_knobs(replicas, (d.separate_train_frac,))}  # none below 2
    grid["collm"] = Knob("collm", f"V={d.quality_weight_v:g}, target {d.attainment_target:g}")
    grid["fixed_ratio"] = Knob("fixed_ratio", _fixed_ratio_label(d.fixed_ratio_k))
    out = []
    for p in policies:
        if p in grid:
            out.append(Knob(p, f"{grid[p].label} (default)"))
        elif p in ("leftover", SERVING_ALONE):
            out += knob_grid((p,), replicas)  # they have no knob
        elif p != "separate":
            raise ValueError(f"no default setting for {p!r}")
    return out


@dataclass(frozen=True)
class Point:
    policy: str
    knob: str
    slo_attainment: float | None
    goodput_rps: float | None
    finetune_tokens: float | None
    quality_gain_nats: float | None
    n_requests: int
    core: Mapping[str, float | int] = field(default_factory=dict)

    def get(self, metric: str) -> float:
        """The metric, -inf when missing (worse than any value)."""
        v = getattr(self, metric)
        return -math.inf if v is None else float(v)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"core": dict(self.core)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Point:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


# A point's served quality over its window: per minute, [s, gain of each domain] as they stood at the
# minute's last publication (gains only grow); its time-to-quality readings are to the minute.
Curve = Sequence[Sequence[float]]


def quality_curve(
    timeline: Iterable[tuple[float, Mapping[str, float]]], domains: Sequence[str]
) -> list[list[float]]:
    """A run's gains after each publication ((s, {domain: gain})) as a `Curve`."""
    by_minute: dict[int, tuple[float, Mapping[str, float]]] = {}
    for t, gains in timeline:
        by_minute[int(t // 60)] = (t, gains)
    return [
        [round(t, 1), *(round(float(gains.get(d, 0.0)), 4) for d in domains)]
        for t, gains in (by_minute[m] for m in sorted(by_minute))
    ]


def minutes_to(curve: Curve, gains: Sequence[float]) -> float | None:
    """Minutes until every domain's served gain reaches `gains` (its served loss the one those gains
    give), None if one never does in the window."""
    for t, *g in curve:
        if all(have >= want - 1e-9 for have, want in zip(g, gains, strict=True)):
            return float(t) / 60.0
    return None


def final_gains(curve: Curve) -> list[float]:
    return list(curve[-1][1:]) if curve else []


def mean_final_gain(curve: Curve) -> float:
    """The mean over domains of a curve's final served gains: which of two runs ends better."""
    g = final_gains(curve)
    return sum(g) / len(g) if g else 0.0


def json_text(doc: Mapping[str, Any]) -> str:
    """A result file's text: JSON indented by one, each list of plain numbers, and each list of those
    (a curve), on one line."""
    flat = re.sub(
        r"\[\s+([-0-9., \n]*?)\s+\]",
        lambda m: "[" + re.sub(r"\s+", "", m.group(1)) + "]",
        json.dumps(doc, indent=1, default=str),
    )
    # ... and each list of such lists (a curve) on one line too.
    return re.sub(
        r"\[\s+((?:\[[-0-9.,]*\],?\s*)+?)\s*\]",
        lambda m: "[" + re.sub(r"\s+", "", m.group(1)) + "]",
        flat,
    )


def dominates(a: Point, b: Point, axes: Sequence[str]) -> bool:
    """a is at least as good as b on every axis and better on one."""
    va, vb = [a.get(m) for m in axes], [b.get(m) for m in axes]
    return all(x >= y for x, y in zip(va, vb, strict=True)) and any(
        x > y for x, y in zip(va, vb, strict=True)
    )


def frontier(points: Iterable[Point], axes: Sequence[str]) -> list[Point]:
    """The points no other point dominates on `axes` whose metrics are all known, sorted by the first
    axis (ties: by the second), duplicates of one position kept once."""
    pts = [p for p in points if all(getattr(p, m) is not None for m in axes)]
    front: list[Point] = []
    seen: set[tuple[float, ...]] = set()
    for p in pts:
        key = tuple(p.get(m) for m in axes)
        if key in seen or any(dominates(q, p, axes) for q in pts):
            continue
        seen.add(key)
        front.append(p)
    return sorted(front, key=lambda p: tuple(p.get(m) for m in axes))


@dataclass(frozen=True)
class Reading:
    """A metric read off a frontier: the value and how it was had, or None and why not."""

    value: float | None
    how: str

    def as_dict(self) -> dict[str, Any]:
        return {"value": self.value, "how": self.how}


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def value_at(front: Sequence[Point], x_axis: str, x: float, y_axis: str) -> Reading:
    """`y_axis` at `x_axis` = x along a frontier sorted by `x_axis` (`frontier(points, (x_axis,
    y_axis))`): a point's own value when one lies at x, else linear interpolation between the two
    neighbours; None when x lies outside the frontier's range."""
    if not front:
        return Reading(None, "no frontier point")
    xs = [p.get(x_axis) for p in front]
    if x < xs[0] or x > xs[-1]:
        return Reading(
            None, f"no overlap: {x_axis} {_fmt(x)} outside the frontier's [{_fmt(xs[0])}, {_fmt(xs[-1])}]"
        )
    for p, px in zip(front, xs, strict=True):
        if px == x:
            return Reading(p.get(y_axis), f"{p.policy} {p.knob}")
    i = next(i for i, px in enumerate(xs) if px > x)
    a, b = front[i - 1], front[i]
    f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    y = a.get(y_axis) + f * (b.get(y_axis) - a.get(y_axis))
    return Reading(y, f"interpolated between {a.knob} and {b.knob}")


def best_at_least(points: Iterable[Point], x_axis: str, x_min: float, y_axis: str) -> Reading:
    """The most of `y_axis` a policy's frontier reaches with `x_axis` >= x_min: its best point there, or
    where the frontier's segment crosses x_min when that is higher; None when no point reaches x_min."""
    front = frontier(points, (x_axis, y_axis))
    if not front:
        return Reading(None, f"no point with both {x_axis} and {y_axis}")
    ok = [p for p in front if p.get(x_axis) >= x_min]
    if not ok:
        top = max(p.get(x_axis) for p in front)
        return Reading(None, f"no point reaches {x_axis} >= {_fmt(x_min)} (best {_fmt(top)})")
    best = max(ok, key=lambda p: p.get(y_axis))
    out = Reading(best.get(y_axis), f"{best.policy} {best.knob}")
    crossing = value_at(front, x_axis, x_min, y_axis)
    if crossing.value is not None and out.value is not None and crossing.value > out.value:
        return crossing
    return out


def by_policy(points: Iterable[Point]) -> dict[str, list[Point]]:
    out: dict[str, list[Point]] = {}
    for p in points:
        out.setdefault(p.policy, []).append(p)
    return out


def serving_alone_attainment(points: Iterable[Point]) -> float | None:
    alone = [p.slo_attainment for p in points if p.policy == SERVING_ALONE and p.slo_attainment is not None]
    return max(alone) if alone else None


def _goal(name: str, value: float | None, reason: str | None, **figures: Any) -> dict[str, Any]:
    target = GOALS[name]
    reached = None if value is None else value >= target
    return {"goal": target, "ratio": value, "reached": reached, "reason": reason, **figures}


def _constrained_goal(
    name: str, pols: Mapping[str, list[Point]], threshold: float | None, metric: str
) -> dict[str, Any]:
    """collm's most `metric` at attainment >= threshold over the best baseline's there. A policy none of
    whose knobs reaches the threshold counts 0 there (it cannot train at that attainment with them)."""
    if threshold is None:
        return _goal(name, None, f"no {SERVING_ALONE} run: the attainment floor is unknown")
    if "collm" not in pols:
        return _goal(name, None, "no collm run")
    readings = {}
    for p in ("collm", *BASELINES):
        if p not in pols:
            continue
        r = best_at_least(pols[p], "slo_attainment", threshold, metric)
        readings[p] = r if r.value is not None else Reading(0.0, f"counted 0: {r.how}")
    figures: dict[str, Any] = {
        "attainment_floor": threshold,
        "readings": {p: r.as_dict() for p, r in readings.items()},
    }
    base = {b: r for b, r in readings.items() if b != "collm"}
    if not base:
        return _goal(name, None, "no baseline run", best_baseline=None, **figures)
    best = max(base, key=lambda b: base[b].value or 0.0)
    c = readings["collm"]
    r = ratio(c.value, base[best].value)
    why = None if r is not None else f"collm {c.how}; {best} {base[best].how}"
    return _goal(name, r, why, best_baseline=best, **figures)


def _time_to_quality_goal(
    points: Sequence[Point], curves: Mapping[tuple[str, str], Curve | None], floor: float | None
) -> dict[str, Any]:
    """Time-to-quality at attainment >= floor: the best baseline point there (the one whose served
    gains end highest, by their mean) takes `baseline_min` to its final served loss; collm's points
    there take `collm_min` at best to reach it; the ratio baseline_min / collm_min (inf: no baseline
    point at the floor, or collm there at once; 0: collm never gets there in the window)."""
    name = "time_to_quality_vs_best_baseline"
    if floor is None:
        return _goal(name, None, f"no {SERVING_ALONE} run: the attainment floor is unknown")
    if not any(curves.get((p.policy, p.knob)) for p in points):
        return _goal(name, None, "no quality curves in this result file")
    at_floor = [p for p in points if p.get("slo_attainment") >= floor and curves.get((p.policy, p.knob))]
    mine = [p for p in at_floor if p.policy == "collm"]
    if not mine:
        return _goal(name, 0.0, None, attainment_floor=floor, best_baseline=None, collm_min=None)
    base = [p for p in at_floor if p.policy in BASELINES]
    if not base:
        return _goal(name, math.inf, None, attainment_floor=floor, best_baseline=None, collm_min=None)

    best = max(base, key=lambda p: mean_final_gain(curves[p.policy, p.knob] or []))
    target = final_gains(curves[best.policy, best.knob] or [])
    base_min = minutes_to(curves[best.policy, best.knob] or [], target)
    got = [m for p in mine if (m := minutes_to(curves[p.policy, p.knob] or [], target)) is not None]
    collm_min = min(got) if got else None
    r = 0.0 if collm_min is None else (math.inf if collm_min <= 0 else (base_min or 0.0) / collm_min)
    return _goal(
        name,
        r,
        None,
        attainment_floor=floor,
        best_baseline=best.policy,
        baseline_knob=best.knob,
        baseline_min=base_min,
        collm_min=collm_min,
    )


def equal_quality(a: Sequence[Point], b: Sequence[Point]) -> dict[str, Any]:
    """Goodput of a and b at the highest served quality gain both reach (`best_at_least` of each at
    it), and their ratio; None with a reason when either has no point with a quality gain."""
    tops = []
    for name, pts in (("a", a), ("b", b)):
        q = [
            p.quality_gain_nats for p in pts if p.quality_gain_nats is not None and p.goodput_rps is not None
        ]
        if not q:
            return {"level": None, "ratio": None, "reason": f"{name}: no point with a quality gain"}
        tops.append(max(q))
    level = min(tops)
    ra = best_at_least(a, "quality_gain_nats", level, "goodput_rps")
    rb = best_at_least(b, "quality_gain_nats", level, "goodput_rps")
    r = ratio(ra.value, rb.value)
    return {
        "level": level,
        "a": ra.as_dict(),
        "b": rb.as_dict(),
        "ratio": r,
        "reason": None if r is not None else "no goodput ratio at that quality gain",
    }


def evaluate_goals(
    points: Sequence[Point], curves: Mapping[tuple[str, str], Curve | None] | None = None
) -> dict[str, dict[str, Any]]:
    """Every goal (`GOALS`) with its ratio, whether it is reached (None: it cannot be told, `reason`
    says why) and the figures behind it. `curves`: each point's served quality curve by (policy, knob)
    (`quality_curve`), for time-to-quality."""
    pols = by_policy(points)
    alone = serving_alone_attainment(points)
    floor = None if alone is None else ATTAINMENT_FRACTION * alone
    out = {
        "finetune_tokens_vs_best_baseline": _constrained_goal(
            "finetune_tokens_vs_best_baseline", pols, floor, "finetune_tokens"
        ),
        "time_to_quality_vs_best_baseline": _time_to_quality_goal(points, curves or {}, floor),
    }
    for name, against in (("goodput_vs_separate", ("separate",)), ("goodput_vs_best_colocated", CO_LOCATED)):
        present = [b for b in against if b in pols]
        if "collm" not in pols or not present:
            out[name] = _goal(name, None, f"needs collm and one of {', '.join(against)}")
            continue
        each = {b: equal_quality(pols["collm"], pols[b]) for b in present}
        known = {b: e for b, e in each.items() if e["ratio"] is not None}
        if not known:
            why = "; ".join(f"{b}: {e['reason']}" for b, e in each.items())
            out[name] = _goal(name, None, why, against=None, by_baseline=each)
            continue
        # The strongest competitor: the baseline collm leads by the least.
        best = min(known, key=lambda b: known[b]["ratio"])
        out[name] = _goal(name, known[best]["ratio"], None, against=best, by_baseline=each)
    return out


def fronts(points: Sequence[Point]) -> dict[str, dict[str, list[str]]]:
    """Per policy, the knobs on its frontier on each pair of axes."""
    return {
        p: {
            "quality_vs_goodput": [x.knob for x in frontier(pts, QUALITY_AXES)],
            "attainment_vs_finetune_tokens": [x.knob for x in frontier(pts, TRAINING_AXES)],
        }
        for p, pts in by_policy(points).items()
    }


def sized_window(rate_rps: float, window_s: float, min_requests: int) -> tuple[float, int]:
    """(window, requests) of a live point: `window_s` of arrivals at `rate_rps`, extended until it
    holds at least `min_requests` requests (the load level stays the same)."""
    if not rate_rps > 0 or not window_s > 0 or min_requests < 1:
        raise ValueError("rate_rps and window_s must be > 0 and min_requests >= 1")
    n = max(min_requests, round(rate_rps * window_s))
    return max(window_s, n / rate_rps), n


# Offered rates searched for a target attainment of serving alone, as fractions of the capacity estimate.
ALONE_SEARCH = (0.005, 1.0)


def rate_for_attainment(
    attains: Callable[[float], float],
    target: float,
    lo: float = ALONE_SEARCH[0],
    hi: float = ALONE_SEARCH[1],
    steps: int = 7,
) -> tuple[float, list[tuple[float, float]]]:
    """The highest fraction of the capacity estimate at which `attains(fraction)` (serving alone's SLO
    attainment there) is at least `target`, by geometric bisection between `lo` and `hi` in `steps`
    halvings of the log range (`rate_search.search`, `geometric_bisection`: the answer is within a factor
    (hi/lo) ** (1/2**steps) of the crossing): (the fraction, every (fraction, attainment) tried). `hi`
    itself when it attains the target; a ValueError when even `lo` does not."""
    if not 0 < target <= 1 or not 0 < lo < hi:
        raise ValueError("target must be in (0, 1] and 0 < lo < hi")
    crossing = search(attains, target, (lo, hi), geometric_bisection(steps))
    if crossing.meets is None:
        raise ValueError(
            f"serving alone attains {crossing.tried[-1][1]:.3f} < {target:g} even at {lo:g} x the capacity "
            "estimate"
        )
    return crossing.meets, crossing.tried
