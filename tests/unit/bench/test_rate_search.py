"""The one rate search (collm_bench.experiment.rate_search): each strategy's probes, in order, on measures
that fall with the load."""

from __future__ import annotations

import math
from collections.abc import Callable

from collm_bench.experiment.rate_search import Strategy, geometric_bisection, search


def cliff(at: float) -> Callable[[float], float]:
    return lambda x: 1.0 if x <= at else 0.0


def count_bisection(max_halvings: int = 6) -> Strategy[int]:
    """Integer request counts: scanned upward, halved (down to 1) at most `max_halvings` times while none
    meets the target, then bisected down to neighbouring counts (the upward scan and the extension)."""
    return Strategy(
        scan="up",
        split=lambda lo, hi: (lo + hi) // 2 if hi - lo > 1 else None,
        below=lambda hi: hi // 2 if hi > 1 else None,
        max_below=max_halvings,
    )


def test_count_bisection_scans_up_to_the_first_miss_then_bisects_to_neighbours() -> None:
    c = search(cliff(37), 0.9, [80, 10, 40], count_bisection())
    assert [n for n, _ in c.tried] == [10, 40, 25, 32, 36, 38, 37]
    assert (c.meets, c.misses) == (37, 38)


def test_count_bisection_halves_below_the_grid_when_nothing_meets_the_target() -> None:
    c = search(cliff(5), 0.9, [40, 80], count_bisection())
    assert [n for n, _ in c.tried] == [40, 20, 10, 5, 7, 6]
    assert (c.meets, c.misses) == (5, 6)
    never = search(lambda _n: 0.0, 0.9, [40], count_bisection(max_halvings=2))
    assert [n for n, _ in never.tried] == [40, 20, 10] and never.meets is None and never.misses == 10
    assert search(lambda _n: 1.0, 0.9, [40, 80], count_bisection()).misses is None


def test_geometric_bisection_tries_the_top_first_and_halves_the_log_range() -> None:
    top = search(lambda _f: 0.95, 0.9, (0.01, 1.0), geometric_bisection(7))
    assert top.tried == [(1.0, 0.95)] and (top.meets, top.misses) == (1.0, None)
    c = search(cliff(0.1), 0.9, (0.01, 1.0), geometric_bisection(2))
    assert [f for f, _ in c.tried] == [1.0, 0.01, 0.1, math.sqrt(0.1)]
    assert c.meets == 0.1 and c.misses == math.sqrt(0.1)
    low = search(lambda _f: 0.5, 0.9, (0.01, 1.0), geometric_bisection(7))
    assert low.meets is None and [f for f, _ in low.tried] == [1.0, 0.01]
