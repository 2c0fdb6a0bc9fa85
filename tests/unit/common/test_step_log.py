"""The step log: records written from any thread read back in order; a torn last line is skipped."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from collm_common.step_log import BackgroundWork, InferenceStep, StepLog, read_step_log

pytestmark = pytest.mark.unit


def step(t_s: float) -> InferenceStep:
    return InferenceStep(
        t_s=t_s, decodes=3, decode_context_tokens=420, prefill=[(128, 0)], adapters=2, forward_ms=80.5,
        step_ms=82.0,
    )  # fmt: skip


def test_records_read_back_as_written(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "steps.jsonl"
    log = StepLog(path)
    train = BackgroundWork(kind="train", t_s=2.0, ms=900.0, tokens=252, micro_steps=[(252, 880.0)])
    log.write(step(1.0))
    log.write(train)
    log.write(BackgroundWork(kind="eval", t_s=3.0, ms=40.0, tokens=512))
    log.close()
    log.write(step(4.0))  # after close: dropped, no error
    assert list(read_step_log(path)) == [
        step(1.0),
        train,
        BackgroundWork(kind="eval", t_s=3.0, ms=40.0, tokens=512),
    ]


def test_writers_on_several_threads_never_interleave_lines(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "steps.jsonl")

    def write(base: float) -> None:
        for i in range(200):
            log.write(step(base + i))

    threads = [threading.Thread(target=write, args=(1000.0 * k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    assert sorted(r.t_s for r in read_step_log(tmp_path / "steps.jsonl")) == sorted(
        1000.0 * k + i for k in range(4) for i in range(200)
    )


def test_a_torn_last_line_is_skipped_and_a_bad_line_named(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    whole = step(1.0).model_dump_json()
    path.write_text(whole + "\n" + whole[:30], encoding="utf-8")
    assert list(read_step_log(path)) == [step(1.0)]
    path.write_text(whole + "\n" + '{"kind": "inference", "t_s": 2.0}\n' + whole + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"steps.jsonl:2: not a step record"):
        list(read_step_log(path))
