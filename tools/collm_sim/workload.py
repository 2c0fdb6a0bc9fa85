"""The simulated workload: the same request shapes the live load generator would send (pure).

Arrival times and token lengths come from `collm_workload.workload.request_shapes` (Azure trace replay at a
target rate with time and token-length scaling, or synthetic Poisson / gamma / constant arrivals; a
trace too short for rate x duration is replayed back to back), and
each request's domain from the same seeded draw `collm_workload.workload.plan_requests` makes, so a
simulation and a live run with the same seed see the same requests. Prompts are not built: the
simulator only needs lengths.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from collm_workload.traces import LengthPolicy, TraceRequest, load_trace, resolve_trace
from collm_workload.workload import ArrivalSpec, request_shapes


@dataclass(frozen=True)
class WorkloadSpec:
    arrivals: str = "trace"  # trace | poisson | gamma | constant
    trace: str | None = "conv"  # named trace (conv, code, ...) or a file
    traces_dir: str | None = None
    rate_rps: float | None = None
    duration_s: float = 600.0
    burstiness: float = 1.0
    trace_start_s: float = 0.0
    input_scale: float = 1.0
    output_scale: float = 1.0
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    max_context_tokens: int | None = None
    input_tokens: int = 256
    output_tokens: int = 64
    ttft_slo_ms: float | None = 2000.0
    tpot_slo_ms: float | None = 250.0
    mix: Mapping[str, float] | None = None  # domain -> weight; None: even over the domains
    seed: int = 0


@dataclass(frozen=True)
class Workload:
    """Columns of the requests, sorted by arrival (numpy arrays keep a 100k-request trace cheap)."""

    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    domain: np.ndarray  # index into `domains`
    domains: tuple[str, ...]
    ttft_slo_ms: float | None
    tpot_slo_ms: float | None
    duration_s: float
    description: str

    def __len__(self) -> int:
        return len(self.arrival_s)


@functools.lru_cache(maxsize=8)
def _load(path: str) -> tuple[TraceRequest, ...]:
    return tuple(load_trace(path))


def cached_trace(name: str, traces_dir: str | None) -> list[TraceRequest]:
    """A parsed trace, read once per process (a sweep replays the same file many times)."""
    return list(_load(str(resolve_trace(name, traces_dir))))


def repeat_trace(trace: list[TraceRequest], n: int) -> list[TraceRequest]:
    """At least `n` requests: the trace replayed back to back, each pass shifted by its span plus one
    mean gap, so a large cluster can replay the trace's shape for longer than the file lasts."""
    if len(trace) >= n or len(trace) < 2:
        return trace
    span = trace[-1].arrival_s - trace[0].arrival_s
    shift = span + span / (len(trace) - 1)
    out = list(trace)
    k = 1
    while len(out) < n:
        out.extend(TraceRequest(r.arrival_s + k * shift, r.input_tokens, r.output_tokens) for r in trace)
        k += 1
    return out


def build_workload(spec: WorkloadSpec, domains: tuple[str, ...]) -> Workload:
    if not domains:
        raise ValueError("the workload needs at least one domain")
    trace = None
    if spec.trace is not None and (
        spec.arrivals == "trace" or spec.traces_dir is not None or Path(spec.trace).is_file()
    ):
        trace = cached_trace(spec.trace, spec.traces_dir)
        if spec.arrivals == "trace" and spec.rate_rps is not None:
            trace = repeat_trace(trace, math.ceil(spec.rate_rps * spec.duration_s) + 2)
    arrival = ArrivalSpec(
        kind=spec.arrivals,
        duration_s=spec.duration_s,
        rate_rps=spec.rate_rps,
        burstiness=spec.burstiness,
        trace_start_s=spec.trace_start_s,
        seed=spec.seed,
    )
    lengths = LengthPolicy(
        input_scale=spec.input_scale,
        output_scale=spec.output_scale,
        max_input_tokens=spec.max_input_tokens,
        max_output_tokens=spec.max_output_tokens,
        max_context_tokens=spec.max_context_tokens,
    )
    shapes = request_shapes(arrival, trace, lengths, spec.input_tokens, spec.output_tokens)
    mix = dict(spec.mix) if spec.mix else dict.fromkeys(domains, 1.0)
    unknown = set(mix) - set(domains)
    if unknown:
        raise ValueError(
            f"the mix names domains {sorted(unknown)} that no replica holds (have {list(domains)})"
        )
    names = sorted(mix)
    weights = np.array([mix[d] for d in names], dtype=float)
    weights = weights / weights.sum()
    # The same stream as collm_workload.workload.plan_requests, so the same seed picks the same domains.
    picks = np.random.default_rng([spec.seed, 1]).choice(len(names), size=len(shapes), p=weights)
    index = {d: i for i, d in enumerate(domains)}
    what = spec.trace if spec.arrivals == "trace" else f"{spec.arrivals}(k={spec.burstiness:g})"
    return Workload(
        arrival_s=np.array([s.arrival_s for s in shapes], dtype=float),
        input_tokens=np.array([s.input_tokens for s in shapes], dtype=np.int64),
        output_tokens=np.array([s.output_tokens for s in shapes], dtype=np.int64),
        domain=np.array([index[names[int(p)]] for p in picks], dtype=np.int64),
        domains=tuple(domains),
        ttft_slo_ms=spec.ttft_slo_ms,
        tpot_slo_ms=spec.tpot_slo_ms,
        duration_s=spec.duration_s,
        description=f"{what} at {spec.rate_rps or 'native'} req/s for {spec.duration_s:g}s",
    )
