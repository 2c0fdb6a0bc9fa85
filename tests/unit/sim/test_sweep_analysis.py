"""The simulated sweep's analysis (bench/sim/sweep.py): crossings, ratios, goals, serving-only reference."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SWEEP = Path(__file__).resolve().parents[3] / "bench" / "sim" / "sweep.py"


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    spec = importlib.util.spec_from_file_location("collm_bench_sim_sweep", SWEEP)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def row(
    policy: str, rate: float, attainment: float, goodput: float = 0.0, gain: float = 0.0
) -> dict[str, Any]:
    return {
        "policy": policy,
        "rate_rps": rate,
        "attainment": attainment,
        "goodput_rps": goodput,
        "quality_gain_per_hour": gain,
    }


def test_crossing_interpolates_at_the_first_drop(sweep: ModuleType) -> None:
    rate, how = sweep.crossing_rate([(1.0, 1.0), (2.0, 0.95), (3.0, 0.85), (4.0, 0.95)])
    assert rate == pytest.approx(2.5)
    assert "between 2 and 3" in how
    assert sweep.crossing_rate([(1.0, 0.5)])[0] is None
    assert sweep.crossing_rate([(1.0, 0.99), (2.0, 0.95)]) == (
        2.0,
        "at or above target at the highest rate (a lower bound)",
    )


def test_serving_only_is_compared_with_the_best_colocated_baseline(sweep: ModuleType) -> None:
    # Sustained rates (90% crossings): collm 3.5, separate 2.5, fixed_ratio 3.0, leftover 1.5, serving 3.75.
    grid = [
        *(row("collm", r, a) for r, a in [(2.0, 1.0), (3.0, 0.95), (4.0, 0.85)]),
        *(row("separate", r, a) for r, a in [(2.0, 0.95), (3.0, 0.85)]),
        *(row("fixed_ratio", r, a) for r, a in [(2.0, 1.0), (3.0, 0.9), (4.0, 0.5)]),
        *(row("leftover", r, a) for r, a in [(1.0, 0.95), (2.0, 0.85)]),
        *(row("serving_only", r, a) for r, a in [(2.0, 1.0), (3.0, 0.96), (4.0, 0.88)]),
    ]
    at = [
        row("collm", 3.0, 0.95, goodput=2.85, gain=4.0),
        row("separate", 3.0, 0.5, goodput=1.5, gain=5.0),
        row("fixed_ratio", 3.0, 0.9, goodput=2.7, gain=4.0),
        row("leftover", 3.0, 0.3, goodput=0.9, gain=6.0),
        row("serving_only", 3.0, 0.99, goodput=2.97, gain=0.0),
    ]
    a = sweep.analyse(grid, at)
    assert a["best_baseline"] == "fixed_ratio"
    assert a["sustained_rate_rps"]["serving_only"]["rate"] == pytest.approx(3.75)
    assert a["sustained_rate_vs_colocated"] == pytest.approx(3.5 / 3.0)
    assert a["serving_only_sustained_rate_vs_colocated"] == pytest.approx(3.75 / 3.0)
    assert a["goodput_vs_colocated_at_crossing"] == pytest.approx(2.85 / 2.7)
    assert a["serving_only_goodput_vs_colocated_at_crossing"] == pytest.approx(2.97 / 2.7)
    goals = a["goals"]
    assert goals["sustained_rate_vs_colocated"]["serving_only"] == pytest.approx(3.75 / 3.0)
    assert goals["sustained_rate_vs_colocated"]["met"] is False  # 1.17 < 1.2
    assert goals["goodput_vs_separate_at_crossing"]["met"] is False  # 1.9 < 3
    assert "serving_only" not in goals["goodput_vs_separate_at_crossing"]
    # The reference is never a baseline: quality is compared with fixed_ratio (sustains most) and leftover.
    assert a["quality_vs_best_baseline"] == pytest.approx(1.0)
    assert a["best_quality_baseline_at_crossing"] == "leftover"


def test_a_sweep_without_the_reference_reports_none_for_it(sweep: ModuleType) -> None:
    grid = [
        *(
            row(p, r, a)
            for p in ("collm", "separate", "fixed_ratio", "leftover")
            for r, a in [(1.0, 1.0), (2.0, 0.8)]
        )
    ]
    a = sweep.analyse(grid, [])
    assert "serving_only" not in a["sustained_rate_rps"]
    assert a["serving_only_sustained_rate_vs_colocated"] is None
    assert a["goals"]["sustained_rate_vs_colocated"]["serving_only"] is None


def test_reference_tasks_run_collm_with_training_off(sweep: ModuleType) -> None:
    task = sweep.make_task({"replicas": 8}, {"trace": "conv"}, "serving_only", 2.5)
    assert (task["series"], task["policy"], task["coscheduler"]) == ("serving_only", "collm", "off")
    assert task["workload"] == {"trace": "conv", "rate_rps": 2.5}
    plain = sweep.make_task({"replicas": 8}, {}, "fixed_ratio", 1.0)
    assert (plain["policy"], plain["coscheduler"]) == ("fixed_ratio", None)


def test_the_result_file_keeps_a_compact_grid_and_the_full_analysis(sweep: ModuleType) -> None:
    full = row("collm", 1.0, 0.954321987, goodput=0.912345678) | {
        "by_status": {"ok": 3},
        "tokens_past_measured_by_domain": {"math": 1.0},
        "wall_s": 1.5,
    }
    analysis = {"best_baseline": "separate", "crossing_rate_rps": 1.23456789, "at_crossing": {"collm": full}}
    config = {"trace": "conv", "grid": [full], "analysis": analysis}
    out = sweep.compact_config(config)
    assert set(out["grid"][0]) <= set(sweep.KEPT_FIELDS)
    assert out["grid"][0]["attainment"] == 0.9543 and out["grid"][0]["goodput_rps"] == 0.9123
    assert out["analysis"]["at_crossing"]["collm"] == out["grid"][0]
    assert out["analysis"]["crossing_rate_rps"] == 1.23456789 and out["trace"] == "conv"
    assert config["grid"][0] is full and "wall_s" in full  # the input is left as it was
