"""`python -m collm_sim`: simulate a CoLLM cluster under one or more coordinator policies.

    python -m collm_sim --calibration bench/calibration/smollm2.json --trace conv --rate 12 \\
        --duration 600 --replicas 8 --policy collm,separate,fixed_ratio,leftover --out sim.json

The calibration file is required: it is written by the engine benchmark and holds every cost and
quality number the simulator uses; without it the simulator refuses to run (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from collm_common.calibration import Calibration
from collm_sim.cluster import simulate
from collm_sim.config import POLICIES, SimConfig
from collm_sim.workload import WorkloadSpec
from collm_workload import flags

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CALIBRATION = REPO / "bench" / "calibration" / "smollm2.json"
DEFAULT_TRACES = REPO.parent / "shared" / "data" / "traces"


class CalibrationMissing(SystemExit):
    pass


def load_calibration(path: Path) -> Calibration:
    """The calibration, or a clear refusal: the simulator never runs on numbers nobody measured."""
    if not path.is_file():
        raise CalibrationMissing(
            f"calibration file {path} does not exist: the simulator needs the costs and quality curves the "
            "engine benchmark measures (it writes bench/calibration/<model>.json); run it first or pass "
            "--calibration FILE"
        )
    try:
        return Calibration.load(path)
    except Exception as exc:  # pydantic ValidationError or JSON error: say which file and why
        raise CalibrationMissing(f"calibration file {path} is not a valid calibration: {exc}") from None


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_core(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--core expects KNOB=VALUE, got {item!r}")
        out[key.strip()] = _value(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="collm_sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    flags.add_calibration(p, default=DEFAULT_CALIBRATION, help="calibration JSON (required)")
    p.add_argument("--policy", default=",".join(POLICIES), help="comma-separated policies")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--arrivals", default="trace", choices=["trace", "poisson", "gamma", "constant"])
    flags.add_trace(p, help="conv, code (Azure 2023), a trace file, or none (synthetic lengths)")
    flags.add_traces_dir(p, default=DEFAULT_TRACES)
    p.add_argument("--rate", type=float, default=None, help="mean arrival rate (req/s); trace: time-scaled")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape k (1: Poisson)")
    p.add_argument("--trace-start", type=float, default=0.0, help="trace offset (s) where the replay starts")
    flags.add_length_scales(p)
    p.add_argument("--max-context", type=int, default=None, help="prompt + output limit (tokens)")
    flags.add_slo(p, ttft_default=2000.0, tpot_default=250.0)
    p.add_argument("--samples-per-replica", type=int, default=500)
    p.add_argument("--coscheduler", default=None, help="override the policy's replica co-scheduler")
    p.add_argument("--core", action="append", metavar="KNOB=VALUE", help="coordinator CoreConfig override")
    p.add_argument(
        "--quality-extrapolate",
        default="log",
        choices=["log", "hold"],
        help="quality past the calibration's last measured point: fitted curve (log) or none (hold)",
    )
    flags.add_seed(p)
    p.add_argument("--out", type=Path, default=None, help="write the results (JSON) here")
    p.add_argument("--records", type=Path, default=None, help="write per-request records (JSONL) here")
    return p


def config_from_args(args: argparse.Namespace, policy: str) -> SimConfig:
    wl = WorkloadSpec(
        arrivals=args.arrivals,
        trace=None if args.trace.lower() in ("", "none") else args.trace,
        traces_dir=str(args.traces_dir),
        rate_rps=args.rate,
        duration_s=args.duration,
        burstiness=args.burstiness,
        trace_start_s=args.trace_start,
        input_scale=args.input_scale,
        output_scale=args.output_scale,
        max_context_tokens=args.max_context,
        ttft_slo_ms=args.slo_ttft_ms,
        tpot_slo_ms=args.slo_tpot_ms,
        seed=args.seed,
    )
    return SimConfig(
        replicas=args.replicas,
        policy=policy,
        workload=wl,
        core=parse_core(args.core),
        coscheduler=args.coscheduler,
        samples_per_replica=args.samples_per_replica,
        quality_extrapolate=args.quality_extrapolate,
        seed=args.seed,
    )


def headline(policy: str, summary: dict[str, Any], sim: dict[str, Any]) -> str:
    lat = summary["latency_ms"]
    return (
        f"{policy:<12} goodput {summary['goodput_rps'] or 0:7.2f} req/s  "
        f"attainment {summary['attainment'] or 0:6.3f}  "
        f"TTFT p99 {lat['ttft']['p99'] or 0:8.0f} ms  TPOT p99 {lat['tpot']['p99'] or 0:6.0f} ms  "
        f"ft tokens {sim['ft_tokens']:>9}  quality gain/h {sim['quality_gain_per_hour'] or 0:.4f}  "
        f"({sim['speedup'] or 0:.0f}x real time)"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        sys.stderr.write(f"unknown policies {bad}: choose from {', '.join(POLICIES)}\n")
        return 2
    try:
        cal = load_calibration(args.calibration)
    except CalibrationMissing as exc:
        sys.stderr.write(f"collm_sim: {exc}\n")
        return 2
    results: dict[str, Any] = {
        "calibration": str(args.calibration),
        "calibration_command": cal.command,
        "runs": {},
    }
    for policy in policies:
        res = simulate(config_from_args(args, policy), cal)
        results["runs"][policy] = res.as_dict()
        sys.stdout.write(headline(policy, res.summary, res.sim) + "\n")
        sys.stdout.flush()
        if args.records is not None:
            path = args.records.with_name(f"{args.records.stem}.{policy}{args.records.suffix}")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(r.to_json() + "\n" for r in res.records))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0
