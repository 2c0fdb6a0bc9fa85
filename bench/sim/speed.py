"""How fast the simulator runs: simulated seconds per wall second at 8, 64 and 256 replicas.

    flock /tmp/collm-heavy.lock .venv/bin/python bench/sim/speed.py \
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
from pathlib import Path

from collm_bench.headline.rates import workload_capacity_rps

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", type=Path, default=REPO / "bench" / "calibration" / "smollm2.json")
    ap.add_argument("--traces-dir", default=str(REPO.parent / "shared" / "data" / "traces"))
    ap.add_argument("--trace", default="conv")
    ap.add_argument("--sizes", default="8,64,256")
    ap.add_argument("--load", type=float, default=0.5, help="arrival rate as a fraction of capacity")
    ap.add_argument("--duration", default="600,120,60", help="seconds of arrivals per size")
    ap.add_argument("--policy", default="collm")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "sim" / "speed.json")
    args = ap.parse_args(argv)

    from collm_sim import SimConfig, WorkloadSpec, build_workload, simulate
    from collm_sim.cli import CalibrationMissing, load_calibration
    from collm_sim.config import EngineSpec

    try:
        cal = load_calibration(args.calibration)
    except CalibrationMissing as exc:
        sys.stderr.write(f"speed: {exc}\n")
        return 2
    sizes = [int(x) for x in args.sizes.split(",")]
    durations = [float(x) for x in args.duration.split(",")]
    base = {"arrivals": "trace", "trace": args.trace, "traces_dir": args.traces_dir, "input_scale": 0.25,
            "output_scale": 0.5, "max_context_tokens": 2048}  # fmt: skip
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
        "command": " ".join(sys.argv),
        "calibration": str(args.calibration),
        "calibration_command": cal.command,
    }
    args.out.write_text(json.dumps({**doc, "runs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
