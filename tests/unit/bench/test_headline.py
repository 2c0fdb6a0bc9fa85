"""The headline benchmark's pure parts: rate search, drain cut, the simulator's workload against the live
plan, ratios and goals, the table, configuration and the stack each policy gets."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest

from collm_bench.headline import setup
from collm_bench.headline.cli import build_parser, config_from_args, main, parse_rates
from collm_bench.headline.config import HeadlineConfig
from collm_bench.headline.live import Observer, Phases, parse_counter, stack_config
from collm_bench.headline.outputs import probe_note
from collm_bench.headline.predict import cost_band, drain_cut, sim_config, simulate_run, workload_spec
from collm_bench.headline.rates import BestBaseline, grid_counts, search_rate
from collm_bench.headline.table import compact, compare, markdown
from collm_common.calibration import Calibration
from collm_common.wire.control import CoordinatorDecisions, ReplicaDecision
from collm_common.wire.rounds import RoundOutcome
from collm_workload.goodput import summarize
from collm_workload.records import RequestRecord
from collm_workload.workload import Slo, draw_domains

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
CALIBRATION = REPO / "bench" / "calibration" / "smollm2.json"

TRACE = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(
    f"2023-11-16 18:17:{i // 4:02d}.{(i % 4) * 25:02d}00000,{300 + 37 * (i % 11)},{20 + 13 * (i % 7)}"
    for i in range(200)
)


def trace_cfg(tmp_path: Path, **kw: object) -> HeadlineConfig:
    (tmp_path / "traces").mkdir(exist_ok=True)
    (tmp_path / "traces" / "t.csv").write_text(TRACE)
    return HeadlineConfig(traces=(str(tmp_path / "traces" / "t.csv"),), traces_dir=tmp_path / "traces", **kw)  # type: ignore[arg-type]


# --- rate search --------------------------------------------------------------------------------------
def cliff(at: dict[str, int]) -> object:
    """Attainment 1.0 up to `at[policy]` requests, then falling by 0.02 per request (monotone)."""
    return lambda policy, n: 1.0 if n <= at[policy] else max(0.0, 1.0 - 0.02 * (n - at[policy]))


def test_search_finds_the_last_count_holding_the_target_for_the_best_baseline() -> None:
    best = BestBaseline(
        cliff({"separate": 40, "fixed_ratio": 10, "leftover": 5}), ("separate", "fixed_ratio", "leftover")
    )  # type: ignore[arg-type]
    light = search_rate(best, "light", 0.95, [5, 20, 60, 120], 60.0)
    # separate: 1 - 0.02 (n - 40) >= 0.95  <=>  n <= 42.5
    assert light.n_requests == 42 and light.best_baseline == "separate"
    assert light.rate_rps == pytest.approx(42 / 60) and light.attainment == pytest.approx(0.96)
    heavy = search_rate(best, "heavy", 0.85, [5, 20, 60, 120], 60.0)
    assert heavy.n_requests == 47 and heavy.attainment == pytest.approx(0.86)
    assert "first crossing" in heavy.how
    # Memoised: every count simulated once per baseline.
    assert set(best.cache) >= {5, 20, 42, 43, 47, 48, 60}


def test_search_extends_the_grid_downward_and_reports_bounds() -> None:
    best = BestBaseline(cliff({"separate": 3}), ("separate",))  # type: ignore[arg-type]
    c = search_rate(best, "light", 0.95, [40, 80], 10.0)
    assert c.n_requests == 5 and "first crossing" in c.how  # 1 - 0.02 (n - 3) >= 0.95 <=> n <= 5.5
    never = BestBaseline(lambda p, n: 0.5, ("separate",))
    c = search_rate(never, "light", 0.95, [40, 80], 10.0)
    assert c.attainment == 0.5 and "lowest rate tried" in c.how
    always = BestBaseline(lambda p, n: 1.0, ("separate",))
    c = search_rate(always, "light", 0.95, [40, 80], 10.0)
    assert c.n_requests == 80 and "lower bound" in c.how


def test_grid_counts() -> None:
    assert grid_counts(1.0, 90.0, (0.1, 0.5, 1.0, 1.0)) == [9, 45, 90]
    assert grid_counts(0.001, 10.0, (0.5,)) == [1]
    with pytest.raises(ValueError):
        grid_counts(0.0, 10.0, (0.5,))


# --- drain cut and the simulator's workload ------------------------------------------------------------
def rec(i: int, status: str, end_s: float, ttft_ms: float = 100.0) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{i}", index=i, domain="math", model="math", status=status,  # type: ignore[arg-type]
        scheduled_s=float(i), sent_s=float(i), end_s=end_s, ttft_ms=ttft_ms, e2e_ms=(end_s - i) * 1e3,
        completion_tokens=5, usage_reported=True, slo_ttft_ms=1000.0, slo_tpot_ms=5000.0,
    )  # fmt: skip


def test_drain_cut_turns_late_completions_into_timeouts() -> None:
    records = [rec(0, "ok", 1.0), rec(1, "ok", 30.0), rec(2, "rejected", 2.0), rec(3, "ok", 12.0)]
    cut = drain_cut(records, 12.0)
    assert [r.status for r in cut] == ["ok", "timeout", "rejected", "ok"]
    assert cut[1].end_s == 12.0 and records[1].status == "ok"  # the input is left alone
    s = summarize(cut, timeline_bin_s=None)
    assert s["counts"]["good"] == 2 and s["duration_s"] == pytest.approx(12.0)
    assert s["goodput_rps"] == pytest.approx(2 / 12.0)


def test_simulated_workload_is_the_live_plan(tmp_path: Path) -> None:
    from collm_sim.workload import build_workload

    cfg = trace_cfg(tmp_path, duration_s=30.0, max_output_tokens=64, trace_start_s=5.0)
    source = setup.resolve_sources(cfg)[0]
    slo = Slo(5000.0, 300.0)
    for rate in (0.5, 2.0, 4.5):
        live = setup.shapes(cfg, source, rate)
        wl = build_workload(workload_spec(cfg, source, rate, slo), tuple(sorted(cfg.domains)))
        assert len(wl) == len(live) == round(rate * cfg.duration_s)
        np.testing.assert_allclose(wl.arrival_s, [s.arrival_s for s in live])
        assert list(wl.input_tokens) == [s.input_tokens for s in live]
        assert list(wl.output_tokens) == [s.output_tokens for s in live]
        assert [wl.domains[d] for d in wl.domain] == draw_domains(len(live), cfg.mix, cfg.seed)
        assert max(wl.output_tokens) <= 64


def test_synthetic_fallback_is_labelled_and_matches_the_simulator(tmp_path: Path) -> None:
    from collm_sim.workload import build_workload

    missing = HeadlineConfig(traces=("conv",), traces_dir=tmp_path / "nowhere")
    with pytest.raises(setup.SetupError, match="synthetic-fallback"):
        setup.resolve_sources(missing)
    cfg = dataclasses.replace(missing, synthetic_fallback=True, duration_s=20.0)
    (source,) = setup.resolve_sources(cfg)
    assert source.synthetic and "SYNTHETIC gamma" in source.label(cfg)
    live = setup.shapes(cfg, source, 2.0)
    wl = build_workload(workload_spec(cfg, source, 2.0, Slo(1.0, 1.0)), tuple(sorted(cfg.domains)))
    np.testing.assert_allclose(wl.arrival_s, [s.arrival_s for s in live])
    assert set(wl.input_tokens) == {round(cfg.synthetic_input_tokens * cfg.input_scale)}


def test_slo_from_the_calibration(tmp_path: Path) -> None:
    cal = Calibration.load(CALIBRATION)
    cfg = trace_cfg(tmp_path)
    source = setup.resolve_sources(cfg)[0]
    slo = setup.slo_for(cfg, source, cal, 16)
    fitted = [round(r.input_tokens * cfg.input_scale) for r in source.requests]
    p99 = int(np.percentile(fitted, 99))
    assert slo.ttft_ms == pytest.approx(3 * cal.cost.prefill_ms(p99), abs=0.1)
    assert slo.tpot_ms == pytest.approx(3 * cal.cost.decode_ms(16), abs=0.1)
    given = dataclasses.replace(cfg, slo_ttft_ms=123.0, slo_tpot_ms=45.0)
    assert setup.slo_for(given, source, None, 16) == Slo(123.0, 45.0)
    with pytest.raises(setup.SetupError):
        setup.slo_for(cfg, source, None, 16)


def test_simulate_run_is_deterministic_and_cut_at_the_drain(tmp_path: Path) -> None:
    cal = Calibration.load(CALIBRATION)
    cfg = trace_cfg(tmp_path, duration_s=20.0, drain_s=0.5)
    source = setup.resolve_sources(cfg)[0]
    a = simulate_run(cfg, cal, source, 3.0, Slo(5000.0, 500.0), "collm", 100)
    b = simulate_run(cfg, cal, source, 3.0, Slo(5000.0, 500.0), "collm", 100)
    assert a["summary"]["goodput_rps"] == b["summary"]["goodput_rps"]
    assert a["summary"]["counts"]["submitted"] == 60
    # A 0.5 s drain after the last arrival leaves the last requests unfinished at this rate.
    assert a["summary"]["counts"]["by_status"]["timeout"] > 0
    # What the live counters could show at that cut: less inference than the whole simulated run, and
    # the tokens of the steps done by then (a prompt's prefill and each output token after the first).
    to_cut = a["sim"]["inference_by_replica_to_cut"]
    whole = a["sim"]["busy_s_by_replica"]
    assert set(to_cut) == set(whole)
    assert sum(s for s, _ in to_cut.values()) < sum(w["inference"] for w in whole.values())
    assert all(0 < n and 0 < s <= whole[r]["inference"] for r, (s, n) in to_cut.items())
    longer = simulate_run(
        dataclasses.replace(cfg, drain_s=600.0), cal, source, 3.0, Slo(5000.0, 500.0), "collm", 100
    )
    assert longer["summary"]["counts"]["by_status"].get("timeout", 0) == 0
    for rid, (s, _n) in longer["sim"]["inference_by_replica_to_cut"].items():
        assert s == pytest.approx(longer["sim"]["busy_s_by_replica"][rid]["inference"], abs=2e-3)
    # Fine-tuning tokens too are read at the cut; a cut after everything sees the whole run's.
    assert a["sim"]["ft_tokens_to_cut"] <= a["sim"]["ft_tokens"]
    assert longer["sim"]["ft_tokens_to_cut"] == longer["sim"]["ft_tokens"]
    assert a["sim"]["cut_s"] < longer["sim"]["cut_s"]


# --- ratios, goals and the table -----------------------------------------------------------------------
def fig(goodput: float, att: float, q_end: float | None, q_mean: float | None) -> dict[str, object]:
    return {
        "goodput_rps": goodput, "attainment": att, "quality_gain_end": q_end, "quality_gain_mean": q_mean,
        "good": 9, "submitted": 10, "ttft_ms_p50": 100.0, "ttft_ms_p99": 900.0, "tpot_ms_p50": 50.0,
        "tpot_ms_p99": 90.0, "ft_tokens": 1234.0, "rounds": {"published": 2, "held_back": 1, "aborted": 0},
        "timeline": {"t_s": [0.0, 10.0], "goodput_rps": [0.5, 0.7], "mean_quality_gain": [0.0, 0.1]},
    }  # fmt: skip


def test_compare_ratios_goals_and_simulator_error() -> None:
    live = {
        "collm": fig(0.9, 0.95, 0.10, 0.05),
        "separate": fig(0.3, 0.40, 0.20, 0.10),
        "fixed_ratio": fig(0.6, 0.70, 0.05, 0.02),
        "leftover": fig(0.5, 0.60, 0.08, 0.04),
    }
    sim = {p: {**f, "goodput_rps": f["goodput_rps"] * 1.2} for p, f in live.items()}  # type: ignore[operator]
    sim["leftover"]["goodput_rps"] = 0.5 * 1.3
    c = compare(live, sim)
    assert c["goodput_ratio"] == pytest.approx({"separate": 3.0, "fixed_ratio": 1.5, "leftover": 1.8})
    assert c["best_baseline"] == "fixed_ratio" and c["best_colocated"] == "fixed_ratio"
    assert c["goals"]["goodput_vs_separate"] == {"goal": 3.0, "reached": pytest.approx(3.0), "met": True}
    assert c["goals"]["goodput_vs_best_colocated"]["met"] is True
    assert c["goals"]["quality_end_vs_best_baseline"]["reached"] == pytest.approx(2.0)
    assert c["quality_end_ratio"]["separate"] == pytest.approx(0.5)
    assert c["sim_error"]["collm"] == pytest.approx(0.2) and c["sim_error"]["leftover"] == pytest.approx(0.3)
    assert c["sim_within_tolerance"] is False
    # No gain on the baseline's side: the ratio is unbounded, not a division error.
    zero = compare({"collm": fig(1, 1, 0.1, 0.1), "separate": fig(0, 0, 0.0, None)}, None)
    assert (
        zero["goodput_ratio"]["separate"] == float("inf") and zero["quality_mean_ratio"]["separate"] is None
    )
    text = markdown(
        {
            "traces": [
                {"label": "azure conv", "rates": {"light": {"rate_rps": 0.5, "compare": c, "given": True,
                 "runs": {p: {"live": live[p], "sim": sim[p]} for p in live}}}}
            ]
        }
    )  # fmt: skip
    assert text.count("| azure conv | light 0.500 |") == 4
    assert "| collm | 0.900 | 1.080 (+20%) | 0.950 (9/10) | 100 / 900 | 50 / 90 | 1234 | 2 / 3 |" in text
    assert "goodput 3.00, 1.50, 1.80" in text and "rate given on the command line" in text


def test_serving_only_is_a_ceiling_beside_the_goals_not_a_baseline() -> None:
    live = {
        "collm": fig(0.9, 0.95, 0.10, 0.05),
        "separate": fig(0.3, 0.40, 0.20, 0.10),
        "fixed_ratio": fig(0.6, 0.70, 0.05, 0.02),
        "serving_only": fig(1.2, 0.99, None, None),
    }
    c = compare(live, None)
    assert c["best_baseline"] == "fixed_ratio" and "serving_only" not in c["goodput_ratio"]
    assert c["goals"]["goodput_vs_best_colocated"]["ceiling"] == pytest.approx(2.0)
    assert c["goals"]["goodput_vs_separate"]["ceiling"] == pytest.approx(4.0)
    assert "ceiling" not in c["goals"]["quality_end_vs_best_baseline"]
    assert c["collm_vs_ceiling"] == pytest.approx(0.75)
    block = {"rate_rps": 0.5, "compare": c, "given": True, "runs": {p: {"live": live[p]} for p in live}}
    text = markdown({"traces": [{"label": "azure conv", "rates": {"heavy": block}}]})
    assert "| serving_only | 1.200 |" in text and "collm / serving only (fine-tuning off): 0.75" in text
    assert "goodput_vs_best_colocated 1.50 (>= 1.3: met; serving only 2.00)" in text
    # Without the reference run, nothing is said of a ceiling.
    assert "collm_vs_ceiling" not in compare({p: live[p] for p in ("collm", "fixed_ratio")}, None)


def test_serving_only_simulates_collm_with_fine_tuning_off(tmp_path: Path) -> None:
    cfg = trace_cfg(tmp_path, duration_s=20.0)
    source = setup.resolve_sources(cfg)[0]
    sc = sim_config(cfg, source, 1.0, Slo(5000.0, 500.0), "serving_only", 100)
    assert sc.policy == "collm" and sc.coscheduler == "off"
    assert sim_config(cfg, source, 1.0, Slo(5000.0, 500.0), "fixed_ratio", 100).coscheduler == "fixed"
    assert HeadlineConfig(policies=("collm", "serving_only")).policies[-1] == "serving_only"


def test_the_simulated_range_brackets_the_probe_and_says_whether_it_holds_the_live_figure() -> None:
    assert cost_band([1.07, 0.85, 1.22, 0.94]) == (0.85, 1.22)
    with pytest.raises(ValueError):
        cost_band([])
    live = {"collm": fig(0.9, 0.95, 0.1, 0.05), "fixed_ratio": fig(0.5, 0.4, 0.05, 0.02)}
    sim = {p: dict(f) for p, f in live.items()}
    sim["collm"]["goodput_range"] = {"cost_factors": [0.85, 1.22], "range_rps": [0.8, 1.1]}
    sim["fixed_ratio"]["goodput_range"] = {"cost_factors": [0.85, 1.22], "range_rps": [0.55, 0.9]}
    c = compare(live, sim)
    assert c["sim_range_covers"] == {"collm": True, "fixed_ratio": False}
    block = {
        "rate_rps": 1.0,
        "compare": c,
        "given": True,
        "runs": {p: {"live": live[p], "sim": sim[p]} for p in live},
    }
    text = markdown({"traces": [{"label": "azure conv", "rates": {"heavy": block}}]})
    assert "| 0.900 (+0%; 0.800-1.100) |" in text and "ratio): collm of 2" in text


def test_compact_takes_the_summary_figures() -> None:
    records = [rec(0, "ok", 1.0), rec(1, "error", 2.0)]
    c = compact(summarize(records, timeline_bin_s=1.0), {"ft_tokens": 7})
    assert c["submitted"] == 2 and c["good"] == 1 and c["attainment"] == 0.5 and c["ft_tokens"] == 7
    assert c["timeline"]["goodput_rps"]


# --- configuration and the stack ----------------------------------------------------------------------
def test_config_validation_and_replica_domains() -> None:
    cfg = HeadlineConfig(replicas=3)
    assert [cfg.replica_domain(r) for r in cfg.replica_ids()] == ["math", "medical", "math"]
    assert cfg.replicas_of("math") == ["r0", "r2"] and cfg.needs_search() == ["light", "heavy"]
    assert HeadlineConfig(rates={"light": 1.0}).needs_search() == ["heavy"]
    for bad in ({"policies": ("nope",)}, {"rates": {"medium": 1.0}}, {"rates": {"light": 0.0}},
                {"round_deadline_s": 99.0}, {"heavy_attainment": 0.99}, {"replicas": 0}):  # fmt: skip
        with pytest.raises(ValueError):
            HeadlineConfig(**bad)  # type: ignore[arg-type]


def test_arguments_override_the_presets() -> None:
    assert parse_rates("light=0.5,heavy=1.5") == {"light": 0.5, "heavy": 1.5}
    assert parse_rates("0.5,1.5") == {"light": 0.5, "heavy": 1.5}
    cfg = config_from_args(build_parser().parse_args([]))
    assert cfg == HeadlineConfig()
    argv = ["--model", "tiny", "--duration", "7", "--rates", "heavy=9", "--rate-labels", "heavy"]
    tiny = config_from_args(build_parser().parse_args(argv))
    assert tiny.model == "tiny" and tiny.duration_s == 7 and tiny.max_output_tokens == 8
    assert tiny.rates == {"light": 1.0, "heavy": 9.0} and tiny.rate_labels == ("heavy",)
    assert tiny.calibration is None and not tiny.simulate and tiny.needs_search() == []


def test_speed_probe_is_on_by_default_and_reported_in_the_header() -> None:
    assert HeadlineConfig().speed_probe
    assert not config_from_args(build_parser().parse_args(["--no-speed-probe"])).speed_probe
    assert probe_note({"calibration": {"path": "x"}}) == "" and probe_note({"calibration": None}) == ""
    note = probe_note({"calibration": {"speed_probe": {"factor": 1.234}}})
    assert "1.23x the calibration's" in note and "after" not in note
    # With --probe-after, the second probe's figure is said beside the first.
    assert not HeadlineConfig().speed_probe_after
    assert config_from_args(build_parser().parse_args(["--probe-after"])).speed_probe_after
    probes = {"speed_probe": {"factor": 1.234}, "speed_probe_after": {"factor": 1.5}}
    both = probe_note({"calibration": probes})
    assert "1.23x the calibration's (median) in a probe before the runs" in both
    assert "1.50x in one after them" in both and "scaled by that" in both
    # Costs scaled by kind say so, with each kind's factor (as results.json holds them: batch keys in text).
    kinds = {"prefill": 0.8, "decode": {"16": 1.05, "1": 0.98}, "train": 0.78}
    by_kind = probe_note({"calibration": {"speed_probe": {"factor": 0.79, "kind_factors": kinds}}})
    assert "scaled by kind: prefill 0.80, decode at batch 1 / 16 0.98 / 1.05, training 0.78" in by_kind


def test_missing_traces_exit_2_with_one_clear_line(tmp_path: Path) -> None:
    err = io.StringIO()
    rc = main(["--traces-dir", str(tmp_path), "--out-dir", str(tmp_path / "out")], io.StringIO(), err)
    assert rc == 2
    assert "not found" in err.getvalue() and "--synthetic-fallback" in err.getvalue()


@pytest.mark.parametrize(
    ("policy", "cosched"),
    [("collm", "slo"), ("separate", "slo"), ("fixed_ratio", "fixed"), ("leftover", "leftover"),
     ("serving_only", "off")],
)  # fmt: skip
def test_each_policy_gets_its_coordinator_and_co_scheduler(tmp_path: Path, policy: str, cosched: str) -> None:
    cfg = HeadlineConfig(replicas=3)
    data = {r: tmp_path / r for r in cfg.replica_ids()}
    sc = stack_config(cfg, policy, data, tmp_path)
    # The reference run is collm's coordinator with fine-tuning off on every replica.
    assert sc.coordinator_policy == ("collm" if policy == "serving_only" else policy)
    assert sc.model == "smollm2"
    assert [(r.replica_id, r.data_dir, r.env["COLLM_COSCHEDULER"]) for r in sc.replicas] == [
        (r, str(tmp_path / r), cosched) for r in ("r0", "r1", "r2")
    ]
    assert sc.service_env["aggregator"]["COLLM_DEFAULT_PLAN"] == "false"
    for service in ("aggregator", "replica"):
        assert sc.service_env[service]["COLLM_EVAL_MAX_EXAMPLES"] == "8"
        assert sc.service_env[service]["COLLM_EVAL_MAX_TOKENS"] == "1024"
    co = sc.service_env["coordinator"]
    assert co["COLLM_COORDINATOR_SLOW_INTERVAL_S"] == "60.0" and co["COLLM_COORDINATOR_WARMUP_S"] == "10.0"
    assert co["COLLM_COORDINATOR_ROUND_DEADLINE_S"] == "55.0" and co["COLLM_COORDINATOR_ROUNDS"] == "async"
    assert co["COLLM_COORDINATOR_CALIBRATION_PATH"].endswith("smollm2.json")
    assert sc.start_servers and sc.nats_url != "nats://127.0.0.1:4222" and sc.metrics_port_base == 0


async def test_observer_counts_rounds_in_the_window() -> None:
    obs = Observer(t0=0.0)
    times = iter([1.0, 5.0, 2.0, 50.0, 3.0, 99.0])
    obs.now = lambda: next(times)  # type: ignore[method-assign]

    def out(rid: int, state: str) -> RoundOutcome:
        return RoundOutcome(round_id=rid, adapter="math", state=state, base_version=1)  # type: ignore[arg-type]

    events = [(1, "opened"), (1, "published"), (2, "opened"), (2, "held_back"), (3, "opened"), (3, "aborted")]
    for rid, state in events:
        await obs.on_round(out(rid, state), None)
    assert obs.round_counts(0.0, 60.0) == {"opened": 3, "published": 1, "held_back": 1, "aborted": 0}


def test_phases_time_each_step_from_the_previous_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 22.5, 23.0])
    monkeypatch.setattr("collm_bench.headline.live.time.monotonic", lambda: next(clock))
    ph = Phases(t=0.0)
    ph.mark("stack_start")
    ph.mark("v1")
    ph.mark("read_out")
    assert ph.seconds == {"stack_start": 10.0, "v1": 12.5, "read_out": 0.5}
    assert ph.line() == "stack start 10.0, v1 12.5, read out 0.5 (s)"


def test_default_run_fits_a_quarter_of_an_hour() -> None:
    # Eight runs (two rates, four policies) of ~13 s stack start, arrivals, a full drain and ~4 s of
    # teardown, after a ~30 s speed probe: each run logs its measured phases (`phases_s` in results.json).
    cfg = HeadlineConfig()
    runs = len(cfg.rate_labels) * len(cfg.policies)
    probe_s = 30 if cfg.speed_probe else 0
    assert probe_s + runs * (13 + cfg.duration_s + cfg.drain_s + 4) <= 15 * 60


def test_parse_counter() -> None:
    text = (
        "# HELP collm_replica_ft_tokens_total Tokens processed by co-executed fine-tuning\n"
        "# TYPE collm_replica_ft_tokens_total counter\n"
        'collm_replica_ft_tokens_total{replica="r0"} 512.0\n'
        'collm_replica_generated_tokens_total{replica="r0"} 9.0\n'
    )
    assert parse_counter(text, "collm_replica_ft_tokens") == {"r0": 512.0}


def test_parse_counter_by_another_label() -> None:
    text = (
        "# HELP collm_replica_ft_limit_iterations_total Iterations by limit\n"
        "# TYPE collm_replica_ft_limit_iterations_total counter\n"
        'collm_replica_ft_limit_iterations_total{limit="share",replica="r0"} 7.0\n'
        'collm_replica_ft_limit_iterations_total{limit="slack",replica="r0"} 3.0\n'
        'collm_replica_ft_tokens_total{replica="r0"} 512.0\n'
    )
    limits = parse_counter(text, "collm_replica_ft_limit_iterations", by="limit")
    assert limits == {"share": 7.0, "slack": 3.0}
    assert parse_counter("", "collm_replica_ft_limit_iterations", by="limit") == {}


async def test_observer_keeps_share_changes_only() -> None:
    obs = Observer(t0=0.0)
    times = iter([1.0, 2.0, 3.0])
    obs.now = lambda: next(times)  # type: ignore[method-assign]

    def fast(share: float, reason: str, loop: str = "fast") -> CoordinatorDecisions:
        r = ReplicaDecision(replica_id="r0", ft_share=share, routing_weight=1.0, reason=reason)
        return CoordinatorDecisions(ts_unix_s=0.0, policy="collm", loop=loop, replicas=[r])  # type: ignore[arg-type]

    await obs.on_decision(fast(0.2, "slack"), None)
    await obs.on_decision(fast(0.2, "slack"), None)  # unchanged: left out
    await obs.on_decision(fast(0.2, "slack", loop="slow"), None)  # slow-loop messages are not shares
    await obs.on_decision(fast(0.0, "slo_risk"), None)
    rows = [(r["t_s"], r["ft_share"], r["reason"]) for r in obs.shares]
    assert rows == [(1.0, 0.2, "slack"), (3.0, 0.0, "slo_risk")]
    assert obs.slow_ticks == [2.0]  # when the slow loop ran (its round plans follow)


def test_heavy_takes_the_count_nearer_the_target() -> None:
    # separate: 1.0 up to 40 requests, then 0.80 at 41: 0.80 is nearer 85% than 1.0.
    steep = BestBaseline(lambda p, n: 1.0 if n <= 40 else 0.80, ("separate",))
    assert search_rate(steep, "heavy", 0.85, [10, 80], 60.0, nearest=True).n_requests == 41
    assert search_rate(steep, "heavy", 0.85, [10, 80], 60.0).n_requests == 40
    gentle = BestBaseline(lambda p, n: 1.0 if n <= 40 else 0.70, ("separate",))
    assert search_rate(gentle, "heavy", 0.85, [10, 80], 60.0, nearest=True).n_requests == 40


def test_simulated_only_run_dedupes_equal_rates_and_renders_again(tmp_path: Path) -> None:
    cfg = trace_cfg(tmp_path)
    trace = cfg.traces[0]
    out = io.StringIO()
    argv = ["--no-live", "--traces", trace, "--duration", "10", "--rates", "light=1,heavy=1.01",
            "--out-dir", str(tmp_path / "out"), "--policies", "collm,separate"]  # fmt: skip
    assert main(argv, out, io.StringIO()) == 0
    (root,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
    results = json.loads((root / "results.json").read_text())
    (tr,) = results["traces"]
    assert list(tr["rates"]) == ["light"] and "run once" in tr["notes"][0]
    runs = tr["rates"]["light"]["runs"]
    assert set(runs) == {"collm", "separate"} and all("sim" in r and "live" not in r for r in runs.values())
    assert tr["rates"]["light"]["compare"]["simulated_only"] is True
    table = (tmp_path / "out" / "latest.md").read_text()
    assert "(not run live)" in table and "run once" in table
    again = io.StringIO()
    assert main(["--render", str(root / "results.json")], again, io.StringIO()) == 0
    assert (root / "table.md").read_text() == table


def test_cpu_seconds_of_the_stack_processes() -> None:
    import os
    import subprocess
    import sys

    from collm_bench.headline.live import cpu_seconds, machine_cpu_delta, own_cpu_seconds

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # noqa: S603
    try:
        sum(i * i for i in range(200_000))  # some CPU time of this process
        # 2**22 + 1 is past Linux's largest pid: a process that is not there.
        got = cpu_seconds({"load generator": os.getpid(), "sleeper": child.pid, "gone": 2**22 + 1})
    finally:
        child.kill()
        child.wait()
    assert got["load generator"] > 0 and "sleeper" in got and got["sleeper"] >= 0
    assert "gone" not in got
    assert 0 < own_cpu_seconds() <= got["load generator"] + 1.0  # this process alone, not its children
    import psutil

    before = psutil.cpu_times()
    sum(i * i for i in range(200_000))
    delta = machine_cpu_delta(before, psutil.cpu_times())
    assert set(delta) == {"busy", "idle", "steal"} and delta["busy"] >= 0 and delta["steal"] >= 0
