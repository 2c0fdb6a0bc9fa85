"""Logged steps against the cost model: the step's price by hand, and the sums by kind of step."""

from __future__ import annotations

import pytest

from collm_bench.step_costs import (
    compare_steps,
    describe_kinds,
    describe_training,
    eval_shape,
    training_totals,
)
from collm_common.calibration import CostModel
from collm_common.step_log import BackgroundWork, InferenceStep

pytestmark = pytest.mark.unit

COST = CostModel(
    prefill_fixed_ms=10.0,
    prefill_ms_per_token=1.0,
    decode_step_ms={1: 20.0, 16: 50.0},
    decode_context_tokens=100,
    decode_ms_per_context_token=0.01,
    prefill_ms_per_token_per_context_token=0.001,
    lora_overhead_frac_per_adapter=0.1,
    train_fixed_ms=20.0,
    train_ms_per_token=2.0,
    max_batch=16,
)


def inference(
    t_s: float, decodes: int, context: int, prefill: list[tuple[int, int]], ms: float
) -> InferenceStep:
    return InferenceStep(
        t_s=t_s, decodes=decodes, decode_context_tokens=context, prefill=prefill, adapters=2,
        forward_ms=ms - 1.0, step_ms=ms,
    )  # fmt: skip


def test_a_step_is_priced_as_the_simulator_prices_it() -> None:
    # 4 decodes (20 + 3 x 30 / 15 = 26 ms at 100 tokens of context each) over 600 tokens of context (200
    # more: + 2 ms), a chunk of 50 tokens after 100 (50 x (1 + 0.1) = 55 ms), two adapters (x 1.2).
    assert COST.step_ms(4, 600, [(50, 100)], 2) == pytest.approx((26.0 + 2.0 + 55.0) * 1.2)
    # Prefill only: the fixed prefill cost instead of a decode step.
    assert COST.step_ms(0, 0, [(50, 0)], 1) == pytest.approx((10.0 + 50.0) * 1.1)
    assert COST.step_ms(0, 0, [], 0) == 0.0


def test_steps_sum_by_kind_within_the_window() -> None:
    decode = inference(1.0, 4, 600, [], 36.0)  # predicted (26 + 2) x 1.2 = 33.6
    prefill = inference(2.0, 0, 0, [(50, 0)], 90.0)  # predicted 60 x 1.2 = 72
    mixed = inference(3.0, 4, 600, [(50, 100)], 120.0)  # predicted 83 x 1.2 = 99.6
    train = BackgroundWork(
        kind="train", t_s=4.0, ms=700.0, tokens=250, micro_steps=[(100, 230.0), (150, 330.0)]
    )
    evaluation = BackgroundWork(kind="eval", t_s=5.0, ms=45.0, tokens=512)
    outside = inference(9.0, 1, 100, [], 1000.0)
    got = compare_steps([decode, prefill, mixed, train, evaluation, outside], COST, since_s=0.5, until_s=9.0)
    assert list(got) == ["decode", "prefill", "mixed", "inference", "train", "eval"]
    assert got["decode"].ratio == pytest.approx(36.0 / 33.6)
    assert got["prefill"].ratio == pytest.approx(90.0 / 72.0)
    assert got["mixed"].ratio == pytest.approx(120.0 / 99.6)
    assert got["inference"].steps == 3
    assert got["inference"].measured_ms == pytest.approx(246.0)
    assert got["inference"].forward_ms == pytest.approx(243.0)
    assert got["inference"].ratio == pytest.approx(246.0 / (33.6 + 72.0 + 99.6))
    # Training: its stretches' time against each completed micro-step's price (220 + 320 ms).
    assert got["train"].ratio == pytest.approx(700.0 / 540.0)
    assert got["eval"].ratio is None and got["eval"].measured_ms == 45.0
    line = describe_kinds({k: v.as_dict() for k, v in got.items()})
    assert line.startswith("decode 1.07 (1 steps, 0.0 s), prefill 1.25") and line.endswith(
        "eval 0.0 s (1 pieces)"
    )
    assert compare_steps([outside], COST, since_s=0.5, until_s=9.0) == {}


def test_training_sums_its_stretches_and_the_micro_steps_they_completed() -> None:
    # Three stretches of one job: the first two complete a micro-step of 100 tokens (its pieces took
    # 150 + 100 ms of them), the third is half a micro-step still in progress; one stretch before the
    # window and the inference and evaluation records do not count.
    records = [
        BackgroundWork(kind="train", t_s=0.5, ms=999.0, tokens=50, micro_steps=[(50, 999.0)]),
        BackgroundWork(kind="train", t_s=1.0, ms=150.0),
        inference(1.2, 4, 400, [], 30.0),
        BackgroundWork(kind="train", t_s=1.5, ms=120.0, tokens=100, micro_steps=[(100, 250.0)]),
        BackgroundWork(kind="eval", t_s=1.7, ms=40.0, tokens=30),
        BackgroundWork(kind="train", t_s=2.0, ms=80.0),
    ]
    t = training_totals(records, since_s=1.0)
    assert (t.stretches, t.ms, t.tokens, t.micro_steps, t.micro_ms) == (3, 350.0, 100, 1, 250.0)
    assert t.unfinished_ms == pytest.approx(100.0)
    assert t.micro_ms_per_token == pytest.approx(2.5)
    assert describe_training(t.as_dict()) == (
        "0.3 s, 100 tokens in 1 micro-steps of 0.2 s (2.5 ms per token), 0.1 s unfinished"
    )
    empty = training_totals([], None, None)
    assert empty.micro_ms_per_token is None and empty.unfinished_ms == 0.0
    assert "ms per token" not in describe_training(empty.as_dict())


def test_evaluation_batches_are_the_pieces_that_carry_tokens() -> None:
    # Two batches of 300 and 200 tokens in 3 and 2 pieces (the last piece of each carries its tokens);
    # a piece after the window does not count.
    pieces = [(0.0, 0), (0.1, 0), (0.2, 300), (0.3, 0), (0.4, 200), (9.0, 100)]
    records = [BackgroundWork(kind="eval", t_s=t, ms=10.0, tokens=n) for t, n in pieces]
    records.append(BackgroundWork(kind="train", t_s=0.5, ms=5.0, tokens=64, micro_steps=[(64, 5.0)]))
    shape = eval_shape(records, until_s=5.0)
    assert (shape.batches, shape.pieces, shape.tokens) == (2, 5, 500)
    assert shape.pieces_per_batch == pytest.approx(2.5) and shape.tokens_per_batch == pytest.approx(250.0)
    none = eval_shape([])
    assert none.pieces_per_batch is None and none.tokens_per_batch is None
