"""A replica's step log: one JSON line per inference step and per stretch of background work.

A replica writes it when `COLLM_STEP_LOG_PATH` is set (off by default): each step's own time, which the
load generator's request-level figures cannot separate from queueing; the simulator can write the same
records for its simulated replicas. The records are declared once here, for the writers and the reader
(`read_step_log`).

* `InferenceStep`: one forward pass of the running batch: its decoding sequences (how many, and the
  tokens of context before their new token, summed), its prefill chunks (tokens, earlier tokens of the
  sequence), the distinct adapter versions in it, the forward pass's time and the step's whole time
  (forward, sampling, detokenising, streaming), and the training budget the co-scheduler granted for
  after it, with what bounded that budget;
* `BackgroundWork`: one stretch of training or evaluation pieces after a step: its time, the training
  tokens of the micro-steps it completed (each micro-step's tokens and time; the optimizer's steps and a
  micro-step still in progress are in `ms` only) or the evaluation tokens it scored.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class InferenceStep(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: Literal["inference"] = "inference"
    t_s: float  # the engine's clock at the step's start
    decodes: int = Field(ge=0)
    decode_context_tokens: int = Field(ge=0)
    prefill: list[tuple[int, int]] = Field(default_factory=list)  # (tokens, earlier tokens) per chunk
    adapters: int = Field(ge=0)
    forward_ms: float = Field(ge=0)
    step_ms: float = Field(ge=0)
    # The training decided for after this step: its budget (0 without a job to train) and what bounded it
    # (the co-scheduler's limit: share, slack, guard, idle; "policy" for a co-scheduler that keeps none;
    # None without a job).
    train_budget_ms: float = Field(0.0, ge=0)
    train_limit: str | None = None


class BackgroundWork(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: Literal["train", "eval"]
    t_s: float
    ms: float = Field(ge=0)
    tokens: int = Field(0, ge=0)
    micro_steps: list[tuple[int, float]] = Field(default_factory=list)  # (tokens, ms) completed


StepRecord = Annotated[InferenceStep | BackgroundWork, Field(discriminator="kind")]
_RECORD: TypeAdapter[InferenceStep | BackgroundWork] = TypeAdapter(StepRecord)


class StepLog:
    """Appends records to a JSONL file; `write` may be called from any thread. Lines are buffered and
    reach the file when the buffer fills and on `flush`/`close`."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: InferenceStep | BackgroundWork) -> None:
        line = record.model_dump_json() + "\n"
        with self._lock:
            if not self._f.closed:
                self._f.write(line)

    def flush(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()


def read_step_log(path: Path) -> Iterator[InferenceStep | BackgroundWork]:
    """The records of a step log, in order; a line that is not a record raises ValueError naming it (a
    last line cut short by a killed writer is skipped)."""
    with path.open(encoding="utf-8") as f:
        lines = f.readlines()
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if n == len(lines) and not line.endswith("\n"):
            return  # cut short mid-write
        try:
            yield _RECORD.validate_python(json.loads(line))
        except ValueError as exc:
            raise ValueError(f"{path}:{n}: not a step record: {exc}") from exc
