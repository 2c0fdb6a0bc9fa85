"""Synthetic arrival processes, seeded and reproducible (pure).

* Poisson: exponential inter-arrival times with mean 1/rate.
* Gamma ("burstiness", as vLLM's `--burstiness k`): inter-arrival ~ Gamma(shape=k, scale=1/(rate*k)).
  The mean stays 1/rate and the coefficient of variation is 1/sqrt(k): k = 1 is Poisson, k < 1 is
  burstier, k > 1 smoother.
* Constant: one request every 1/rate seconds.

Every schedule starts with a request at 0 s (like a re-zeroed trace) and holds the arrivals in
[0, duration_s), capped at `max_requests`. The same seed always gives the same schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

ARRIVAL_KINDS = ("poisson", "gamma", "constant")


def _check(rate_rps: float, duration_s: float) -> None:
    if not rate_rps > 0:
        raise ValueError("rate_rps must be > 0")
    if not duration_s > 0:
        raise ValueError("duration_s must be > 0")


def _accumulate(gaps: np.ndarray, duration_s: float, max_requests: int | None) -> list[float]:
    times = np.concatenate(([0.0], np.cumsum(gaps)))
    times = times[times < duration_s]
    if max_requests is not None:
        times = times[:max_requests]
    return [float(t) for t in times]


def _draw(
    draw_gaps: Callable[[int], np.ndarray], rate_rps: float, duration_s: float, max_requests: int | None
) -> list[float]:
    # Draw gaps in blocks until the schedule covers the duration (the expected count plus slack first).
    block = int(rate_rps * duration_s * 1.5) + 16
    gaps = draw_gaps(block)
    while gaps.sum() < duration_s and (max_requests is None or len(gaps) < max_requests):
        gaps = np.concatenate((gaps, draw_gaps(block)))
    return _accumulate(gaps, duration_s, max_requests)


def poisson_arrivals(
    rate_rps: float, duration_s: float, seed: int, max_requests: int | None = None
) -> list[float]:
    _check(rate_rps, duration_s)
    rng = np.random.default_rng(seed)
    return _draw(lambda n: rng.exponential(1.0 / rate_rps, n), rate_rps, duration_s, max_requests)


def gamma_arrivals(
    rate_rps: float, burstiness: float, duration_s: float, seed: int, max_requests: int | None = None
) -> list[float]:
    _check(rate_rps, duration_s)
    if not burstiness > 0:
        raise ValueError("burstiness (gamma shape k) must be > 0")
    rng = np.random.default_rng(seed)
    scale = 1.0 / (rate_rps * burstiness)
    return _draw(lambda n: rng.gamma(burstiness, scale, n), rate_rps, duration_s, max_requests)


def constant_arrivals(rate_rps: float, duration_s: float, max_requests: int | None = None) -> list[float]:
    _check(rate_rps, duration_s)
    n = int(np.ceil(rate_rps * duration_s))
    return _accumulate(np.full(n, 1.0 / rate_rps), duration_s, max_requests)


def arrivals(
    kind: str,
    rate_rps: float,
    duration_s: float,
    seed: int,
    burstiness: float = 1.0,
    max_requests: int | None = None,
) -> list[float]:
    if kind == "poisson":
        return poisson_arrivals(rate_rps, duration_s, seed, max_requests)
    if kind == "gamma":
        return gamma_arrivals(rate_rps, burstiness, duration_s, seed, max_requests)
    if kind == "constant":
        return constant_arrivals(rate_rps, duration_s, max_requests)
    raise ValueError(f"unknown arrival process {kind!r} (want one of {', '.join(ARRIVAL_KINDS)})")
