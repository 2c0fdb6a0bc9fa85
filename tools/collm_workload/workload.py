"""The request plan of a run: when each request is sent, to which model, with which prompt and SLO (pure).

A plan is built entirely before the run starts (prompt building and tokenising never compete with the
measurement) and is deterministic for a given seed: the same trace slice, domain draw and prompts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from collm_workload.arrivals import arrivals
from collm_workload.prompts import PromptBuilder, PromptError
from collm_workload.traces import LengthPolicy, TraceRequest, fit_lengths, slice_window, take_at_rate

ARRIVAL_CHOICES = ("trace", "poisson", "gamma", "constant")


@dataclass(frozen=True)
class Slo:
    """Latency targets of one request; None means that dimension is not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for v in (self.ttft_ms, self.tpot_ms):
            if v is not None and not v > 0:
                raise ValueError("SLO values must be > 0 ms")


@dataclass(frozen=True)
class ArrivalSpec:
    kind: str
    duration_s: float
    rate_rps: float | None = None
    burstiness: float = 1.0
    trace_start_s: float = 0.0
    max_requests: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_CHOICES:
            raise ValueError(f"unknown arrivals {self.kind!r} (want one of {', '.join(ARRIVAL_CHOICES)})")
        if not self.duration_s > 0:
            raise ValueError("duration_s must be > 0")
        if self.kind != "trace" and self.rate_rps is None:
            raise ValueError(f"{self.kind} arrivals need a rate")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("max_requests must be >= 1")


def request_shapes(
    spec: ArrivalSpec,
    trace: Sequence[TraceRequest] | None,
    lengths: LengthPolicy,
    input_tokens: int = 256,
    output_tokens: int = 64,
) -> list[TraceRequest]:
    """Arrival times and token lengths of every request of the run, lengths fitted to `lengths`.

    * `trace` arrivals: a trace slice starting at `trace_start_s`; with a rate, N = rate x duration
      consecutive requests time-scaled to fill the duration (`traces.take_at_rate`), otherwise the
      trace's own timing over `duration_s` seconds.
    * synthetic arrivals: token lengths come from the trace in order (cycled) when one is given, else
      every request asks for `input_tokens` in and `output_tokens` out.
    """
    if spec.kind == "trace":
        if not trace:
            raise ValueError("trace arrivals need a trace")
        if spec.rate_rps is not None:
            shapes = take_at_rate(trace, spec.rate_rps, spec.duration_s, spec.trace_start_s)
        else:
            shapes = slice_window(trace, spec.trace_start_s, spec.duration_s)
    else:
        assert spec.rate_rps is not None
        times = arrivals(
            spec.kind, spec.rate_rps, spec.duration_s, spec.seed, spec.burstiness, spec.max_requests
        )
        if trace:
            tail = [r for r in trace if r.arrival_s >= spec.trace_start_s] or list(trace)
            shapes = [
                TraceRequest(t, tail[i % len(tail)].input_tokens, tail[i % len(tail)].output_tokens)
                for i, t in enumerate(times)
            ]
        else:
            shapes = [TraceRequest(t, input_tokens, output_tokens) for t in times]
    if spec.max_requests is not None:
        shapes = shapes[: spec.max_requests]
    return fit_lengths(shapes, lengths)


@dataclass(frozen=True)
class ModelMap:
    """Which `model` each domain's requests name: its adapter, or the base model.

    A domain maps to `mapping[domain]` if present, else to `template.format(domain=...)`; an empty
    result means "no adapter" and the request names `base_model`.
    """

    mapping: Mapping[str, str] = field(default_factory=dict)
    template: str = "{domain}"
    base_model: str | None = None

    def model_for(self, domain: str) -> str:
        name = self.mapping.get(domain)
        if name is None:
            name = self.template.format(domain=domain) if self.template else ""
        if name:
            return name
        if not self.base_model:
            raise PromptError(f"domain {domain!r} has no adapter model and no base model is set")
        return self.base_model


@dataclass(frozen=True)
class PlannedRequest:
    request_id: str
    index: int
    scheduled_s: float
    domain: str
    model: str
    prompt: str
    target_input_tokens: int
    estimated_input_tokens: int
    max_tokens: int
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    example_id: str = ""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def draw_domains(n: int, mix: Mapping[str, float], seed: int) -> list[str]:
    """The domain of each of `n` requests: a seeded draw by the mix weights (what `plan_requests` uses).

    Its own random stream (`[seed, 1]`), so changing how prompts are drawn never changes which domain
    a request gets; the simulator calls this too, so a simulation and a live run see the same domains.
    """
    if not mix:
        raise PromptError("the domain mix is empty")
    names = sorted(mix)
    weights = np.array([mix[d] for d in names], dtype=float)
    picks = np.random.default_rng([seed, 1]).choice(len(names), size=n, p=weights / weights.sum())
    return [names[int(k)] for k in picks]


def plan_requests(
    shapes: Sequence[TraceRequest],
    mix: Mapping[str, float],
    builder: PromptBuilder,
    models: ModelMap,
    slo: Slo,
    slo_by_domain: Mapping[str, Slo] | None = None,
    seed: int = 0,
) -> list[PlannedRequest]:
    """Assign each shape a domain (a seeded draw by the mix weights), a prompt, a model and an SLO."""
    domains = draw_domains(len(shapes), mix, seed)
    prompt_rng = np.random.default_rng([seed, 2])
    by_domain = slo_by_domain or {}
    plan = []
    for i, (shape, domain) in enumerate(zip(shapes, domains, strict=True)):
        built = builder.build(domain, shape.input_tokens, prompt_rng)
        s = by_domain.get(domain, slo)
        plan.append(
            PlannedRequest(
                request_id=f"r{i:06d}",
                index=i,
                scheduled_s=shape.arrival_s,
                domain=domain,
                model=models.model_for(domain),
                prompt=built.text,
                target_input_tokens=shape.input_tokens,
                estimated_input_tokens=built.estimated_tokens,
                max_tokens=shape.output_tokens,
                slo_ttft_ms=s.ttft_ms,
                slo_tpot_ms=s.tpot_ms,
                example_id=built.example_id,
            )
        )
    return plan
