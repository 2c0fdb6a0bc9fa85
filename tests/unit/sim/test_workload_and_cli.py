"""Workloads (trace replay, repetition, domain draw) and the command line's refusal without calibration."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from collm_sim.cli import main
from collm_sim.workload import WorkloadSpec, build_workload, repeat_trace
from collm_workload.traces import TraceRequest
from tests.unit.sim.calib import calibration_for_tests

pytestmark = pytest.mark.unit


def test_trace_replay_at_a_rate_scales_time_and_lengths(shared_data: Path) -> None:
    spec = WorkloadSpec(trace="conv", traces_dir=str(shared_data / "traces"), rate_rps=20.0, duration_s=60.0,
                        input_scale=0.5, max_context_tokens=1024, seed=3)  # fmt: skip
    wl = build_workload(spec, ("med", "bank"))
    assert len(wl) == 1200
    assert wl.arrival_s[0] == 0.0 and wl.arrival_s[-1] < 60.0
    assert np.all(np.diff(wl.arrival_s) >= 0)
    assert int((wl.input_tokens + wl.output_tokens).max()) <= 1024
    again = build_workload(spec, ("med", "bank"))
    assert np.array_equal(wl.domain, again.domain) and set(np.unique(wl.domain)) == {0, 1}


def test_large_cluster_replays_the_trace_back_to_back(shared_data: Path) -> None:
    spec = WorkloadSpec(
        trace="code", traces_dir=str(shared_data / "traces"), rate_rps=200.0, duration_s=100.0
    )
    wl = build_workload(spec, ("med",))
    assert len(wl) == 20_000 > 8_819


def test_repeat_trace_keeps_the_shape() -> None:
    t = [TraceRequest(0.0, 1, 1), TraceRequest(1.0, 2, 2), TraceRequest(3.0, 3, 3)]
    r = repeat_trace(t, 7)
    assert len(r) == 9
    assert [x.arrival_s for x in r] == [0.0, 1.0, 3.0, 4.5, 5.5, 7.5, 9.0, 10.0, 12.0]
    assert repeat_trace(t, 2) is t


def test_cli_refuses_to_run_without_a_calibration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--calibration", str(tmp_path / "missing.json"), "--arrivals", "poisson", "--rate", "1"])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_runs_and_writes_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cal = tmp_path / "cal.json"
    calibration_for_tests().save(cal)
    out = tmp_path / "out.json"
    args = ["--calibration", str(cal), "--arrivals", "poisson", "--trace", "none", "--rate", "2"]
    args += ["--duration", "20", "--replicas", "2", "--policy", "collm,leftover", "--out", str(out)]
    rc = main(args)
    assert rc == 0
    text = capsys.readouterr().out
    assert "collm" in text and "leftover" in text
    import json

    doc = json.loads(out.read_text())
    assert set(doc["runs"]) == {"collm", "leftover"}
    assert (
        doc["runs"]["collm"]["summary"]["counts"]["submitted"] == 40
        or doc["runs"]["collm"]["summary"]["counts"]["submitted"] > 0
    )
