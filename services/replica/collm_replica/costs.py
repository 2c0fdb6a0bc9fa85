"""Online cost models and latency windows (pure: no torch, no asyncio).

`LinearCost` fits `ms = fixed + per_unit * units` by exponentially weighted least squares, so the
co-scheduler's predictions follow the machine (other load, thermal state) within a few dozen samples.
`PieceCosts` keeps one such model per kind of background piece (a layer's forward or backward of a
training micro-step, an LM-head chunk, an evaluation layer, the optimizer step), so the engine can run
exactly as much background work as fits the time the co-scheduler grants.
`StepCosts` learns the engine's inference steps: their time by tokens, the decode step by batch size and what
a prefill token adds to a step.
`LatencyWindow` keeps finished requests of the last `window_s` seconds for percentiles and SLO attainment.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from collm_common.stats import percentiles


class LinearCost:
    def __init__(self, fixed_ms: float, per_unit_ms: float, decay: float = 0.97) -> None:
        self.default = (fixed_ms, per_unit_ms)
        self.decay = decay
        self._s = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self.samples = 0

    def observe(self, units: float, ms: float) -> None:
        d = self.decay
        self._s = self._s * d + 1
        self._sx = self._sx * d + units
        self._sy = self._sy * d + ms
        self._sxx = self._sxx * d + units * units
        self._sxy = self._sxy * d + units * ms
        self.samples += 1

    def params(self) -> tuple[float, float]:
        """(fixed_ms, per_unit_ms); the defaults until two distinct sizes were seen."""
        if self.samples == 0:
            return self.default
        var = self._s * self._sxx - self._sx * self._sx
        mean_x, mean_y = self._sx / self._s, self._sy / self._s
        if var <= 1e-9 * max(1.0, self._s * self._sxx):
            # One size only: keep the default slope through the observed mean.
            per = self.default[1]
            return max(0.0, mean_y - per * mean_x), per
        per = (self._s * self._sxy - self._sx * self._sy) / var
        per = max(per, 0.0)
        return max(0.0, mean_y - per * mean_x), per

    def predict(self, units: float) -> float:
        fixed, per = self.params()
        return fixed + per * units


class StepCosts:
    """What the engine learns of its own inference steps (pure).

    * `line`: the step's time against its tokens (every step), the prediction of a planned step;
    * `decode_ms`: the time of a decode-only step by its number of sequences (smoothed);
    * `prefill_extra_ms_per_token`: what one prefill token adds to a step, from steps with at least
      `min_prefill_tokens` of prefill: the step's time beyond a decode-only step of as many sequences,
      per prefill token (smoothed; None until such a step follows a decode-only step of its size).
    """

    def __init__(self, smoothing: float = 0.2, min_prefill_tokens: int = 16) -> None:
        self.line = LinearCost(fixed_ms=5.0, per_unit_ms=2.0)
        self.decode_ms: dict[int, float] = {}
        self.prefill_extra_ms_per_token: float | None = None
        self.smoothing = smoothing
        self.min_prefill_tokens = min_prefill_tokens

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe(self, sequences: int, tokens: int, prefill_tokens: int, ms: float) -> None:
        """One step of `sequences` sequences and `tokens` tokens, `prefill_tokens` of them prefill."""
        self.line.observe(tokens, ms)
        if prefill_tokens == 0:
            self.decode_ms[sequences] = self._smooth(self.decode_ms.get(sequences), ms)
        elif prefill_tokens >= self.min_prefill_tokens:
            decode = self.decode_ms.get(sequences)
            if decode is not None:
                extra = max(0.0, ms - decode) / prefill_tokens
                self.prefill_extra_ms_per_token = self._smooth(self.prefill_extra_ms_per_token, extra)

    def decode_at(self, sequences: int) -> float:
        """A decode step of `sequences` sequences: measured when seen, else the line's prediction."""
        return self.decode_ms.get(sequences) or self.line.predict(sequences)

    def prefill_ms_per_token(self) -> float:
        """What a prefill token adds to a step: measured, else the line's slope."""
        if self.prefill_extra_ms_per_token is not None:
            return self.prefill_extra_ms_per_token
        return self.line.params()[1]


class PieceCosts:
    """Predicted ms of one piece of background work, by kind, learnt online.

    Kinds (units): `fwd`, `bwd`, `eval_fwd` (one decoder layer; padded tokens of the batch), `head`,
    `eval_head` (one LM-head chunk; labelled rows), `opt` (one optimizer step; 1). The defaults are a
    little above SmolLM2-135M's on one CPU core, so the first pieces are sized conservatively.
    """

    DEFAULTS: dict[str, tuple[float, float]] = {
        "fwd": (3.0, 0.11),
        "bwd": (3.0, 0.2),
        "head": (1.0, 1.2),
        "eval_fwd": (3.0, 0.11),
        "eval_head": (1.0, 0.6),
        "opt": (15.0, 0.0),
    }

    def __init__(self, defaults: dict[str, tuple[float, float]] | None = None) -> None:
        self.models = {k: LinearCost(*v) for k, v in {**self.DEFAULTS, **(defaults or {})}.items()}

    def predict(self, kind: str, units: float) -> float:
        return max(0.0, self.models[kind].predict(units))

    def observe(self, kind: str, units: float, ms: float) -> None:
        self.models[kind].observe(units, ms)

    def micro_step(self, n_layers: int, label_frac: float = 0.5, head_rows: int = 64) -> tuple[float, float]:
        """(fixed_ms, per_token_ms) of a whole training micro-step of n tokens, from the pieces' models."""
        f_fwd, p_fwd = self.models["fwd"].params()
        f_bwd, p_bwd = self.models["bwd"].params()
        f_head, p_head = self.models["head"].params()
        fixed = n_layers * (f_fwd + f_bwd) + f_head
        per = n_layers * (p_fwd + p_bwd) + label_frac * (p_head + f_head / max(1, head_rows))
        return fixed, per


@dataclass(frozen=True)
class FinishedSample:
    t_s: float
    ttft_ms: float | None
    tpot_ms: float | None
    good: bool
    # Whether it would have been good without the training that ran while it was in flight
    # (`collm_common.slo.meets_slo_alone`); None: as `good`.
    good_alone: bool | None = None


class LatencyWindow:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._items: deque[FinishedSample] = deque()

    def add(self, sample: FinishedSample) -> None:
        self._items.append(sample)

    def prune(self, now_s: float) -> None:
        while self._items and self._items[0].t_s < now_s - self.window_s:
            self._items.popleft()

    def finished_since(self, since_s: float) -> int:
        """Requests finished at or after `since_s` (within the window)."""
        return sum(1 for s in self._items if s.t_s >= since_s)

    def summary(self, now_s: float) -> dict[str, float | int | None]:
        self.prune(now_s)
        ttft = [s.ttft_ms for s in self._items if s.ttft_ms is not None]
        tpot = [s.tpot_ms for s in self._items if s.tpot_ms is not None]
        n = len(self._items)
        good = sum(1 for s in self._items if s.good)
        good_alone = sum(1 for s in self._items if (s.good if s.good_alone is None else s.good_alone))
        ttft_p50, ttft_p99 = percentiles(ttft, (50, 99))
        tpot_p50, tpot_p99 = percentiles(tpot, (50, 99))
        return {
            "ttft_ms_p50": ttft_p50,
            "ttft_ms_p99": ttft_p99,
            "tpot_ms_p50": tpot_p50,
            "tpot_ms_p99": tpot_p99,
            "finished": n,
            "good": good,
            "good_alone": good_alone,
            "slo_attainment": (good / n) if n else None,
        }


# Fewer completions than this in the window say too little about the pace to refuse anything on it.
MIN_FINISHED_FOR_WAIT = 8


def predicted_queue_wait_s(waiting: int, finished: int, span_s: float) -> float | None:
    """How long a request joining a queue of `waiting` requests waits for a batch slot, at the pace the
    replica finished requests lately (`finished` in the last `span_s` seconds: each completion frees a
    slot for the next waiting request); None when that pace is not known yet."""
    if finished < MIN_FINISHED_FOR_WAIT or span_s <= 0:
        return None
    return (waiting + 1) / (finished / span_s)
