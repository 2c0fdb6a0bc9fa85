"""The frontier's arithmetic: knob grids, dominance, frontiers, readings, goals (collm_bench.frontier)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from collm_bench.frontier.curves import default_curve, with_default_curves
from collm_bench.frontier.live import BASE_LOSS_S, POINT_OVERHEAD_S, estimate_s, knob_env, resume_from
from collm_bench.frontier.points import (
    Point,
    best_at_least,
    default_knobs,
    dominates,
    equal_quality,
    evaluate_goals,
    fixed_ratio_knobs,
    frontier,
    knob_grid,
    rate_for_attainment,
    separate_knobs,
    sized_window,
    value_at,
)
from collm_common.calibration import QualityCurve

pytestmark = pytest.mark.unit

AX = ("quality_gain_nats", "goodput_rps")


def pt(
    policy: str,
    knob: str,
    att: float | None = 0.9,
    gp: float | None = 1.0,
    ft: float | None = 0.0,
    q: float | None = 0.0,
) -> Point:
    return Point(policy, knob, att, gp, ft, q, 100)


def test_fixed_ratio_knobs_are_shares_as_k_without_duplicates() -> None:
    ks = [k.core["fixed_ratio_k"] for k in fixed_ratio_knobs((0.05, 0.1, 0.2, 1 / 3, 0.5, 0.49))]
    assert ks == [19, 9, 4, 2, 1]
    with pytest.raises(ValueError, match="share"):
        fixed_ratio_knobs((0.7,))


def test_separate_knobs_count_training_replicas_within_the_split_bounds() -> None:
    assert [k.label for k in separate_knobs(8)] == [
        "1 of 8 train",
        "2 of 8 train",
        "3 of 8 train",
        "4 of 8 train",
    ]
    assert [k.core["separate_train_frac"] for k in separate_knobs(64)] == [0.125, 0.25, 0.375, 0.5]
    # Two replicas: only one can train; one replica: no split at all.
    assert [k.label for k in separate_knobs(2)] == ["1 of 2 train"]
    assert separate_knobs(1) == []


def test_knob_grid_covers_every_policy_and_refuses_unknown_ones() -> None:
    grid = knob_grid(("collm", "separate", "fixed_ratio", "leftover", "serving_only"), 8)
    counts = {p: sum(k.policy == p for k in grid) for p in {k.policy for k in grid}}
    assert counts == {"collm": 9, "separate": 4, "fixed_ratio": 5, "leftover": 1, "serving_only": 1}
    assert {k.core["quality_weight_v"] for k in grid if k.policy == "collm"} == {5.0, 20.0, 80.0}
    with pytest.raises(ValueError, match="nope"):
        knob_grid(("nope",), 8)


def test_the_headline_preset_runs_each_policy_once_at_the_services_defaults() -> None:
    from collm_bench.frontier.cli import DEFAULT_POLICIES, build_parser
    from collm_bench.frontier.cli import knob_grid as cli_knobs

    knobs = cli_knobs(build_parser().parse_args(["--preset", "headline"]), DEFAULT_POLICIES, 2)
    assert [k.policy for k in knobs] == list(DEFAULT_POLICIES)
    # No override: the coordinator and the replicas run their own defaults, which the labels name.
    assert all(not k.core for k in knobs)
    assert [k.label for k in knobs] == [
        "V=20, target 0.95 (default)",
        "1 of 2 train (default)",
        "K=5 (share 0.17) (default)",
        "share 1 (as is)",
        "fine-tuning off",
    ]
    assert [k.label for k in default_knobs(("separate",), 8)] == ["2 of 8 train (default)"]
    assert default_knobs(("collm", "separate"), 1) == default_knobs(("collm",), 1)  # no split of one
    with pytest.raises(ValueError, match="nope"):
        default_knobs(("nope",), 2)
    # Without the preset, the grid.
    grid = cli_knobs(build_parser().parse_args([]), DEFAULT_POLICIES, 2)
    assert len(grid) > len(knobs)


def test_dominance_needs_better_on_one_axis_and_no_worse_on_any() -> None:
    a, b = pt("x", "a", gp=2.0, q=0.5), pt("x", "b", gp=1.0, q=0.5)
    assert dominates(a, b, AX) and not dominates(b, a, AX)
    assert not dominates(a, a, AX)  # equal is not dominating
    c = pt("x", "c", gp=3.0, q=0.1)
    assert not dominates(a, c, AX) and not dominates(c, a, AX)  # a trade-off
    # A missing metric is worse than any value.
    assert dominates(a, pt("x", "d", gp=2.0, q=None), AX)


def test_frontier_keeps_the_non_dominated_sorted_by_the_first_axis() -> None:
    pts = [
        pt("x", "hi-q", gp=1.0, q=0.8),
        pt("x", "mid", gp=2.0, q=0.5),
        pt("x", "dominated", gp=1.5, q=0.4),
        pt("x", "hi-gp", gp=3.0, q=0.1),
        pt("x", "dup", gp=2.0, q=0.5),
        pt("x", "no-q", gp=9.0, q=None),
    ]
    assert [p.knob for p in frontier(pts, AX)] == ["hi-gp", "mid", "hi-q"]
    assert frontier([], AX) == []


def test_value_at_reads_points_and_interpolates_between_them() -> None:
    front = frontier([pt("x", "a", gp=3.0, q=0.1), pt("x", "b", gp=1.0, q=0.5)], AX)
    assert value_at(front, "quality_gain_nats", 0.1, "goodput_rps").value == 3.0
    mid = value_at(front, "quality_gain_nats", 0.3, "goodput_rps")
    assert mid.value == pytest.approx(2.0) and "interpolated between a and b" in mid.how


@pytest.mark.parametrize("x", [0.05, 0.6])
def test_value_at_outside_the_frontier_is_none_with_a_reason(x: float) -> None:
    front = frontier([pt("x", "a", gp=3.0, q=0.1), pt("x", "b", gp=1.0, q=0.5)], AX)
    r = value_at(front, "quality_gain_nats", x, "goodput_rps")
    assert r.value is None and "no overlap" in r.how and "[0.1, 0.5]" in r.how
    assert value_at([], "quality_gain_nats", 0.2, "goodput_rps").value is None


def test_best_at_least_takes_the_crossing_of_the_floor() -> None:
    pts = [pt("x", "safe", att=0.95, ft=100.0), pt("x", "greedy", att=0.75, ft=500.0)]
    # At attainment >= 0.85: the segment from safe (0.95, 100) to greedy (0.75, 500) crosses at 300.
    r = best_at_least(pts, "slo_attainment", 0.85, "finetune_tokens")
    assert r.value == pytest.approx(300.0) and "interpolated" in r.how
    r = best_at_least(pts, "slo_attainment", 0.95, "finetune_tokens")
    assert r.value == 100.0 and r.how == "x safe"
    r = best_at_least(pts, "slo_attainment", 0.97, "finetune_tokens")
    assert r.value is None and "no point reaches slo_attainment >= 0.97 (best 0.95)" in r.how
    assert best_at_least([pt("x", "q", q=None)], "quality_gain_nats", 0.0, "goodput_rps").value is None


def test_equal_quality_compares_goodput_at_the_highest_gain_both_reach() -> None:
    c = [pt("collm", "a", gp=6.0, q=0.4), pt("collm", "b", gp=4.0, q=0.8)]
    s = [pt("separate", "1", gp=2.0, q=0.2), pt("separate", "2", gp=1.0, q=0.6)]
    e = equal_quality(c, s)
    # Level 0.6: collm interpolates 5.0 between its points, separate has 1.0 there.
    assert e["level"] == 0.6 and e["a"]["value"] == pytest.approx(5.0) and e["ratio"] == pytest.approx(5.0)
    none = equal_quality(c, [pt("separate", "x", q=None)])
    assert none["ratio"] is None and "no point with a quality gain" in none["reason"]


def grid_points(collm_ft: float, collm_q: float, collm_gp: float) -> list[Point]:
    return [
        pt("serving_only", "off", att=0.98, gp=5.0, ft=0.0, q=0.0),
        pt("collm", "V=20", att=0.95, gp=collm_gp, ft=collm_ft, q=collm_q),
        pt("separate", "1", att=0.97, gp=1.0, ft=400.0, q=0.3),
        pt("fixed_ratio", "K=1", att=0.7, gp=2.0, ft=900.0, q=0.6),  # below the floor 0.882
        pt("fixed_ratio", "K=9", att=0.93, gp=3.0, ft=200.0, q=0.2),
        pt("leftover", "as is", att=0.9, gp=3.5, ft=300.0, q=0.25),
    ]


def test_goals_reached_with_their_figures() -> None:
    goals = evaluate_goals(grid_points(collm_ft=1000.0, collm_q=0.5, collm_gp=4.8))
    ft = goals["finetune_tokens_vs_best_baseline"]
    assert ft["attainment_floor"] == pytest.approx(0.882)
    # fixed_ratio's frontier crosses the floor between K=9 (0.93, 200) and K=1 (0.7, 900).
    fr = 200.0 + (0.93 - 0.882) / (0.93 - 0.7) * 700.0
    assert ft["best_baseline"] == "separate" and fr < 400.0
    assert ft["ratio"] == pytest.approx(2.5) and ft["reached"] is True
    ttq = goals["time_to_quality_vs_best_baseline"]
    assert ttq["reached"] is None and ttq["reason"] == "no quality curves in this result file"
    sep = goals["goodput_vs_separate"]
    assert sep["ratio"] == pytest.approx(4.8) and sep["reached"]
    co = goals["goodput_vs_best_colocated"]
    # vs fixed_ratio at collm's top gain 0.5 (its segment K=9 -> K=1 crosses it at 2.25): 4.8 / 2.25;
    # vs leftover at its top gain 0.25: 4.8 / 3.5, the smaller, so leftover is the strongest co-located.
    assert co["by_baseline"]["fixed_ratio"]["ratio"] == pytest.approx(4.8 / 2.25)
    assert co["against"] == "leftover" and co["ratio"] == pytest.approx(4.8 / 3.5) and co["reached"]


def test_goals_not_reached_and_undecidable_ones_say_why() -> None:
    goals = evaluate_goals(grid_points(collm_ft=500.0, collm_q=0.3, collm_gp=2.0))
    assert goals["finetune_tokens_vs_best_baseline"]["reached"] is False
    assert goals["goodput_vs_separate"]["reached"] is False
    # Without serving-alone the attainment floor is unknown; without collm nothing can be told.
    no_ref = evaluate_goals([p for p in grid_points(1.0, 1.0, 1.0) if p.policy != "serving_only"])
    assert no_ref["finetune_tokens_vs_best_baseline"]["reached"] is None
    assert "serving_only" in no_ref["finetune_tokens_vs_best_baseline"]["reason"]
    # A policy that never attains the floor counts 0 there: collm below it loses to a baseline above it,
    # and when neither reaches it nothing can be told.
    low = [
        pt("serving_only", "off", att=1.0),
        pt("collm", "v", att=0.5, ft=9.0),
        pt("separate", "1", att=0.99, ft=5.0),
    ]
    g = evaluate_goals(low)["finetune_tokens_vs_best_baseline"]
    assert g["reached"] is False and g["ratio"] == 0.0
    assert g["readings"]["collm"]["how"].startswith("counted 0: no point reaches slo_attainment >= 0.9")
    none = evaluate_goals([*low[:2], pt("separate", "1", att=0.5, ft=5.0)])[
        "finetune_tokens_vs_best_baseline"
    ]
    assert none["reached"] is None and "counted 0" in none["reason"]
    only = evaluate_goals([pt("serving_only", "off"), pt("separate", "1")])
    assert all(v["reached"] is None for v in only.values())


def test_a_baseline_that_trains_nothing_at_the_floor_makes_any_training_an_infinite_lead() -> None:
    pts = [
        pt("serving_only", "off", att=1.0),
        pt("collm", "v", att=0.95, ft=10.0),
        pt("leftover", "l", att=0.95),
    ]
    g = evaluate_goals(pts)["finetune_tokens_vs_best_baseline"]
    assert g["ratio"] == math.inf and g["reached"] is True
    # ... and so does one that trains but never attains the floor.
    pts[2] = pt("leftover", "l", att=0.5, ft=1e6)
    g = evaluate_goals(pts)["finetune_tokens_vs_best_baseline"]
    assert g["ratio"] == math.inf and g["reached"] is True and g["best_baseline"] == "leftover"


def test_sized_window_extends_the_window_to_the_minimum_count() -> None:
    assert sized_window(2.0, 60.0, 100) == (60.0, 120)
    assert sized_window(0.5, 60.0, 100) == (200.0, 100)
    with pytest.raises(ValueError):
        sized_window(0.0, 60.0, 100)


def test_rate_for_attainment_finds_the_crossing_of_a_falling_curve() -> None:
    """Serving alone's attainment falling with the rate: the highest fraction still at the target,
    within the bisection's resolution, each fraction tried recorded; the bounds' own cases."""

    def falling(frac: float) -> float:  # crosses 0.9 at 0.04
        return 1.0 if frac <= 0.04 else max(0.0, 1.0 - (frac - 0.04) * 5)

    frac, tried = rate_for_attainment(falling, 0.9, steps=10)
    assert 0.04 <= frac <= 0.06 and falling(frac) >= 0.9
    assert tried[:2] == [(1.0, 0.0), (0.005, 1.0)] and len(tried) == 12
    assert rate_for_attainment(lambda _f: 0.95, 0.9) == (1.0, [(1.0, 0.95)])
    with pytest.raises(ValueError, match="even at 0.005"):
        rate_for_attainment(lambda _f: 0.5, 0.9)
    with pytest.raises(ValueError):
        rate_for_attainment(falling, 1.5)


def test_points_round_trip_through_their_dict() -> None:
    p = Point("collm", "V=5", 0.9, 1.0, 10.0, 0.2, 50, {"quality_weight_v": 5.0})
    assert Point.from_dict(p.as_dict()) == p


def test_knob_env_sets_the_coordinator_and_the_fixed_ratio_replicas() -> None:
    collm, fixed = knob_grid(("collm",), 2)[0], knob_grid(("fixed_ratio",), 2)[0]
    assert knob_env(collm) == {
        "coordinator": {
            "COLLM_COORDINATOR_QUALITY_WEIGHT_V": "5.0",
            "COLLM_COORDINATOR_ATTAINMENT_TARGET": "0.9",
        }
    }
    assert knob_env(fixed) == {
        "coordinator": {"COLLM_FIXED_RATIO_K": "19"},
        "replica": {"COLLM_FIXED_RATIO_K": "19"},
    }
    # The services read them under these names.
    from collm_coordinator.settings import CoordinatorSettings
    from collm_replica.settings import ReplicaSettings

    env = knob_env(collm)["coordinator"] | knob_env(fixed)["coordinator"]
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        core = CoordinatorSettings()
        assert (core.coordinator_quality_weight_v, core.coordinator_attainment_target) == (5.0, 0.9)
        assert core.fixed_ratio_k == 19 and ReplicaSettings().fixed_ratio_k == 19


def test_stack_config_sets_the_knob_env_last_and_refuses_unknown_services(tmp_path: Path) -> None:
    from collm_bench.experiment.config import ExperimentConfig
    from collm_bench.experiment.live import stack_config

    cfg = ExperimentConfig()
    data = dict.fromkeys(cfg.replica_ids(), tmp_path)
    env = {"coordinator": {"COLLM_COORDINATOR_WARMUP_S": "3"}, "replica": {"COLLM_FIXED_RATIO_K": "2"}}
    scfg = stack_config(cfg, "fixed_ratio", data, tmp_path, env)
    assert scfg.service_env["coordinator"]["COLLM_COORDINATOR_WARMUP_S"] == "3"
    assert scfg.service_env["replica"]["COLLM_FIXED_RATIO_K"] == "2"
    with pytest.raises(ValueError, match="no service 'router'"):
        stack_config(cfg, "collm", data, tmp_path, {"router": {}})


def test_a_domain_without_a_curve_gets_the_mean_relative_curve() -> None:
    a = QualityCurve(domain="a", base_loss=2.0, points=[(0, 2.0), (100, 1.0)])
    b = QualityCurve(domain="b", base_loss=4.0, points=[(0, 4.0), (200, 2.0)])
    c = default_curve("legal", [b, a])
    # Base: mean 3.0; at a's 100 tokens, a is at 0.5 of its base, b (halfway to its 200) at 0.75.
    assert c.domain == "legal" and c.base_loss == 3.0
    assert c.points == [(0, 3.0), (100, pytest.approx(3.0 * 0.625))]
    with pytest.raises(ValueError, match="no calibrated quality curve"):
        default_curve("legal", [])


def test_with_default_curves_adds_only_the_missing_domains() -> None:
    from collm_common.calibration import Calibration

    cal = Calibration.load(Path(__file__).resolve().parents[3] / "bench" / "calibration" / "smollm2.json")
    same, none = with_default_curves(cal, ("math", "medical"))
    assert same is cal and none == []
    more, added = with_default_curves(cal, ("math", "legal"))
    assert added == ["legal"] and [c.domain for c in more.quality][-1] == "legal"
    # The simulator prices the new domain's training like the others'.
    from collm_sim.quality import QualityModel

    q = QualityModel(more.quality)
    assert 0 < q.gain("legal", 2000) < max(q.gain("math", 2000), q.gain("medical", 2000))


def _prior(points: list[Point], base: dict[str, float] | None = None, **config: object) -> dict[str, object]:
    cfg = {"model": "smollm2", "replicas": 2, "window_s": 600.0, "drain_s": 30.0, "rate_rps": 0.765,
           "min_requests": 100, "slo": {"ttft_ms": 9423.0, "tpot_ms": 456.3}, "domains": ["math", "medical"],
           "seed": 0, "runs_dir": "/elsewhere"}  # fmt: skip
    cfg.update(config)
    return {
        "mode": "live",
        "trace": {"name": "conv"},
        "config": cfg,
        "points": [p.as_dict() for p in points],
        "runs": [{"policy": p.policy, "knob": p.knob, "rounds": 3} for p in points],
        "base_losses": base,
    }


def test_a_resumed_run_keeps_the_points_of_its_grid_and_refuses_another_plan() -> None:
    knobs = knob_grid(("collm", "fixed_ratio"), 2, fixed_shares=(0.05, 0.1), collm_weights=(20,),
                      collm_targets=(0.9,))  # fmt: skip
    done = [pt("fixed_ratio", knobs[1].label, ft=8250.0), pt("separate", "1 of 2 train")]
    prior = _prior(done, {"math": 1.2})
    mine = {**prior["config"], "runs_dir": "/here"}  # type: ignore[dict-item]
    kept, base = resume_from(prior, "conv", mine, knobs)
    # Only the knob of this grid is kept (separate is not in it), with its run entry; the base losses too.
    assert list(kept) == [("fixed_ratio", knobs[1].label)]
    point, run = kept[("fixed_ratio", knobs[1].label)]
    assert point["finetune_tokens"] == 8250.0 and run == {"policy": "fixed_ratio", "knob": knobs[1].label,
                                                          "rounds": 3}  # fmt: skip
    assert base == {"math": 1.2}
    assert resume_from(_prior([]), "conv", mine, knobs) == ({}, None)  # nothing done yet: nothing kept
    with pytest.raises(ValueError, match="rate_rps"):
        resume_from(_prior(done, {"math": 1.2}, rate_rps=0.8), "conv", mine, knobs)
    with pytest.raises(ValueError, match="trace"):
        resume_from(prior, "code", mine, knobs)
    with pytest.raises(ValueError, match="base losses"):
        resume_from(_prior(done), "conv", mine, knobs)
    with pytest.raises(ValueError, match="live"):
        resume_from({**prior, "mode": "sim"}, "conv", mine, knobs)


def test_estimate_counts_every_point_with_its_overhead() -> None:
    assert estimate_s(4, 60.0, 30.0, 10.0) == 10.0 + BASE_LOSS_S + 4 * (POINT_OVERHEAD_S + 90.0)


def curves_for(points: list[Point]) -> dict[tuple[str, str], list[list[float]]]:
    """Per point of `grid_points`: served gains [s, math, medical], collm's rising fastest."""
    shapes = {
        "collm": [[0, 0, 0], [60, 0.2, 0.1], [300, 0.4, 0.3], [900, 0.5, 0.4]],
        "separate": [[0, 0, 0], [600, 0.1, 0.1], [1200, 0.3, 0.2]],
        "fixed_ratio": [[0, 0, 0], [600, 0.5, 0.5], [1800, 0.6, 0.6]],
        "leftover": [[0, 0, 0], [900, 0.2, 0.2]],
        "serving_only": [[0, 0, 0]],
    }
    return {(p.policy, p.knob): shapes[p.policy] for p in points}


def test_time_to_quality_against_the_best_baseline_at_the_floor() -> None:
    points = grid_points(collm_ft=1000.0, collm_q=0.5, collm_gp=4.8)
    g = evaluate_goals(points, curves_for(points))["time_to_quality_vs_best_baseline"]
    # At the floor 0.882: separate (ends 0.3, 0.2), fixed_ratio K=9 (0.6, 0.6), leftover (0.2, 0.2); K=1 is
    # below it. K=9 ends best and gets there at 30 min; collm reaches (0.6, 0.6) never: ratio 0.
    assert g["best_baseline"] == "fixed_ratio" and g["baseline_knob"] == "K=9"
    assert g["baseline_min"] == 30.0 and g["collm_min"] is None and g["ratio"] == 0.0 and not g["reached"]
    without_k9 = [p for p in points if p.knob != "K=9"]
    g = evaluate_goals(without_k9, curves_for(without_k9))["time_to_quality_vs_best_baseline"]
    # separate ends best now (0.3, 0.2) at 20 min; collm is there at 5 min: 4x.
    assert g["best_baseline"] == "separate" and g["collm_min"] == 5.0 and g["ratio"] == pytest.approx(4.0)
    assert g["reached"] is True
    # No baseline at the floor: collm wins outright; collm below it: it loses.
    alone = [p for p in points if p.policy in ("collm", "serving_only")]
    assert evaluate_goals(alone, curves_for(alone))["time_to_quality_vs_best_baseline"]["ratio"] == math.inf
    low = [p for p in points if p.policy != "collm"] + [pt("collm", "x", att=0.5)]
    assert evaluate_goals(low, curves_for(low))["time_to_quality_vs_best_baseline"]["ratio"] == 0.0


def test_tables_show_every_point_and_each_goal() -> None:
    from collm_bench.frontier.render import goals_table, markdown

    points = grid_points(collm_ft=1000.0, collm_q=0.5, collm_gp=4.8)
    doc = {
        "mode": "sim",
        "trace": {"name": "conv", "label": "azure 2023 conv"},
        "config": {"replicas": 8, "window_s": 3600.0, "rate_rps": 2.5},
        "points": [p.as_dict() for p in points],
        "goals": evaluate_goals(points, curves_for(points)),
    }
    text = markdown(doc)
    assert text.startswith("sim, azure 2023 conv, 8 replicas, 3600 s windows at 2.500 req/s")
    # fixed_ratio's K=1 trades goodput for quality and tokens: on both of its frontiers.
    assert "| fixed_ratio | K=1 | 0.700 | 2.000 | 900 | 0.6000 | 100 | QT |" in text
    assert "| goodput vs separate at equal quality gain | 3x | yes | 4.80 | separate |  |" in text
    rows = goals_table([doc, doc]).splitlines()
    assert len(rows) == 4 and rows[2].count("yes") == 3 and "0.00 no (fixed_ratio)" in rows[2]
    # A file without the round mode was run with synchronous 25-s rounds.
    assert "| sim conv, 8 replicas, 2.50 req/s, sync 25-s rounds | 2.50 yes (separate) |" in rows[2]
    # A rate where serving alone attains A says so.
    alone = doc | {"config": doc["config"] | {"rate_from": "serving alone attains >= 0.9 in the simulator"}}
    assert "| sim conv, 8 replicas, 2.50 req/s (alone 0.9), sync" in goals_table([alone])


def test_a_sync_rounds_result_gets_its_own_file_name() -> None:
    from collm_bench.frontier.cli import result_path

    assert result_path(Path("out"), "sim", "conv", 8).name == "sim-conv-8r.json"
    assert result_path(Path("out"), "sim", "conv", 8, "sync").name == "sim-conv-8r-sync.json"
    assert result_path(Path("out"), "sim", "code", 8, "async", 0.9).name == "sim-code-8r-alone0.9.json"
    assert result_path(Path("out"), "live", "x/trace.csv", 2, "async").name == "live-trace-2r.json"
    headline = result_path(Path("out"), "live", "conv", 2, "async", None, "headline")
    assert headline.name == "live-conv-2r-headline.json"


def test_a_missing_trace_exits_2_with_one_clear_line(tmp_path: Path) -> None:
    import io

    from collm_bench.frontier.cli import main

    err = io.StringIO()
    argv = ["--preset", "headline", "--traces-dir", str(tmp_path), "--out-dir", str(tmp_path / "out")]
    assert main([*argv, "--dry-run"], io.StringIO(), err) == 2
    assert "not found" in err.getvalue() and "--synthetic-fallback" in err.getvalue()
    assert not (tmp_path / "out").exists()
