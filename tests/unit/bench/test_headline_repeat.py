"""The repeated headline comparison: rotation of the policies and the paired summary (pure parts)."""

from __future__ import annotations

from typing import Any

import pytest

from collm_bench.headline.repeat import markdown_repeats, rotated, summarize_repeats

pytestmark = pytest.mark.unit


def results(collm_good: float, fixed_good: float, collm_q: float, fixed_q: float | None) -> dict[str, Any]:
    def live(good: float, q: float | None) -> dict[str, Any]:
        return {"goodput_rps": good, "attainment": good / 2, "quality_gain_end": q, "ft_tokens": 100.0}

    runs = {"collm": {"live": live(collm_good, collm_q)}, "fixed_ratio": {"live": live(fixed_good, fixed_q)}}
    runs["separate"] = {"live_error": "the stack did not start"}  # a failed run counts nowhere
    return {"traces": [{"label": "azure conv", "rates": {"heavy": {"rate_rps": 1.633, "runs": runs}}}]}


def test_each_repetition_starts_with_another_policy() -> None:
    pols = ["collm", "separate", "fixed_ratio"]
    assert [rotated(pols, k)[0] for k in range(4)] == ["collm", "separate", "fixed_ratio", "collm"]
    assert sorted(rotated(pols, 2)) == sorted(pols) and rotated([], 3) == []


def test_ratios_are_paired_within_a_repetition_then_summarised() -> None:
    reps = [results(1.0, 0.5, 0.004, 0.002), results(0.6, 0.6, 0.003, None), results(0.9, 0.3, 0.002, 0.004)]
    s = summarize_repeats(reps)
    b = s["blocks"]["azure conv, heavy 1.633 req/s"]
    assert s["repeats"] == 3 and set(b["policies"]) == {"collm", "fixed_ratio"}
    assert b["policies"]["collm"]["goodput_rps"] == {"n": 3, "median": 0.9, "min": 0.6, "max": 1.0}
    g = b["ratios"]["goodput_rps collm/fixed_ratio"]
    # 2.0, 1.0, 3.0: the median of the paired ratios, not the ratio of the medians (0.9 / 0.5 = 1.8).
    assert g["values"] == pytest.approx([2.0, 1.0, 3.0]) and g["median"] == pytest.approx(2.0)
    q = b["ratios"]["quality_gain_end collm/fixed_ratio"]
    assert q["values"][1] is None and q["n"] == 2 and q["median"] == pytest.approx((2.0 + 0.5) / 2)
    md = markdown_repeats(s)
    assert "| collm | 0.900 (0.600-1.000) |" in md
    assert "goodput_rps collm/fixed_ratio: 2.00 (1.00-3.00); each repetition: 2.00, 1.00, 3.00" in md
    assert "each repetition: 2.00, -, 0.50" in md
    assert not any("serving_only" in name for name in b["ratios"])


def test_the_reference_run_gives_the_ceiling_of_each_ratio() -> None:
    reps = [results(1.0, 0.5, 0.004, 0.002), results(0.6, 0.6, 0.003, 0.001)]
    for rep, ceiling in zip(reps, (1.5, 0.9), strict=True):
        runs = rep["traces"][0]["rates"]["heavy"]["runs"]
        runs["serving_only"] = {"live": {"goodput_rps": ceiling, "attainment": 0.9, "quality_gain_end": None}}
    b = summarize_repeats(reps)["blocks"]["azure conv, heavy 1.633 req/s"]
    assert b["ratios"]["goodput_rps serving_only/fixed_ratio"]["values"] == pytest.approx([3.0, 1.5])
    assert b["ratios"]["goodput_rps collm/serving_only"]["values"] == pytest.approx([1.0 / 1.5, 0.6 / 0.9])
    # No quality gain without training: that ratio is not a number.
    assert b["ratios"]["quality_gain_end collm/serving_only"]["n"] == 0
    md = markdown_repeats(summarize_repeats(reps))
    assert md.index("| fixed_ratio |") < md.index("| serving_only |")
