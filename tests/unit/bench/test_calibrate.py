"""The pure parts of the calibration measurement: reducing timings and fitting the cost model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from collm_bench.calibrate import CostSizes, costs_from_timings, line_through, reduce_ms

pytestmark = pytest.mark.unit

TIMINGS = {
    "prefill": {32: [30.0, 20.0, 40.0], 128: [70.0, 60.0, 90.0]},
    "decode": {1: [10.0, 12.0, 30.0], 16: [40.0, 44.0, 50.0]},
    "lora": {0: [40.0, 44.0, 48.0], 2: [42.0, 46.0, 60.0]},
    "train": {32: [100.0, 110.0, 200.0], 128: [292.0, 302.0, 400.0]},
    "context": {32: [30.0, 40.0, 41.0], 128: [40.0, 44.0, 50.0], 512: [78.4, 82.0, 90.0]},
    "chunk": {0: [80.0, 90.0, 95.0], 256: [96.384, 100.0, 130.0]},
    "eval": {64: [20.0, 25.0, 30.0], 256: [44.0, 50.0, 90.0]},
}
SIZES = CostSizes(decode_contexts=(32, 512), context_batch=16, chunk_tokens=64, chunk_start=256)


def test_reduce_keeps_the_fastest_or_the_median() -> None:
    assert reduce_ms({1: [3.0, 1.0, 2.0]}, "min") == {1: 1.0}
    assert reduce_ms({1: [3.0, 1.0, 2.0, 10.0]}, "median") == {1: 2.5}
    with pytest.raises(ValueError, match="statistic"):
        reduce_ms({1: [1.0]}, "mean")


def test_line_through_two_sizes_has_a_non_negative_intercept() -> None:
    assert line_through({32: 20.0, 128: 60.0}, 32, 128) == pytest.approx((20.0 - 32 * 40 / 96, 40 / 96))
    assert line_through({10: 1.0, 20: 5.0}, 10, 20) == (0.0, 0.4)  # the line would start below zero


def test_cost_model_from_timings_by_statistic() -> None:
    fast = costs_from_timings(TIMINGS, replace(SIZES, statistic="min")).cost
    assert fast.decode_step_ms == {1: 10.0, 16: 40.0} and fast.decode_context_tokens == 128
    assert fast.prefill_ms_per_token == pytest.approx(40 / 96)
    assert fast.train_ms_per_token == pytest.approx(2.0) and fast.train_fixed_ms == pytest.approx(36.0)
    assert fast.lora_overhead_frac_per_adapter == pytest.approx((42 - 40) / 40 / 2)
    # Context: (78.4 - 30) ms over 480 tokens of context for each of 16 sequences; a chunk of 64 tokens
    # 16.384 ms slower after 256 earlier tokens.
    assert fast.decode_ms_per_context_token == pytest.approx(48.4 / 480 / 16)
    assert fast.prefill_ms_per_token_per_context_token == pytest.approx(16.384 / 64 / 256)
    # Evaluation: 24 ms more for 192 more tokens; an evaluation of 600 tokens in batches of 256 is
    # three batches.
    assert fast.eval_ms_per_token == pytest.approx(0.125) and fast.eval_fixed_ms == pytest.approx(12.0)
    assert fast.eval_ms(600, 256) == pytest.approx(3 * 12.0 + 600 * 0.125) and fast.eval_ms(0, 256) == 0
    older = costs_from_timings({k: v for k, v in TIMINGS.items() if k != "eval"}, SIZES).cost
    assert older.eval_ms_per_token is None and older.eval_ms(600, 256) is None  # a file without it
    typical = costs_from_timings(TIMINGS, replace(SIZES, statistic="median"))
    assert typical.eval_ms == {64: 25.0, 256: 50.0}
    assert typical.cost.decode_step_ms == {1: 12.0, 16: 44.0} and typical.statistic == "median"
    assert typical.timings_ms["decode"][1] == [10.0, 12.0, 30.0]  # every timing is kept
    assert typical.decode_ms_by_context == {32: 40.0, 128: 44.0, 512: 82.0}
    assert typical.chunk_ms_by_start == {0: 90.0, 256: 100.0}


def test_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="two sizes"):
        CostSizes(prefill_tokens=(64,))
    with pytest.raises(ValueError, match="LoRA needs 0"):
        CostSizes(lora_adapters=(1, 2))
    with pytest.raises(ValueError, match="statistic"):
        CostSizes(statistic="mean")
    with pytest.raises(ValueError, match="two decode contexts"):
        CostSizes(decode_contexts=(128,), decode_context=128)
    sz = CostSizes(
        decode_batches=(1, 24),
        lora_batch=16,
        prefill_tokens=(16, 256),
        decode_context=128,
        decode_contexts=(64,),
    )
    assert sz.prompts_needed == 24 and sz.prompt_tokens_needed == 256 + 64  # the chunk after 256 tokens
    assert sz.contexts == [64, 128]
    assert CostSizes().prompt_tokens_needed == 512
    with pytest.raises(ValueError, match="two sizes"):
        CostSizes(eval_tokens=(64,))


def test_scaled_costs_scale_every_step_time_and_keep_fractions() -> None:
    cost = costs_from_timings(TIMINGS, SIZES).cost
    slow = cost.scaled(1.5)
    assert slow.decode_ms(16) == pytest.approx(1.5 * cost.decode_ms(16))
    assert slow.decode_ms(8, 400) == pytest.approx(1.5 * cost.decode_ms(8, 400))
    assert slow.prefill_ms(100) == pytest.approx(1.5 * cost.prefill_ms(100))
    assert slow.prefill_chunk_ms(64, 300) == pytest.approx(1.5 * cost.prefill_chunk_ms(64, 300))
    assert slow.train_ms(64) == pytest.approx(1.5 * cost.train_ms(64))
    assert slow.eval_ms(600, 256) == pytest.approx(1.5 * (cost.eval_ms(600, 256) or 0.0))
    assert slow.lora_overhead_frac_per_adapter == cost.lora_overhead_frac_per_adapter
    assert slow.max_batch == cost.max_batch and slow.decode_context_tokens == cost.decode_context_tokens
    with pytest.raises(ValueError, match="> 0"):
        cost.scaled(0.0)


def test_costs_scaled_by_kind_follow_each_kinds_factor() -> None:
    cost = costs_from_timings(TIMINGS, SIZES).cost
    k = cost.scaled_by_kind(prefill=0.8, decode={1: 1.0, 16: 1.3}, train=1.2)
    assert k.prefill_ms(100) == pytest.approx(0.8 * cost.prefill_ms(100))
    assert k.prefill_chunk_ms(64, 300) == pytest.approx(0.8 * cost.prefill_chunk_ms(64, 300))
    assert k.eval_ms(600, 256) == pytest.approx(0.8 * (cost.eval_ms(600, 256) or 0.0))  # as prefill
    assert k.train_ms(64) == pytest.approx(1.2 * cost.train_ms(64))
    # Decode: each measured batch size at its factor, linear between them, held beyond.
    steps, scaled = cost.decode_step_ms, k.decode_step_ms
    assert all(scaled[b] == pytest.approx(steps[b] * (1.0 + 0.3 * min(15, b - 1) / 15)) for b in steps)
    assert k.decode_ms_per_context_token == pytest.approx(1.3 * cost.decode_ms_per_context_token)
    assert cost.scaled_by_kind(2.0, {1: 2.0}, 1.0, evaluation=3.0).eval_ms(600, 256) == pytest.approx(
        3.0 * (cost.eval_ms(600, 256) or 0.0)
    )
    # One factor for every kind is `scaled`.
    assert cost.scaled_by_kind(1.5, {1: 1.5, 16: 1.5}, 1.5) == cost.scaled(1.5)
    for bad in ({"prefill": 0.0}, {"decode": {}}, {"decode": {1: -1.0}}):
        with pytest.raises(ValueError, match="> 0"):
            cost.scaled_by_kind(**({"prefill": 1.0, "decode": {1: 1.0}, "train": 1.0} | bad))  # type: ignore[arg-type]


def test_a_calibration_records_its_products_precision_and_older_files_read_as_fp32(tmp_path) -> None:
    from collm_bench.calibrate import calibration
    from collm_common.calibration import Calibration

    cost = costs_from_timings(TIMINGS, SIZES).cost
    bf = calibration("smollm2", cost, [], "cmd", matmul_dtype="bfloat16")
    bf.save(tmp_path / "bf.json")
    assert Calibration.load(tmp_path / "bf.json").matmul_dtype == "bfloat16"
    assert calibration("smollm2", cost, [], "cmd").matmul_dtype == "float32"
    old = bf.model_dump(mode="json")
    del old["matmul_dtype"]  # written before the field existed
    assert Calibration.model_validate(old).matmul_dtype == "float32"
