"""The experiment harness's pure parts: drain cut, the simulator's workload against the live plan, SLOs,
configuration, the stack each policy gets and what a live run reads from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from collm_bench.experiment import setup
from collm_bench.experiment.config import ExperimentConfig
from collm_bench.experiment.live import Observer, Phases, parse_counter, stack_config
from collm_bench.experiment.predict import drain_cut, sim_config, simulate_run, workload_spec
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


def trace_cfg(tmp_path: Path, **kw: object) -> ExperimentConfig:
    (tmp_path / "traces").mkdir(exist_ok=True)
    (tmp_path / "traces" / "t.csv").write_text(TRACE)
    return ExperimentConfig(
        traces=(str(tmp_path / "traces" / "t.csv"),), traces_dir=tmp_path / "traces", **kw
    )  # type: ignore[arg-type]


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

    missing = ExperimentConfig(traces=("conv",), traces_dir=tmp_path / "nowhere")
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


def test_serving_only_simulates_collm_with_fine_tuning_off(tmp_path: Path) -> None:
    cfg = trace_cfg(tmp_path, duration_s=20.0)
    source = setup.resolve_sources(cfg)[0]
    sc = sim_config(cfg, source, 1.0, Slo(5000.0, 500.0), "serving_only", 100)
    assert sc.policy == "collm" and sc.coscheduler == "off"
    assert sim_config(cfg, source, 1.0, Slo(5000.0, 500.0), "fixed_ratio", 100).coscheduler == "fixed"


# --- configuration and the stack ----------------------------------------------------------------------
def test_config_validation_and_replica_domains() -> None:
    cfg = ExperimentConfig(replicas=3)
    assert [cfg.replica_domain(r) for r in cfg.replica_ids()] == ["math", "medical", "math"]
    assert cfg.replicas_of("math") == ["r0", "r2"]
    for bad in ({"round_deadline_s": 99.0}, {"replicas": 0}, {"domains": ()}, {"traces": ()},
                {"duration_s": 0.0}):  # fmt: skip
        with pytest.raises(ValueError):
            ExperimentConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("policy", "cosched"),
    [("collm", "slo"), ("separate", "slo"), ("fixed_ratio", "fixed"), ("leftover", "leftover"),
     ("serving_only", "off")],
)  # fmt: skip
def test_each_policy_gets_its_coordinator_and_co_scheduler(tmp_path: Path, policy: str, cosched: str) -> None:
    cfg = ExperimentConfig(replicas=3)
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
    monkeypatch.setattr("collm_bench.experiment.live.time.monotonic", lambda: next(clock))
    ph = Phases(t=0.0)
    ph.mark("stack_start")
    ph.mark("v1")
    ph.mark("read_out")
    assert ph.seconds == {"stack_start": 10.0, "v1": 12.5, "read_out": 0.5}
    assert ph.line() == "stack start 10.0, v1 12.5, read out 0.5 (s)"


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


def test_cpu_seconds_of_the_stack_processes() -> None:
    import os
    import subprocess
    import sys

    from collm_bench.experiment.live import cpu_seconds, machine_cpu_delta, own_cpu_seconds

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
