"""The search for the arrival rate at which a run still meets a target (pure: the run comes in as a function).

`search` finds where a measure that falls as the load rises (SLO attainment against the offered rate, or
against a request count over a fixed window) crosses `target`, from the caller's start points and a
`Strategy`, in three phases:

1. bracket: the start points are tried in order, upward until the first that misses the target (`scan`
   "up"), or downward from the highest until the first that meets it ("down");
2. extend: while no point meets the target, points below the lowest missing one are tried (`below`), at
   most `max_below` of them;
3. narrow: while both a point that meets the target and a higher one that misses it are known, a point
   between them (`split`) is tried and replaces the end it agrees with, until `split` has no point left
   or `max_splits` points were tried.

The answer (`Crossing`) is the highest point known to meet the target on the way (the bracket's low end),
the lowest one above it known to miss it, and every point tried with its measure, in order. The measure
need not be monotone (a few dozen simulated requests are not), so this is the first crossing met, not
every load that meets the target.

The frontier's strategy is `geometric_bisection` (fractions of a capacity estimate, a fixed number of
halvings of the log range: the serving-alone rate, `frontier.points.rate_for_attainment`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

P = TypeVar("P", int, float)


@dataclass(frozen=True)
class Strategy(Generic[P]):
    """How `search` brackets the crossing and narrows it (module docstring): `scan` the start points
    "up" or "down"; `below(lowest_missing)` the next point under it, None when there is none, at most
    `max_below` of them; `split(low, high)` a point strictly between, None when there is none, at most
    `max_splits` of them (None: no limit)."""

    scan: Literal["up", "down"]
    split: Callable[[P, P], P | None]
    max_splits: int | None = None
    below: Callable[[P], P | None] | None = None
    max_below: int = 0


@dataclass(frozen=True)
class Crossing(Generic[P]):
    """Where the measure crossed the target: `meets`, the highest point known to meet it on the way
    (None: none does), `misses`, the lowest point above it known to miss it (None: none does), and
    `tried`, every (point, measure) in the order tried."""

    meets: P | None
    misses: P | None
    tried: list[tuple[P, float]] = field(default_factory=list)


def geometric_bisection(steps: int) -> Strategy[float]:
    """Positive reals: scanned downward, never extended, then `steps` halvings of the log range
    (geometric midpoints)."""
    return Strategy(scan="down", split=lambda lo, hi: math.sqrt(lo * hi), max_splits=steps)


def search(
    measure: Callable[[P], float], target: float, start: Sequence[P], strategy: Strategy[P]
) -> Crossing[P]:
    """The first crossing of `target` by `measure` (module docstring): a point meets the target when its
    measure is >= `target`. `start` is tried in ascending order ("up") or descending ("down")."""
    tried: list[tuple[P, float]] = []

    def meets(point: P) -> bool:
        value = measure(point)
        tried.append((point, value))
        return value >= target

    lo: P | None = None
    hi: P | None = None
    for point in sorted(start, reverse=strategy.scan == "down"):
        if meets(point):
            lo = point
            if strategy.scan == "down":
                break
        else:
            hi = point
            if strategy.scan == "up":
                break
    extensions = 0
    while lo is None and hi is not None and strategy.below is not None and extensions < strategy.max_below:
        point = strategy.below(hi)
        if point is None:
            break
        extensions += 1
        if meets(point):
            lo = point
        else:
            hi = point
    splits = 0
    while lo is not None and hi is not None and (strategy.max_splits is None or splits < strategy.max_splits):
        mid = strategy.split(lo, hi)
        if mid is None:
            break
        splits += 1
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return Crossing(lo, hi, tried)
