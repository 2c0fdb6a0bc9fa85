"""Fault figures: the faults of tests/integration/faults, run on one live stack, with larger loads.
(The supervised replica kill on a real `collm up` with SmolLM2: `python -m collm_bench faults supervise`.)

Starts its own nats-server, redis-server and the stack (tiny model; aggregator, coordinator, two
replicas with local data, gateway; settings of tests/integration/faults/harness.py), runs the scenarios
of tests/integration/faults/scenarios.py in order, and writes bench/results/faults/scenarios.json (every
report, with its details) and prints its table. Runs from the repository root (it imports `tests`).

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench faults scenarios
    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench faults scenarios \
        --only replica_kill,nats_restart
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from collm_bench.groups import RESULTS, add_out, command_line, prog
from collm_bench.readme.faults import scenarios_table


def params(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each scenario's keyword arguments from the command line."""
    return {
        "replica_kill": {
            "concurrency": args.concurrency,
            "duration_s": args.load_s,
            "kill_at_s": args.load_s / 3,
            "max_tokens": 256,
        },
        "nats_restart": {"down_s": args.down_s},
        "redis_restart": {"down_s": args.down_s},
        "aggregator_kill": {},
        "coordinator_down": {},
        "straggler": {"deadline_s": 8.0},
        "replica_supervised": {"concurrency": args.concurrency, "max_tokens": 128},
        "nats_crash": {"down_s": args.down_s},
        "redis_crash": {"down_s": args.down_s},
    }


def main(argv: Sequence[str]) -> int:
    """Run the scenarios on one stack, write every report and print their table; 1 when a check failed."""
    ap = argparse.ArgumentParser(
        prog=prog("faults", "scenarios"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--only", default=None, help="comma-separated scenario names (default: every scenario, in order)"
    )
    ap.add_argument("--concurrency", type=int, default=16, help="replica_kill: concurrent requests")
    ap.add_argument("--load-s", type=float, default=15.0, help="replica_kill: seconds of load")
    ap.add_argument("--down-s", type=float, default=5.0, help="NATS and Redis: seconds down")
    add_out(ap, RESULTS / "faults" / "scenarios.json")
    args = ap.parse_args(argv)

    from tests.integration.faults import scenarios as sc
    from tests.integration.faults.harness import FaultStack

    only = args.only if args.only is not None else ",".join([*sc.SCENARIOS, *sc.VARIANTS])
    names = [n.strip() for n in only.split(",") if n.strip()]
    runs = {**{n: (f, {}) for n, f in sc.SCENARIOS.items()}, **sc.VARIANTS}
    unknown = set(names) - set(runs)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; choose from {list(runs)}")
    p = params(args)
    reports: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="collm-faults-") as tmp:
        fs = FaultStack(Path(tmp))
        t0 = time.monotonic()
        fs.start()
        print(f"stack ready in {time.monotonic() - t0:.1f}s", flush=True)
        try:
            for name in names:
                t1 = time.monotonic()
                try:
                    fn, fixed = runs[name]
                    rep = asyncio.run(fn(fs, **fixed, **p[name]))  # type: ignore[operator]
                    d = rep.as_dict()
                except Exception as exc:  # report it and go on: the other faults still get measured
                    traceback.print_exc()
                    d = sc.FaultReport(name, details={"error": f"{type(exc).__name__}: {exc}"}).as_dict()
                    d["checks"] = {"scenario ran to the end": False}
                    d["failed_checks"] = ["scenario ran to the end"]
                    d["log_tail"] = fs.log_tail(4000)
                d["params"] = p[name]
                d["wall_s"] = round(time.monotonic() - t1, 1)
                reports.append(d)
                keys = ("sent", "succeeded", "retried", "failed_clear", "lost", "recovery_s", "failed_checks")
                print(f"{name}: {json.dumps({k: d[k] for k in keys})}", flush=True)
        finally:
            fs.stop()
    result = {
        "command": command_line(),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "model": "tiny",
        "reports": reports,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print("\n" + scenarios_table(reports))
    print(f"\nwrote {args.out}")
    return 0 if all(not r["failed_checks"] for r in reports) else 1
