"""The live frontier's pipeline with the tiny model (`python -m collm_bench frontier --tiny`: 2 policies x 2
knobs, a fresh stack per point, seconds-long windows), and the harness's stop on SIGTERM, on the grid
and on the headline preset: every process a run started is gone when the harness exits."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.bench.bench_data import REPO, harness_inputs, run_harness

pytestmark = pytest.mark.integration


# Four fresh stacks of the tiny model: 59 s on this 2-core machine under the heavy-work lock.
def test_tiny_frontier_runs_each_knob_on_a_fresh_stack(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [
        "--tiny",
        *harness_inputs(tmp_path),
        "--out-dir",
        str(out),
        "--runs-dir",
        str(tmp_path / "runs"),
    ]
    proc = run_harness("frontier", argv, 240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(proc.stdout)  # the table, shown with -s
    assert "estimated" in proc.stdout.split("\n[frontier] collm")[0]  # the estimate comes before any run
    results = json.loads((out / "live-trace-2r.json").read_text())
    assert results["mode"] == "live" and results["trace"]["label"] == "azure trace"
    points = results["points"]
    assert [(p["policy"], p["knob"]) for p in points] == [
        ("collm", "V=5, target 0.9"),
        ("collm", "V=20, target 0.9"),
        ("fixed_ratio", "K=19 (share 0.05)"),
        ("fixed_ratio", "K=9 (share 0.10)"),
    ]
    for p, run in zip(points, results["runs"], strict=True):
        # Every point replayed the same plan of at least the minimum count, and was scored.
        assert p["n_requests"] == points[0]["n_requests"] >= results["config"]["min_requests"] == 4
        assert 0 <= p["slo_attainment"] <= 1 and p["goodput_rps"] is not None and p["finetune_tokens"] >= 0
        assert p["quality_gain_nats"] is not None  # base loss measured live: no calibrated curve needed
        live = json.loads((Path(run["run_dir"]) / "result.json").read_text())
        assert live["coordinator_policy"] == p["policy"]
        if p["policy"] == "fixed_ratio":
            # The coordinator grants the knob's share (1/(K+1)) to every replica it plans, nothing else.
            share = round(1 / (p["core"]["fixed_ratio_k"] + 1), 3)
            assert {d["ft_share"] for d in live["share_decisions"]} <= {0.0, share}
    assert set(results["frontier"]) == {"collm", "fixed_ratio"}
    assert set(results["goals"]) == {
        "finetune_tokens_vs_best_baseline",
        "time_to_quality_vs_best_baseline",
        "goodput_vs_separate",
        "goodput_vs_best_colocated",
    }
    assert (out / "live-trace-2r.png").stat().st_size > 0
    assert "| fixed_ratio | K=9 (share 0.10) |" in proc.stdout


def _stack_up(harness: psutil.Process) -> bool:
    """The harness's stack has its gateway running (the launcher starts it last)."""
    for child in harness.children(recursive=True):
        try:
            if "collm_gateway" in " ".join(child.cmdline()):
                return True
        except psutil.Error:
            continue
    return False


@pytest.mark.parametrize("preset", [[], ["--preset", "headline"]])
def test_sigterm_to_the_harness_stops_every_process_it_started(tmp_path: Path, preset: list[str]) -> None:
    flags = ["--tiny", *preset, *harness_inputs(tmp_path), "--runs-dir", str(tmp_path / "runs")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "collm_bench", "frontier", *flags, "--out-dir", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    harness = psutil.Process(proc.pid)
    try:
        deadline = time.monotonic() + 120
        while not _stack_up(harness):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the stack did not come up"
            time.sleep(0.2)
        started = harness.children(recursive=True)
        names = {" ".join(c.cmdline()) for c in started}
        assert any("nats-server" in n for n in names) and any("collm_replica" in n for n in names)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err
    _, alive = psutil.wait_procs(started, timeout=5)
    left = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in left:  # not to leave them behind when the test fails
        p.kill()
    assert not left, [" ".join(p.cmdline()) for p in left]
