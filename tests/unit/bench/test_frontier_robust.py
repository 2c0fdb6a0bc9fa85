"""The robustness run's choice of settings, verdicts, table and figure (`collm_bench.frontier.robust`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from collm_bench.frontier import robust
from collm_bench.frontier.points import Point, minutes_to

pytestmark = pytest.mark.unit

LOADS = ["0.3", "0.7"]


def point(policy: str, knob: str, attainment: float, tokens: float, core: dict | None = None) -> Point:
    return Point(policy, knob, attainment, 1.0, tokens, 0.1, 100, core or {})


def test_chosen_trains_the_most_at_the_floor_else_attains_the_most() -> None:
    pts = [
        point("serving_only", "off", 1.0, 0),
        point("fixed_ratio", "K=9 (share 0.10)", 0.91, 500, {"fixed_ratio_k": 9}),
        point("fixed_ratio", "K=19 (share 0.05)", 0.95, 300, {"fixed_ratio_k": 19}),
        point("fixed_ratio", "K=4 (share 0.20)", 0.5, 900, {"fixed_ratio_k": 4}),
        point("separate", "1 of 8 train", 0.7, 100, {"separate_train_frac": 0.125}),
        point("separate", "2 of 8 train", 0.5, 200, {"separate_train_frac": 0.25}),
    ]
    best_k = robust.chosen(pts, "fixed_ratio")
    sep = robust.chosen(pts, "separate")
    assert best_k is not None and best_k.knob == "K=9 (share 0.10)"  # 0.91 >= 0.9 x 1.0, most tokens
    assert sep is not None and sep.knob == "1 of 8 train"  # none at the floor: the one attaining most
    assert robust.chosen(pts, "leftover") is None
    doc = {"points": [p.as_dict() for p in pts]}
    labels = [s.label for s in robust.settings(doc, 0.95, 16)]
    assert labels[:3] == ["collm, target 0.95 (default)", "separate, 2 of 16 train", "fixed_ratio, K=19"]
    assert "fixed_ratio, K=9 (chosen)" in labels and labels[-1] == "serving alone"


def cell(attainment: float, tokens: int, timeline: list[list[float]]) -> dict:
    return {
        "attainment": attainment,
        "ft_tokens": tokens,
        "lowest_minute": attainment,
        "quality_timeline": timeline,
    }


def doc() -> dict:
    def row(label: str, policy: str, cells: dict) -> dict:
        return {"label": label, "policy": policy, "core": {}, "cells": cells}

    # Gains per [s, math, medical]; served loss falls as the gain grows.
    return {
        "trace": {"label": "test"},
        "config": {"replicas": 8, "loads": LOADS, "domains": ["math", "medical"]},
        "rows": [
            row("collm, target 0.95 (default)", "collm", {
                "0.3": cell(0.95, 600, [[0, 0, 0], [120, 0.2, 0.1], [300, 0.5, 0.3]]),
                "0.7": cell(0.85, 50, [[0, 0, 0], [600, 0.1, 0.1]]),
            }),
            row("fixed_ratio, K=19 (chosen)", "fixed_ratio", {
                "0.3": cell(0.99, 200, [[0, 0, 0], [240, 0.1, 0.05], [600, 0.2, 0.1]]),
                "0.7": cell(0.5, 90, [[0, 0, 0]]),
            }),
            row("fixed_ratio, K=4", "fixed_ratio", {
                "0.3": cell(0.1, 900, [[0, 0, 0], [60, 0.9, 0.9]]),
                "0.7": cell(0.0, 800, [[0, 0, 0], [60, 0.9, 0.9]]),
            }),
            row("serving alone", "serving_only", {
                "0.3": cell(1.0, 0, [[0, 0, 0]]),
                "0.7": cell(0.9, 0, [[0, 0, 0]]),
            }),
        ],
    }  # fmt: skip


def test_minutes_to_is_the_first_publication_where_every_domain_is_there() -> None:
    timeline = [[0, 0, 0], [120, 0.2, 0.1], [300, 0.5, 0.3]]
    assert minutes_to(timeline, [0.2, 0.1]) == 2.0
    assert minutes_to(timeline, [0.1, 0.3]) == 5.0  # medical gets there last
    assert minutes_to(timeline, [0.6, 0.0]) is None


def test_verdicts_floor_holders_time_to_quality_and_the_goal() -> None:
    v = robust.verdicts(doc())
    assert v["per_load"]["0.3"]["floor"] == 0.9
    assert v["per_load"]["0.3"]["held"] == [
        "collm, target 0.95 (default)", "fixed_ratio, K=19 (chosen)", "serving alone"
    ]  # fmt: skip
    # K=4 trains most but is below the floor: the best baseline at the floor is K=19 (final 0.2, 0.1).
    assert v["per_load"]["0.3"]["time_to_quality"] == {
        "baseline": "fixed_ratio, K=19 (chosen)", "baseline_min": 10.0, "collm_min": 2.0
    }  # fmt: skip
    assert v["per_load"]["0.7"]["time_to_quality"] == {"baseline": None}
    assert v["collm_holds_floor_everywhere"] is True  # 0.85 >= 0.9 x 0.9
    assert v["collm_tokens_vs_chosen_k_at_lowest"] == 3.0
    assert v["fixed_k_doing_both"] == []
    assert v["goal_met"] is True


def test_a_fixed_k_that_holds_every_floor_and_trains_as_much_defeats_the_goal() -> None:
    d = doc()
    d["rows"][1]["cells"]["0.3"]["ft_tokens"] = 600
    d["rows"][1]["cells"]["0.7"]["attainment"] = 0.85
    v = robust.verdicts(d)
    assert v["fixed_k_doing_both"] == ["fixed_ratio, K=19 (chosen)"]
    assert v["collm_tokens_vs_chosen_k_at_lowest"] == 1.0
    assert v["goal_met"] is False


def test_the_table_marks_cells_below_the_floor_and_states_the_goal(tmp_path: Path) -> None:
    lines = robust.table(doc()).splitlines()
    assert lines[0] == "| setting | load 0.3 | load 0.7 |"
    assert lines[2] == "| collm, target 0.95 (default) | 0.950 / 1k | 0.850 / 0k |"
    assert lines[4] == "| fixed_ratio, K=4 | 0.100 / 1k* | 0.000 / 1k* |"
    assert lines[6] == "| floor (0.9 x alone; * below it) | 0.900 | 0.810 |"
    assert lines[7] == (
        "| time-to-quality, collm vs best baseline | 2 min vs 10 min (fixed_ratio, K=19) "
        "| no baseline at the floor |"
    )
    assert lines[-1].endswith("Goal met.")
    path = robust.write(doc(), tmp_path / "r.json")
    assert "[120,0.2,0.1]" in path.read_text(encoding="utf-8")  # number lists on one line
    assert path.with_suffix(".png").stat().st_size > 1000
