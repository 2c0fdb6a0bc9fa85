"""Percentiles and ratios: the one definition of each that the services, the simulator and the
benchmarks share.

The `q`-th percentile (q in 0..100) of n values is numpy's default (`numpy.percentile(values, q)`,
Hyndman and Fan's method 7), to the last bit: linear interpolation between the closest ranks. With the
values sorted into `s` and the position `h = (n - 1) * q / 100`, it is `s[i] + (s[i + 1] - s[i]) * (h - i)`
for `i = floor(h)` (computed from the upper neighbour, `s[i + 1] - (s[i + 1] - s[i]) * (1 - (h - i))`, when
the fraction is 0.5 or more, as numpy does); the largest value from `h >= n - 1` on. So the 0th percentile
is the smallest value, the 100th the largest and the 50th the median. No values have no percentile: None.
NaN has no rank: leave it out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentiles(values: Iterable[float], qs: Sequence[float]) -> list[float | None]:
    """The `q`-th percentile of `values` for each `q` in `qs` (0..100), the values sorted once; a None for
    each `q` when there are no values. ValueError for a `q` outside 0..100."""
    if any(not 0 <= q <= 100 for q in qs):
        raise ValueError(f"percentiles lie in 0..100, not {list(qs)}")
    s = sorted(values)
    n = len(s)
    out: list[float | None] = []
    for q in qs:
        if not n:
            out.append(None)
            continue
        h = (n - 1) * (q / 100)
        i = math.floor(h)
        if i >= n - 1:
            out.append(float(s[-1]))
            continue
        a, b, t = s[i], s[i + 1], h - i
        out.append(float(b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t))
    return out


def percentile(values: Iterable[float], q: float) -> float | None:
    """The `q`-th percentile of `values` (q in 0..100; see `percentiles`); None when there are none."""
    return percentiles(values, (q,))[0]


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; +inf when only a is positive; None when either is unknown (None or NaN) or both are <= 0."""
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return None
    if b <= 0:
        return math.inf if a > 0 else None
    return a / b
