"""`make bench`'s orchestration with the tiny model and tiny durations: two policies, each on a fresh stack
(its own NATS and Redis, aggregator, coordinator, two replicas with local data, gateway), the same plan
replayed against each, one table, one figure, and the results file.

The trace and the datasets are made up (`bench_data`: the real ones live outside the repository), so
the test runs anywhere; the Makefile target is checked to run exactly this command under the heavy-work lock.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from collm_common.step_log import InferenceStep, read_step_log
from tests.integration.bench.bench_data import REPO, harness_inputs, run_harness

pytestmark = pytest.mark.integration


def test_headline_runs_each_policy_on_a_fresh_stack(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [
        "--model", "tiny", "--policies", "collm,separate", "--rate-labels", "light", "--rates", "light=1",
        *harness_inputs(tmp_path, "--traces"), "--duration", "5", "--drain-s", "10", "--out-dir", str(out),
    ]  # fmt: skip
    proc = run_harness("headline", argv, 170)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(proc.stdout)  # the table, shown with -s
    (run_root,) = [p for p in out.iterdir() if p.is_dir()]
    results = json.loads((run_root / "results.json").read_text())
    assert results["command"].startswith("python -m collm_bench headline --model tiny")
    (tr,) = results["traces"]
    block = tr["rates"]["light"]
    assert list(tr["rates"]) == ["light"] and block["n_requests"] == 5 and block["given"]
    assert block["plan"]["requests"] == 5
    phases = ["stack_start", "connect", "v1", "resident", "gateway_models", "arrivals", "drain"]
    for i, policy in enumerate(("collm", "separate")):
        live = block["runs"][policy]["live"]
        # The stack ran the policy asked for, with its co-scheduler, and replayed the whole plan.
        assert live["coordinator_policy"] == policy and live["coscheduler"] == "slo"
        assert live["submitted"] == 5 and live["by_status"]["ok"] == 5, live["by_status"]
        assert live["goodput_rps"] is not None and live["goodput_rps"] > 0
        assert live["quality_joined"] == 5  # every request joined with its version's held-out loss
        assert live["ft_tokens"] >= 0 and set(live["rounds"]) >= {"opened", "published"}
        run = json.loads((Path(live["run_dir"]) / "result.json").read_text())
        assert set(run["base_losses"]) == {"math", "medical"}
        assert all(v > 0 for v in run["base_losses"].values())
        # The base loss is measured by the first run only (after its replay) and reused by the others.
        assert run["base_losses_measured"] == (i == 0)
        assert run["base_losses"] == results["base_losses"]["losses"]
        # What bounded training while serving, per replica, and the coordinator's share decisions.
        assert set(live["ft_limits_by_replica"]) == {"r0", "r1"}
        limits = live["ft_limits_by_replica"].values()
        assert all(set(d) <= {"share", "slack", "guard", "policy"} for d in limits)
        # Seconds each replica's engine spent on each kind of work during the replay.
        busy = run["busy_s_by_replica"]
        assert set(busy) == {"r0", "r1"} and all(
            set(b) == {"inference", "training", "evaluation"} for b in busy.values()
        )
        assert sum(b["inference"] for b in busy.values()) > 0 and live["busy_s_by_replica"] == busy
        assert run["share_decisions"] and {d["replica"] for d in run["share_decisions"]} == {"r0", "r1"}
        assert all(d["reason"] and 0 <= d["ft_share"] <= 1 for d in run["share_decisions"])
        # Every step of the run is timed, in order; the arrivals end at the plan's last arrival.
        want = (
            [*phases, "base_loss", "read_out", "stack_stop"]
            if i == 0
            else [*phases, "read_out", "stack_stop"]
        )
        assert list(live["phases_s"]) == want and all(v >= 0 for v in live["phases_s"].values())
        assert live["phases_s"]["arrivals"] == pytest.approx(block["plan"]["last_arrival_s"], abs=0.5)
        assert (Path(live["run_dir"]) / "requests.jsonl").is_file()
        assert (Path(live["run_dir"]) / "stack.log").stat().st_size > 0
        # Every replica logged its steps (set beside the simulator's price for them when there is a
        # calibration of the model; the tiny model has none).
        steps = [
            r
            for rid in ("r0", "r1")
            for r in read_step_log(Path(live["run_dir"]) / "stack" / f"steps-{rid}.jsonl")
            if isinstance(r, InferenceStep)
        ]
        served = [json.loads(x) for x in (Path(live["run_dir"]) / "requests.jsonl").read_text().splitlines()]
        assert sum(n for s in steps for n, _ in s.prefill) == sum(r["prompt_tokens"] for r in served)
        assert all(s.step_ms >= s.forward_ms > 0 for s in steps)
        assert "step_costs" not in live
    assert block["compare"]["goodput_ratio"]["separate"] is not None
    assert (run_root / "headline.png").stat().st_size > 0 and (out / "latest.png").is_file()
    table = (out / "latest.md").read_text()
    assert "| collm |" in table and "| separate |" in table and "rate given on the command line" in table
    assert table.splitlines()[0] in proc.stdout


@pytest.mark.parametrize(
    ("target", "args", "command"),
    [("bench", "BENCH_ARGS", "headline"), ("bench-frontier", "FRONTIER_ARGS", "frontier")],
)
def test_make_bench_targets_run_their_command_under_the_lock(target: str, args: str, command: str) -> None:
    proc = subprocess.run(
        ["make", "-n", target, f"{args}=--model tiny"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lock = "flock /tmp/collm-heavy.lock"
    assert f"{lock} .venv/bin/python -m collm_bench {command} --model tiny" in proc.stdout
