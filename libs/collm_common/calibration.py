"""Calibration of the cluster simulator, measured on the real engine.

The engine benchmark writes this file (`bench/calibration/<model>.json`); the simulator and the
coordinator's cost estimates read it. Nothing in it is typed in by hand: every number is a measurement,
and `command` says which run produced it.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import BaseModel, Field

# Decode step times at the calibrated context by batch size, per decode table (keyed by the table's
# items: equal tables share an entry, a table changed in place gets a new one); a few tables are kept.
_DECODE_AT_CONTEXT: dict[tuple[tuple[int, float], ...], dict[int, float]] = {}
_DECODE_TABLES_KEPT = 64


class CostModel(BaseModel):
    """Per-iteration costs of one replica (milliseconds)."""

    prefill_fixed_ms: float = Field(ge=0)
    prefill_ms_per_token: float = Field(ge=0)
    # Decode step time by running batch size at a context of `decode_context_tokens` tokens per sequence,
    # measured at several sizes; interpolated between them.
    decode_step_ms: dict[int, float]
    decode_context_tokens: int = Field(128, ge=1)
    # What one more token of context (summed over the decoding sequences) adds to a decode step, and what
    # one earlier token of context adds to each token of a prefill chunk (attention grows with context).
    decode_ms_per_context_token: float = Field(0.0, ge=0)
    prefill_ms_per_token_per_context_token: float = Field(0.0, ge=0)
    # Extra cost of one distinct adapter in a batch, as a fraction of the base step.
    lora_overhead_frac_per_adapter: float = Field(0.0, ge=0)
    # Fine-tuning micro-step: forward+backward+optimizer share, per training token.
    train_fixed_ms: float = Field(ge=0)
    train_ms_per_token: float = Field(ge=0)
    # A held-out evaluation batch (no-grad forward with the loss over its response tokens, in the
    # replica's evaluation precision): fixed + per padded token. None: not measured (older files).
    eval_fixed_ms: float = Field(0.0, ge=0)
    eval_ms_per_token: float | None = Field(None, ge=0)
    max_batch: int = Field(ge=1)

    def decode_ms(self, batch: int, context_tokens: int | None = None) -> float:
        """One decode step of `batch` sequences holding `context_tokens` tokens of context in all
        (None: `decode_context_tokens` each, the context the step times were measured at)."""
        base = self._decode_at_calibrated_context(batch)
        if context_tokens is None or batch <= 0:
            return base
        return max(0.0, base + self.decode_context_ms(batch, context_tokens))

    def decode_context_ms(self, batch: int, context_tokens: int) -> float:
        """What `context_tokens` of context in all add to a decode step of `batch` sequences beyond the
        calibrated context (negative below it)."""
        return self.decode_ms_per_context_token * (context_tokens - batch * self.decode_context_tokens)

    def _decode_at_calibrated_context(self, batch: int) -> float:
        if batch <= 0:
            return 0.0
        # Looked up once per table and batch size (the step cost is asked for on every iteration).
        key = tuple(self.decode_step_ms.items())
        by_batch = _DECODE_AT_CONTEXT.get(key)
        if by_batch is None:
            if len(_DECODE_AT_CONTEXT) >= _DECODE_TABLES_KEPT:
                _DECODE_AT_CONTEXT.clear()
            by_batch = _DECODE_AT_CONTEXT[key] = {}
        ms = by_batch.get(batch)
        if ms is None:
            ms = by_batch[batch] = self._decode_from_table(batch)
        return ms

    def _decode_from_table(self, batch: int) -> float:
        """The decode table at `batch` (> 0): interpolated between its sizes, held below the smallest,
        extrapolated linearly from the last two above the largest."""
        sizes = sorted(self.decode_step_ms)
        if batch <= sizes[0]:
            return self.decode_step_ms[sizes[0]]
        if batch >= sizes[-1]:  # extrapolate linearly from the last two points
            if len(sizes) == 1:
                return self.decode_step_ms[sizes[0]] * batch / sizes[0]
            a, b = sizes[-2], sizes[-1]
            slope = (self.decode_step_ms[b] - self.decode_step_ms[a]) / (b - a)
            return self.decode_step_ms[b] + slope * (batch - b)
        return interpolate(self.decode_step_ms, batch)

    def prefill_ms(self, tokens: int) -> float:
        return self.prefill_fixed_ms + self.prefill_ms_per_token * tokens if tokens > 0 else 0.0

    def prefill_chunk_ms(self, tokens: int, start_pos: int) -> float:
        """What a prefill chunk of `tokens` tokens after `start_pos` earlier ones adds to a running
        batch's step (its tokens, and their attention to the earlier context)."""
        if tokens <= 0:
            return 0.0
        return tokens * (self.prefill_ms_per_token + self.prefill_ms_per_token_per_context_token * start_pos)

    def step_ms(
        self, decodes: int, decode_context_tokens: int, prefill: Iterable[tuple[int, int]], adapters: int
    ) -> float:
        """One inference step of the running batch: `decodes` decoding sequences holding
        `decode_context_tokens` tokens of context in all (the decode table at the calibrated context, then
        the context's own cost), prefill chunks of (tokens, earlier tokens) (each `prefill_chunk_ms`;
        `prefill_fixed_ms` instead of a decode step when none decodes), times (1 + the LoRA overhead per
        distinct adapter in the batch). The simulator's step and the step log's prediction."""
        chunks = list(prefill)
        if decodes > 0:
            ms = max(0.0, self.decode_ms(decodes) + self.decode_context_ms(decodes, decode_context_tokens))
        elif chunks:
            ms = self.prefill_fixed_ms
        else:
            return 0.0
        if chunks:
            ms += sum(self.prefill_chunk_ms(n, start) for n, start in chunks)
        return ms * (1.0 + self.lora_overhead_frac_per_adapter * adapters)

    def train_ms(self, tokens: int) -> float:
        return self.train_fixed_ms + self.train_ms_per_token * tokens if tokens > 0 else 0.0

    def eval_ms(self, tokens: int, batch_tokens: int) -> float | None:
        """An evaluation of `tokens` padded tokens in batches of at most `batch_tokens` (None: the file
        has no evaluation cost)."""
        if self.eval_ms_per_token is None:
            return None
        if tokens <= 0:
            return 0.0
        batches = -(-tokens // max(1, batch_tokens))
        return batches * self.eval_fixed_ms + self.eval_ms_per_token * tokens

    def scaled(self, factor: float) -> CostModel:
        """Every step cost (prefill, decode, their context terms, training, evaluation) times `factor`;
        the LoRA overhead, a fraction, is kept: the same engine on a machine `factor` times slower."""
        return self.scaled_by_kind(prefill=factor, decode={1: factor}, train=factor, evaluation=factor)

    def scaled_by_kind(
        self, prefill: float, decode: Mapping[int, float], train: float, evaluation: float | None = None
    ) -> CostModel:
        """Each kind of step at its own factor, as a speed probe measures them: prefill (with its context
        term), a decode step by batch size (`decode`: factors at some batch sizes, linear between them and
        held beyond; the context term takes the largest batch's), training, and evaluation (a no-grad
        forward over many tokens: prefill's factor unless given). The LoRA overhead, a fraction, is kept."""
        evaluation = prefill if evaluation is None else evaluation
        if not decode or not all(f > 0 for f in (prefill, train, evaluation, *decode.values())):
            raise ValueError("every cost factor must be > 0")
        per_eval_token = self.eval_ms_per_token
        per_context = self.prefill_ms_per_token_per_context_token
        return self.model_copy(
            update={
                "prefill_fixed_ms": self.prefill_fixed_ms * prefill,
                "prefill_ms_per_token": self.prefill_ms_per_token * prefill,
                "prefill_ms_per_token_per_context_token": per_context * prefill,
                "decode_step_ms": {b: ms * interpolate(decode, b) for b, ms in self.decode_step_ms.items()},
                "decode_ms_per_context_token": self.decode_ms_per_context_token * decode[max(decode)],
                "train_fixed_ms": self.train_fixed_ms * train,
                "train_ms_per_token": self.train_ms_per_token * train,
                "eval_fixed_ms": self.eval_fixed_ms * evaluation,
                "eval_ms_per_token": None if per_eval_token is None else per_eval_token * evaluation,
            }
        )


def interpolate(points: Mapping[int, float], x: int) -> float:
    """The value at `x` of the line through `points` (by key), held at the end values beyond them."""
    keys = sorted(points)
    if x <= keys[0]:
        return points[keys[0]]
    if x >= keys[-1]:
        return points[keys[-1]]
    i = bisect.bisect_left(keys, x)
    a, b = keys[i - 1], keys[i]
    t = (x - a) / (b - a)
    return points[a] * (1 - t) + points[b] * t


class QualityCurve(BaseModel):
    """Held-out eval loss of one domain's adapter against the training tokens it has seen."""

    domain: str
    base_loss: float
    points: list[tuple[int, float]]  # (training tokens, eval loss), increasing tokens


class Calibration(BaseModel):
    model: str
    device: str
    # Precision of the engines' matrix products (the replica's `COLLM_MATMUL_DTYPE`) when measured.
    matmul_dtype: str = "float32"
    torch_threads: int
    measured_unix_s: float
    command: str
    cost: CostModel
    quality: list[QualityCurve] = Field(default_factory=list)

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        return cls.model_validate_json(Path(path).read_text())

    def scaled(self, factor: float) -> Calibration:
        """This calibration with every step cost times `factor` (`CostModel.scaled`); quality unchanged."""
        return self.model_copy(update={"cost": self.cost.scaled(factor)})

    def scaled_by_kind(
        self, prefill: float, decode: Mapping[int, float], train: float, evaluation: float | None = None
    ) -> Calibration:
        """This calibration with each kind of step at its own factor (`CostModel.scaled_by_kind`)."""
        return self.model_copy(update={"cost": self.cost.scaled_by_kind(prefill, decode, train, evaluation)})
