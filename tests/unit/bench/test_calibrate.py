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
    typical = costs_from_timings(TIMINGS, replace(SIZES, statistic="median"))
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
