"""Each logged step's measured time beside what the cost model predicts for exactly that step (pure).

A replica's step log (`collm_common.step_log`) records every inference step's shape (decoding sequences
and their context, prefill chunks, adapters) and time, and every stretch of training or evaluation. The
simulator prices a step with `CostModel.step_ms`; summing both over the steps of a run says, by kind of
step, how far the costs the simulator was given are from what the live engine spent, apart from
everything the request-level figures mix in (routing, queueing, which requests wait for which step):

* `decode` (steps with decoding sequences only), `prefill` (prefill chunks only), `mixed` (both), and
  `inference` (all of them): measured = the step's whole time (`step_ms`: the forward pass, sampling,
  detokenising, streaming), its forward pass apart (`forward_ms`);
* `train`: the training stretches' time against `train_ms` of each micro-step they completed (the
  optimizer's share is in the calibration's per-token cost; a micro-step still in progress at the end
  counts in the time and not yet in the prediction, a small bias up);
* `eval`: time only (the cost of an evaluation batch depends on its padding, which the log does not
  keep).

`ratio` = measured / predicted; 1.0 means the simulator spent what the engine did.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from collm_common.calibration import CostModel
from collm_common.step_log import BackgroundWork, InferenceStep

KINDS = ("decode", "prefill", "mixed", "inference", "train", "eval")


@dataclass(frozen=True)
class KindCost:
    steps: int
    measured_ms: float
    predicted_ms: float | None  # None: the cost model does not price this kind (evaluation)
    forward_ms: float | None = None  # of the measured time, in the model's forward passes (inference)

    @property
    def ratio(self) -> float | None:
        if self.predicted_ms is None or self.predicted_ms <= 0:
            return None
        return self.measured_ms / self.predicted_ms

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ratio": self.ratio}


def in_window(t_s: float, since_s: float | None, until_s: float | None) -> bool:
    """Whether a record starting at `t_s` lies in [since_s, until_s) (None: unbounded on that side)."""
    return (since_s is None or t_s >= since_s) and (until_s is None or t_s < until_s)


def step_kind(step: InferenceStep) -> str:
    if step.decodes and step.prefill:
        return "mixed"
    return "decode" if step.decodes else "prefill"


def compare_steps(
    records: Iterable[InferenceStep | BackgroundWork], cost: CostModel, since_s: float | None = None,
    until_s: float | None = None,
) -> dict[str, KindCost]:  # fmt: skip
    """Measured and predicted time by kind of step, over the records whose start lies in [since_s,
    until_s) (the engine's clock; None: unbounded). Kinds without a record are left out."""
    sums: dict[str, list[float]] = {}  # kind -> [steps, measured, predicted, forward]

    def add(kind: str, measured: float, predicted: float, forward: float = 0.0) -> None:
        acc = sums.setdefault(kind, [0, 0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += measured
        acc[2] += predicted
        acc[3] += forward

    for r in records:
        if not in_window(r.t_s, since_s, until_s):
            continue
        if isinstance(r, InferenceStep):
            predicted = cost.step_ms(r.decodes, r.decode_context_tokens, r.prefill, r.adapters)
            add(step_kind(r), r.step_ms, predicted, r.forward_ms)
            add("inference", r.step_ms, predicted, r.forward_ms)
        elif r.kind == "train":
            add("train", r.ms, sum(cost.train_ms(tokens) for tokens, _ in r.micro_steps))
        else:
            add("eval", r.ms, 0.0)
    out = {}
    for kind in KINDS:
        if kind not in sums:
            continue
        n, measured, predicted, forward = sums[kind]
        out[kind] = KindCost(
            steps=int(n),
            measured_ms=measured,
            predicted_ms=None if kind == "eval" else predicted,
            forward_ms=forward if kind in ("decode", "prefill", "mixed", "inference") else None,
        )
    return out


def describe_kinds(kinds: Mapping[str, Mapping[str, Any]]) -> str:
    """One line from `KindCost.as_dict()` by kind: measured / predicted time, steps and seconds
    ("decode 1.08 (1520 steps, 41.2 s), ..."), or the time alone where nothing is predicted."""
    parts = []
    for kind, k in kinds.items():
        seconds = k["measured_ms"] / 1e3
        if k.get("ratio") is not None:
            parts.append(f"{kind} {k['ratio']:.2f} ({k['steps']} steps, {seconds:.1f} s)")
        else:
            parts.append(f"{kind} {seconds:.1f} s ({k['steps']} pieces)")
    return ", ".join(parts)


@dataclass(frozen=True)
class TrainingTotals:
    """A run's training stretches summed: their time, and the micro-steps they completed (each one's
    tokens and the time of its pieces). The rest of the time (`unfinished_ms`) went to optimizer steps
    and to micro-steps not completed: in progress at the end, or dropped when their job ended first."""

    stretches: int
    ms: float
    tokens: int
    micro_steps: int
    micro_ms: float

    @property
    def unfinished_ms(self) -> float:
        return max(0.0, self.ms - self.micro_ms)

    @property
    def micro_ms_per_token(self) -> float | None:
        return self.micro_ms / self.tokens if self.tokens else None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "unfinished_ms": self.unfinished_ms,
            "micro_ms_per_token": self.micro_ms_per_token,
        }


def background(
    records: Iterable[InferenceStep | BackgroundWork], kind: str, since_s: float | None,
    until_s: float | None,
) -> Iterator[BackgroundWork]:  # fmt: skip
    """The stretches of background work of `kind` ("train", "eval") starting in [since_s, until_s)."""
    for r in records:
        if isinstance(r, BackgroundWork) and r.kind == kind and in_window(r.t_s, since_s, until_s):
            yield r


def training_totals(
    records: Iterable[InferenceStep | BackgroundWork], since_s: float | None = None,
    until_s: float | None = None,
) -> TrainingTotals:  # fmt: skip
    """The training stretches whose start lies in [since_s, until_s), summed (pure)."""
    stretches = tokens = micro = 0
    ms = micro_ms = 0.0
    for r in background(records, "train", since_s, until_s):
        stretches += 1
        ms += r.ms
        tokens += r.tokens
        micro += len(r.micro_steps)
        micro_ms += sum(m for _, m in r.micro_steps)
    return TrainingTotals(stretches, ms, tokens, micro, micro_ms)


def describe_training(t: Mapping[str, Any]) -> str:
    """One replica's `TrainingTotals.as_dict()` in a few words ("11.0 s, 1225 tokens in 7 micro-steps of
    7.1 s (5.8 ms per token), 3.9 s unfinished")."""
    per = t.get("micro_ms_per_token")
    per_s = f" ({per:.1f} ms per token)" if per is not None else ""
    return (
        f"{t['ms'] / 1e3:.1f} s, {t['tokens']} tokens in {t['micro_steps']} micro-steps of "
        f"{t['micro_ms'] / 1e3:.1f} s{per_s}, {t['unfinished_ms'] / 1e3:.1f} s unfinished"
    )


@dataclass(frozen=True)
class EvalShape:
    """How a run's evaluations ran: their batches (the pieces that completed one, which carry its
    tokens), all their pieces, and the tokens scored."""

    batches: int
    pieces: int
    tokens: int

    @property
    def pieces_per_batch(self) -> float | None:
        return self.pieces / self.batches if self.batches else None

    @property
    def tokens_per_batch(self) -> float | None:
        return self.tokens / self.batches if self.batches else None


def eval_shape(
    records: Iterable[InferenceStep | BackgroundWork], since_s: float | None = None,
    until_s: float | None = None,
) -> EvalShape:  # fmt: skip
    """The evaluation pieces whose start lies in [since_s, until_s), counted (pure)."""
    batches = pieces = tokens = 0
    for r in background(records, "eval", since_s, until_s):
        pieces += 1
        if r.tokens > 0:
            batches += 1
            tokens += r.tokens
    return EvalShape(batches, pieces, tokens)
