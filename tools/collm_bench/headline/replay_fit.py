"""The simulator's inference costs fitted to a live replay of the same trace (pure).

The speed probe times a prefill and a decode step alone, at fixed shapes; a loaded replica runs prefill
chunks inside decode batches, over contexts of every length, for two adapters at once, and spends some of
each iteration outside the model (sampling, detokenising, streaming). The probe-scaled simulator
over-predicted the live goodput of every run of the conv comparison of 2026-12-02 01:35 (+29% to
+408%), and near saturation a tenth more cost is a fifth less goodput. So before the runs the benchmark
replays a *different* slice of the same trace live (the requests after the first
`offset` ones from the slice's start, so the prediction of the benchmark's own slice is still a
prediction), with fine-tuning off, and scales the simulator's prefill and decode costs by the factor at
which the simulated replay attains the SLO attainment the live one did: an effective cost, which carries
whatever the simulator leaves out (the iteration's work outside the model, how the live engine spreads
latency over requests) into the rate search and the predictions. The replay runs at the light rate that
the probe-scaled simulator found, where the light rate's definition (the best baseline at >= 95%) has to
hold live. Its time per token served is recorded beside (`collm_replica_prefill_tokens` and
`_generated_tokens` against the inference seconds, up to the load generator's cut): in five replays of
2026-12-02 it was -5% to +13% off the simulator's at the probe's costs, while in the two that the live
stack could not keep up with the simulator attained 0.30 and 0.63 where they attained 0.13 and 0.18: most
of what the simulator misses is not the cost of a token but which requests those tokens go to.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from collm_bench.traces import TraceRequest
from collm_common.calibration import Calibration

# The replay's series: collm's coordinator with fine-tuning off (`collm_sim.plugins.REFERENCES`), so the
# replicas' time is serving alone.
REPLAY_SERIES = "serving_only"

# The calibration replay starts this many trace requests after the benchmark slice's start: beyond any
# slice of this machine's size (a few hundred requests), and beside the 1000 the SLO's p99 prompt reads.
OFFSET_REQUESTS = 1000
FACTOR_BOUNDS = (0.5, 3.0)


def with_inference_factor(cal: Calibration, factor: float) -> Calibration:
    """`cal` with its prefill and decode costs (and their context terms) times `factor`; training and
    evaluation as they were (a replay with fine-tuning off says nothing of training)."""
    return cal.scaled_by_kind(prefill=factor, decode={1: factor}, train=1.0, evaluation=1.0)


def replay_start_s(
    requests: Sequence[TraceRequest], start_s: float, offset: int = OFFSET_REQUESTS
) -> float | None:
    """Trace time of the `offset`-th request at or after `start_s` (None: the trace is shorter)."""
    after = [r.arrival_s for r in requests if r.arrival_s >= start_s]
    return after[offset] if len(after) > offset else None


def ms_per_token(work: Iterable[tuple[float, float]]) -> float | None:
    """Milliseconds of inference per token served over (seconds, tokens) pairs (None: no tokens)."""
    pairs = list(work)
    tokens = sum(n for _, n in pairs)
    return 1e3 * sum(s for s, _ in pairs) / tokens if tokens > 0 else None


def fit_cost_factor(
    live_attainment: float,
    attainment_at: Callable[[float], float],
    tolerance: float = 0.02,
    max_steps: int = 10,
    bounds: tuple[float, float] = FACTOR_BOUNDS,
    step: float = 1.25,
) -> tuple[float, list[tuple[float, float]]]:
    """The cost factor f at which the simulated replay's SLO attainment, `attainment_at(f)`, meets the
    live one (within `tolerance`), and every (f, attainment) tried. Attainment falls as costs grow, in
    steps (a few dozen requests) and not always strictly, so: from f = 1, steps of x`step` (or
    /`step`) until the live attainment is bracketed or a bound is reached, then bisection (geometric)
    of the bracket; the answer is the point tried nearest the live attainment, and of equally near ones
    the nearest to 1 (the least correction that fits)."""
    if not 0.0 <= live_attainment <= 1.0:
        raise ValueError("the live attainment must lie in [0, 1]")
    lo_b, hi_b = bounds
    trail: list[tuple[float, float]] = []

    def tried(f: float) -> float:
        a = float(attainment_at(f))
        trail.append((f, a))
        return a

    def best() -> float:
        return min(trail, key=lambda p: (abs(p[1] - live_attainment), abs(math.log(p[0]))))[0]

    a = tried(1.0)
    if abs(a - live_attainment) <= tolerance:
        return 1.0, trail
    slower = a > live_attainment  # the simulation attains more than live: its costs are too low
    near, f = 1.0, 1.0
    while len(trail) < max_steps:
        f = min(hi_b, f * step) if slower else max(lo_b, f / step)
        a = tried(f)
        if abs(a - live_attainment) <= tolerance:
            return best(), trail
        if (a <= live_attainment) if slower else (a >= live_attainment):
            break  # bracketed between `near` and f
        near = f
        if f in bounds:
            return best(), trail
    lo, hi = sorted((near, f))
    while len(trail) < max_steps:
        mid = math.sqrt(lo * hi)
        a = tried(mid)
        if abs(a - live_attainment) <= tolerance:
            break
        if a > live_attainment:
            lo = mid
        else:
            hi = mid
    return best(), trail
