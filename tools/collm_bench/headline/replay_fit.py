"""The simulator's inference costs measured on a live replay of the same trace (pure).

The speed probe times a prefill and a decode step alone, at fixed shapes, on an otherwise quiet machine;
a loaded replica runs prefill chunks inside decode batches, over contexts of every length, for two
adapters at once, beside the gateway, the coordinator and the load generator, and spends some of each
step outside the model (sampling, detokenising, streaming). Near saturation a tenth more cost is a fifth
less goodput. So before the runs the benchmark replays a *different* slice of the same trace live (the
requests after the first `offset` ones from the slice's start, so the prediction of the benchmark's own
slice is still a prediction), with fine-tuning off, and every replica logs its steps
(`collm_common.step_log`). Each step's measured time is set beside what the simulator's cost model
(scaled by the probe) charges for exactly that step (`collm_bench.step_costs`); the factor is the ratio
of the sums over both replicas' inference steps, and scales the simulator's prefill and decode costs for
the rate search and the predictions. It is a measurement of the cost of the steps the engine ran, not a
fit of the simulator's output to the live one: the replay's SLO attainment, live and simulated at the
probe's costs and at the measured ones, is recorded beside it as the check.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from collm_bench.step_costs import EvalShape
from collm_common.calibration import Calibration
from collm_workload.traces import TraceRequest

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


def measured_inference_factor(
    step_costs_by_replica: Mapping[str, Mapping[str, Mapping[str, Any]]],
) -> float | None:
    """Measured over predicted time of the replay's inference steps, pooled over the replicas
    (`step_costs` of a run: replica -> kind -> `KindCost.as_dict()`), held within `FACTOR_BOUNDS`; None
    when no replica logged an inference step."""
    measured = predicted = 0.0
    for kinds in step_costs_by_replica.values():
        k = kinds.get("inference")
        if k and k.get("predicted_ms"):
            measured += k["measured_ms"]
            predicted += k["predicted_ms"]
    if predicted <= 0:
        return None
    lo, hi = FACTOR_BOUNDS
    return min(hi, max(lo, measured / predicted))


@dataclass(frozen=True)
class EvalFit:
    """The simulator's evaluation shape as measured on the replay: batches per evaluation (pooled, and per
    replica where it completed a batch: each replica's held-out examples pack their own way) and pieces
    per batch (`collm_sim.config.EngineSpec.eval_batches`, `eval_pieces_per_batch`)."""

    batches: int
    pieces_per_batch: int
    batches_by_replica: Mapping[str, int] = field(default_factory=dict)


def measured_eval_fit(shapes: Mapping[str, EvalShape], eval_tokens: int | None) -> EvalFit | None:
    """From the replay's evaluation pieces per replica: an evaluation of `eval_tokens` in batches of the
    mean tokens the live batches held (rounded to whole batches; pooled, and per replica), each in the
    mean number of pieces (pooled over the replicas that completed a batch); None when the replay
    completed no evaluation batch or evaluations are not modelled."""
    done = [s for s in shapes.values() if s.batches]  # a replica with no batch done tells no batch's size
    pooled = EvalShape(sum(s.batches for s in done), sum(s.pieces for s in done), sum(s.tokens for s in done))
    if not eval_tokens or pooled.tokens_per_batch is None or pooled.pieces_per_batch is None:
        return None
    by_replica = {
        rid: max(1, round(eval_tokens / s.tokens_per_batch))
        for rid, s in sorted(shapes.items())
        if s.tokens_per_batch
    }
    return EvalFit(
        max(1, round(eval_tokens / pooled.tokens_per_batch)),
        max(1, round(pooled.pieces_per_batch)),
        by_replica,
    )


def measured_first_slow_s(slow_ticks_s: Sequence[float]) -> float | None:
    """When the coordinator's first round plans came, in seconds from the replay's start: its first slow
    tick at or after the start (None: none during the replay). The live coordinator starts with the
    stack, a few seconds before the replay (the stack's start and the run's preparation), so its first
    slow tick (`warmup_s` after its first tick) comes that much earlier in the replay than `warmup_s`,
    and the rounds' phase against the trace's arrivals follows from it; the simulator's coordinator
    starts with the trace. With it the simulated first plans come when the live ones did
    (`predict.sim_config`)."""
    return min((t for t in slow_ticks_s if t >= 0), default=None)
