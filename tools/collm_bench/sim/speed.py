"""How fast the simulator runs: simulated seconds per wall second at 8, 64 and 256 replicas.

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench sim speed \\
        --calibration bench/calibration/smollm2.json

Each size replays the Azure conv trace at the same load per replica (a fraction of the capacity the
calibration gives) under the two-timescale policy; the result is the ratio of simulated time to wall
time of the whole run (routing, coordinator ticks, telemetry and rounds included). Results go to
`bench/results/sim/speed.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from collm_bench.experiment.rates import workload_capacity_rps
from collm_bench.groups import RESULTS, add_out, add_sim_trace, command_line, prog
from collm_bench.sim import load_calibration, workload_base


def main(argv: Sequence[str]) -> int:
    """Time one simulation per size, write the result file."""
    ap = argparse.ArgumentParser(
        prog=prog("sim", "speed"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_sim_trace(ap)
    ap.add_argument("--sizes", default="8,64,256")
    ap.add_argument("--load", type=float, default=0.5, help="arrival rate as a fraction of capacity")
    ap.add_argument("--duration", default="600,120,60", help="seconds of arrivals per size, one per size")
    ap.add_argument("--policy", default="collm")
    add_out(ap, RESULTS / "sim" / "speed.json")
    args = ap.parse_args(argv)

    from collm_sim import SimConfig, WorkloadSpec, build_workload, simulate
    from collm_sim.config import EngineSpec

    sizes = [int(x) for x in args.sizes.split(",")]
    durations = [float(x) for x in args.duration.split(",")]
    if len(durations) != len(sizes):
        ap.error(f"--duration needs one value per size: {len(sizes)} sizes, {len(durations)} durations")
    cal = load_calibration(args, "speed")
    if cal is None:
        return 2
    base = workload_base(args)
    probe = build_workload(
        WorkloadSpec(**base, rate_rps=1.0, duration_s=600.0), tuple(q.domain for q in cal.quality)
    )
    per_replica = workload_capacity_rps(cal, probe, EngineSpec().max_batch, 1)
    rows = []
    for n, duration in zip(sizes, durations, strict=True):
        rate = round(args.load * per_replica * n, 3)
        cfg = SimConfig(
            replicas=n, policy=args.policy, workload=WorkloadSpec(**base, rate_rps=rate, duration_s=duration)
        )
        t0 = time.perf_counter()
        res = simulate(cfg, cal)
        wall = time.perf_counter() - t0
        row = {
            "replicas": n,
            "rate_rps": rate,
            "duration_s": duration,
            "sim_time_s": res.sim["sim_time_s"],
            "wall_s": wall,
            "sim_seconds_per_wall_second": res.sim["sim_time_s"] / wall,
            "events": res.sim["events"],
            "iterations": res.sim["iterations"],
            "requests": res.sim["requests"],
            "attainment": res.summary["attainment"],
        }
        rows.append(row)
        sys.stdout.write(
            f"{n:4d} replicas  {rate:8.2f} req/s  {duration:5.0f} s simulated in {wall:6.1f} s wall: "
            f"{row['sim_seconds_per_wall_second']:7.1f}x real time ({row['iterations']} iterations)\n"
        )
        sys.stdout.flush()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": command_line(["sim", "speed", *argv], lock=True),
        "calibration": str(args.calibration),
        "calibration_command": cal.command,
    }
    args.out.write_text(json.dumps({**doc, "runs": rows}, indent=1) + "\n")
    return 0
