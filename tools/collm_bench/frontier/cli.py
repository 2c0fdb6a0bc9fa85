"""`python -m collm_bench frontier`: each policy's trade-off curve, every knob of its grid.

    python -m collm_bench frontier --sim --replicas 64 --window-s 3600 --trace conv   # the simulator
    python -m collm_bench frontier                     # live, the default stack (make bench-frontier)
    python -m collm_bench frontier --tiny              # live, the quick check of the pipeline
    python -m collm_bench frontier --preset headline   # live, each policy at its default (make bench)
    python -m collm_bench frontier --resume RUNS/results.json   # live, the same flags: the missing points
    python -m collm_bench frontier --sim ... --resume OUT/sim-conv-256r.partial.json   # a stopped sim run
    python -m collm_bench frontier --render bench/results/frontier/sim-conv-64r.json   # table and figure
    python -m collm_bench frontier --agree bench/results/frontier/live-conv-2r.json    # sim vs live
    python -m collm_bench frontier --sim --step-load 0.3,0.7,0.3   # collm under a step in load
    python -m collm_bench frontier --sim --robustness   # one setting per policy at 0.3, 0.5, 0.7 and a step

Writes `OUT/<sim|live>-<trace>-<N>r.json` (points, frontiers, goals, config, trace label) and the figure
beside it (`.png`), and prints the table. A simulated frontier keeps its work in
`<that name>.partial.json` as it goes (`frontier.progress`; removed once the result is written). Exit
status: 0 done (goals met or not: the table says), 2 something required is missing or a flag is bad, 1
a live point failed, 130 interrupted (SIGINT or SIGTERM: every process the run started is stopped
first).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from collm_bench.experiment.config import SERIES, ExperimentConfig
from collm_bench.experiment.setup import SetupError
from collm_bench.experiment.signals import interrupt_on_sigterm
from collm_workload import flags

from . import points as pts
from . import robust, step
from .agree import agreement
from .live import LiveFrontierConfig, live_frontier
from .render import markdown, plot
from .sim import sim_frontier, usable_jobs

REPO = Path(__file__).resolve().parents[3]
DEFAULT_OUT = REPO / "bench" / "results" / "frontier"
DEFAULT_POLICIES = ("collm", "separate", "fixed_ratio", "leftover", pts.SERVING_ALONE)
PRESETS = ("headline",)


def _floats(text: str | None, default: Sequence[float]) -> tuple[float, ...]:
    if text is None:
        return tuple(default)
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"want comma-separated numbers (got {text!r})") from None


def _add_what_and_where(p: argparse.ArgumentParser) -> None:
    """The mode (simulated, live, a result file's table or agreement) and the setup every mode shares."""
    p.add_argument("--sim", action="store_true", help="the simulator (default: the live stack)")
    p.add_argument("--render", type=Path, default=None, help="table and figure of a result file")
    p.add_argument(
        "--agree", type=Path, default=None, help="simulate a live result file's points: goodput errors"
    )
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="FILE",
        help="keep the points of an earlier run of the same plan (its result file; live, the results.json "
        "of its runs directory; simulated, its .partial.json, with its rate search) and run only the rest",
    )
    p.add_argument("--replicas", type=int, default=None, help="default: 8 simulated, 2 live")
    p.add_argument(
        "--window-s", type=float, default=None, help="arrivals per point (default 3600 sim, 60 live)"
    )
    flags.add_trace(p, help="conv, code, mooncake-conv, mooncake-synthetic or a file")
    flags.add_round_mode(p)
    p.add_argument("--round-s", type=float, default=None, help="round deadline (s); slow interval 5 s longer")
    flags.add_traces_dir(p, default=None)
    p.add_argument(
        "--synthetic-fallback",
        action="store_true",
        help="replay synthetic gamma arrivals when the trace file is absent (labelled SYNTHETIC)",
    )


def _add_load(p: argparse.ArgumentParser) -> None:
    """The offered rate, and the step-load and robustness runs."""
    p.add_argument("--load", type=float, default=0.5, help="rate as a fraction of the capacity estimate")
    p.add_argument("--rate", type=float, default=None, help="offered rate (req/s), instead of --load")
    p.add_argument(
        "--alone-attainment",
        type=float,
        default=None,
        metavar="A",
        help="instead of --load: the rate at which the simulator says serving alone attains A",
    )
    p.add_argument(
        "--step-load",
        default=None,
        metavar="FRACS",
        help="with --sim: collm under these load fractions in turn (e.g. 0.3,0.7,0.3), not the grid",
    )
    p.add_argument("--step-s", type=float, default=600.0, help="with --step-load: seconds of each load")
    p.add_argument(
        "--robustness",
        action="store_true",
        help="with --sim: one setting per policy at each of --loads and under the step --step-load "
        "(default 0.3,0.7,0.3), --window-s each (default 1800)",
    )
    p.add_argument("--loads", default=None, help="with --robustness: constant loads (0.3,0.5,0.7)")
    p.add_argument(
        "--robustness-from",
        type=Path,
        default=DEFAULT_OUT / "sim-conv-8r.json",
        metavar="FILE",
        help="with --robustness: the frontier whose points choose fixed_ratio's K and separate's split",
    )


def _add_grid(p: argparse.ArgumentParser) -> None:
    """The policies and their knob grids, and the run's other settings."""
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    p.add_argument(
        "--preset",
        choices=PRESETS,
        default=None,
        help="headline: one point per policy at its default setting (what `make bench` runs), not the grid",
    )
    p.add_argument(
        "--fixed-shares", default=None, help="fixed_ratio's training shares (0.05,0.1,0.2,0.333,0.5)"
    )
    p.add_argument("--separate-fracs", default=None, help="separate's training fractions (0.125,...,0.5)")
    p.add_argument("--collm-v", default=None, help="collm's quality weights V (5,20,80)")
    p.add_argument("--collm-targets", default=None, help="collm's attainment targets (0.9,0.95,0.98)")
    p.add_argument("--domains", default=None, help="replica i holds domain i mod n (default math,medical)")
    flags.add_seed(p)
    flags.add_calibration(p, default=None)
    p.add_argument("--jobs", type=int, default=None, help="simulated points at once (default: cores, <= 2)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)


def _add_live(g: argparse._ArgumentGroup) -> None:
    """The live frontier's own flags."""
    g.add_argument("--model", default=None, help="smollm2 (default) or tiny")
    g.add_argument("--min-requests", type=int, default=None, help="per point; the window grows (100; tiny 4)")
    g.add_argument("--drain-s", type=float, default=None)
    g.add_argument("--data", action="append", metavar="DOMAIN=DIR", help="a prepared dataset directory")
    flags.add_slo(g)
    g.add_argument(
        "--tiny", action="store_true", help="tiny model, 2 policies x 2 knobs, seconds-long windows (CI)"
    )
    g.add_argument("--runs-dir", type=Path, default=None, help="per-point run directories (logs)")
    g.add_argument("--dry-run", action="store_true", help="print the plan and the time estimate, run nothing")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m collm_bench frontier",
        description="Each coordinator policy's trade-off curve (goodput and attainment against fine-tuning "
        "tokens and served quality gain) over its knob grid, each policy's Pareto frontier, and the goals.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    _add_what_and_where(p)
    _add_load(p)
    _add_grid(p)
    _add_live(p.add_argument_group("live"))
    return p


def knob_grid(args: argparse.Namespace, policies: tuple[str, ...], replicas: int) -> list[pts.Knob]:
    """The knobs to run: every policy's grid, or with `--preset headline` each policy's default."""
    if args.preset == "headline":
        return pts.default_knobs(policies, replicas)
    return pts.knob_grid(
        policies,
        replicas,
        _floats(args.fixed_shares, pts.FIXED_RATIO_SHARES),
        _floats(args.separate_fracs, pts.SEPARATE_TRAIN_FRACS),
        _floats(args.collm_v, pts.COLLM_QUALITY_WEIGHTS),
        _floats(args.collm_targets, pts.COLLM_ATTAINMENT_TARGETS),
    )


def experiment_config(args: argparse.Namespace, replicas: int, window_s: float) -> ExperimentConfig:
    over: dict[str, Any] = {
        "replicas": replicas,
        "duration_s": window_s,
        "traces": (args.trace,),
        "seed": args.seed,
        "synthetic_fallback": args.synthetic_fallback,
    }
    if args.model is not None:
        over["model"] = args.model
    if args.traces_dir is not None:
        over["traces_dir"] = args.traces_dir
    if args.calibration is not None:
        over["calibration"] = args.calibration
    if args.domains:
        over["domains"] = tuple(d.strip() for d in args.domains.split(",") if d.strip())
    if args.drain_s is not None:
        over["drain_s"] = args.drain_s
    if args.rounds is not None:
        over["rounds"] = args.rounds
    if args.round_s is not None:
        over["round_deadline_s"] = args.round_s
        over["slow_interval_s"] = args.round_s + 5.0
    if args.slo_ttft_ms is not None:
        over["slo_ttft_ms"] = args.slo_ttft_ms
    if args.slo_tpot_ms is not None:
        over["slo_tpot_ms"] = args.slo_tpot_ms
    return dataclasses.replace(ExperimentConfig(), **over)


def finish(results: dict[str, Any], path: Path, out: TextIO) -> None:
    """Frontiers and goals from the points; the result file, its figure and the table."""
    points = [pts.Point.from_dict(p) for p in results["points"]]
    curves = {
        (p.policy, p.knob): r.get("quality_curve")
        for p, r in zip(points, results.get("runs") or [{}] * len(points), strict=False)
    }
    results["frontier"] = pts.fronts(points)
    results["goals"] = pts.evaluate_goals(points, curves)
    # Time-to-quality reads the curves of the points at the floor only: the others' are not kept.
    floor = results["goals"]["time_to_quality_vs_best_baseline"].get("attainment_floor")
    for p, r in zip(points, results.get("runs") or [], strict=False):
        if floor is not None and p.get("slo_attainment") < floor:
            r.pop("quality_curve", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(pts.json_text(results) + "\n", encoding="utf-8")
    png = plot(results, path.with_suffix(".png"))
    out.write("\n" + markdown(results) + "\n\n")
    out.write(f"[frontier] {path}\n[frontier] {png}\n")


def result_path(
    out_dir: Path,
    mode: str,
    trace: str,
    replicas: int,
    rounds: str = "async",
    alone: float | None = None,
    preset: str | None = None,
) -> Path:
    """`<mode>-<trace>-<N>r.json`, with `-sync` when the rounds are synchronous, `-alone<A>` when the
    rate is the one where serving alone attains A and `-<preset>` for a preset's points."""
    name = Path(trace).stem if trace.endswith((".csv", ".jsonl")) else trace
    tail = ("-sync" if rounds == "sync" else "") + ("" if alone is None else f"-alone{alone:g}")
    tail += f"-{preset}" if preset else ""
    return out_dir / f"{mode}-{name}-{replicas}r{tail}.json"


def run_sim(
    args: argparse.Namespace, policies: tuple[str, ...], command: str, say: Callable[[str], None], out: TextIO
) -> int:
    """The simulated frontier: its work kept in `<result>.partial.json` as it goes, the result file
    written (and the partial file removed) at the end."""
    replicas = args.replicas or 8
    cfg = experiment_config(args, replicas, args.window_s or 3600.0)
    knobs = knob_grid(args, policies, replicas)
    alone = args.alone_attainment if args.rate is None else None
    path = result_path(args.out_dir, "sim", args.trace, replicas, cfg.rounds, alone, args.preset)
    partial = path.with_suffix(".partial.json")
    prior = json.loads(args.resume.read_text(encoding="utf-8")) if args.resume is not None else None
    jobs = usable_jobs(args.jobs)
    results = sim_frontier(cfg, knobs, args.load, args.rate, jobs, say, args.alone_attainment, partial, prior)
    results["command"] = command
    finish(results, path, out)
    partial.unlink(missing_ok=True)
    return 0


def run(args: argparse.Namespace, argv: Sequence[str], out: TextIO, err: TextIO) -> int:
    if args.render is not None:
        results = json.loads(args.render.read_text(encoding="utf-8"))
        finish(results, args.render, out)
        return 0
    if args.agree is not None:
        results = json.loads(args.agree.read_text(encoding="utf-8"))
        if results.get("mode") != "live":
            raise ValueError(f"--agree: {args.agree} is not a live frontier")
        out.write(f"[frontier] the simulator on the {len(results['points'])} points of {args.agree}\n")
        results["agreement"] = agreement(
            results, lambda line: out.write(f"[frontier] {line}\n"), args.calibration
        )
        finish(results, args.agree, out)
        return 0
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    if bad := [p for p in policies if p not in SERIES]:
        raise ValueError(f"--policies: unknown {bad} (choose from {', '.join(SERIES)})")

    def say(line: str) -> None:
        out.write(f"[frontier] {line}\n")
        out.flush()

    command = ("python -m collm_bench frontier " + " ".join(argv)).strip()
    say(command)
    if args.robustness:
        if not args.sim:
            raise ValueError("--robustness runs in the simulator: add --sim")
        replicas = args.replicas or 8
        cfg = experiment_config(args, replicas, args.window_s or 1800.0)
        source = json.loads(args.robustness_from.read_text(encoding="utf-8"))
        loads = _floats(args.loads, robust.LOADS)
        steps = _floats(args.step_load, robust.STEP)
        full = args.robustness_from.resolve()
        chosen_from = str(full.relative_to(REPO)) if full.is_relative_to(REPO) else str(full)
        doc = robust.robustness(cfg, source, chosen_from, loads, steps, usable_jobs(args.jobs), say)
        doc["command"] = command
        path = robust.write(doc, result_path(args.out_dir, "sim-robust", args.trace, replicas, cfg.rounds))
        out.write(f"\n{robust.table(doc)}\n\n[frontier] {path}\n[frontier] {path.with_suffix('.png')}\n")
        return 0
    if args.sim and args.step_load:
        replicas = args.replicas or 8
        fracs = _floats(args.step_load, ())
        cfg = experiment_config(args, replicas, args.step_s * len(fracs))
        doc = step.step_load(cfg, fracs, args.step_s, say) | {"command": command}
        path = result_path(args.out_dir, "sim-step", args.trace, replicas, cfg.rounds)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        step.plot(doc, path.with_suffix(".png"))
        out.write("\n" + step.table(doc) + f"\n\n[frontier] {path}\n[frontier] {path.with_suffix('.png')}\n")
        return 0
    if args.sim:
        return run_sim(args, policies, command, say, out)
    live = LiveFrontierConfig.from_args(args, policies)
    cfg = experiment_config(args, live.replicas, live.window_s)
    knobs = knob_grid(args, live.policies, live.replicas)
    if live.knobs_per_policy is not None:
        knobs = [
            k for p in live.policies for k in [x for x in knobs if x.policy == p][: live.knobs_per_policy]
        ]
    with interrupt_on_sigterm():
        results, failed = live_frontier(live.apply(cfg), live, knobs, say, err)
    if live.dry_run:
        return 0
    results["command"] = command
    alone = live.alone_attainment if live.rate_rps is None else None
    path = result_path(args.out_dir, "live", args.trace, live.replicas, cfg.rounds, alone, args.preset)
    finish(results, path, out)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out, err = out or sys.stdout, err or sys.stderr
    try:
        return run(build_parser().parse_args(argv), argv, out, err)
    except (SetupError, ValueError, OSError) as exc:
        err.write(f"collm-bench frontier: {exc}\n")
        return 2
    except KeyboardInterrupt:
        err.write("collm-bench frontier: interrupted; every process it started is stopped\n")
        return 130
