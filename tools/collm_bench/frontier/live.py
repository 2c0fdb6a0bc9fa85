"""The live frontier: every policy x knob on the default stack, one fresh stack per point.

Each point is `collm_bench.experiment.live.run_live` (a fresh stack: NATS, Redis, aggregator,
coordinator with the policy and its knobs, N replicas with local data, gateway) replaying the same plan:
one trace slice at one offered rate (`--rate`; else, with `--alone-attainment A`, the rate at which the
simulator says serving alone attains A on windows sized as these; else `load` x the capacity estimate
from the calibration), its window long enough to hold `min_requests` requests (`points.sized_window`:
the window grows, the rate stays). Knobs reach the services through their settings: the coordinator's
CoreConfig knobs as `COLLM_COORDINATOR_<KNOB>`, `fixed_ratio_k` as `COLLM_FIXED_RATIO_K` on the
coordinator and every replica (`knob_env`). The base model's held-out loss is measured by the first
point and reused. Served quality gain needs no calibrated curve (`frontier.curves`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from collm_bench.experiment import setup
from collm_bench.experiment.config import ExperimentConfig, tiny_preset
from collm_bench.experiment.live import LiveRunError, run_live
from collm_common.calibration import Calibration
from collm_workload.workload import PlannedRequest, Slo

from .curves import with_default_curves
from .points import Knob, sized_window
from .progress import check_same_plan
from .sim import SCHEMA, alone_rate, max_batch, point_of

# Per point beside its window and drain, measured on the default stack (2 SmolLM2 replicas, 2 cores):
# stack start 12-17 s, v1 adapters and residency 3-5 s, read-out and stop 3-8 s.
POINT_OVERHEAD_S = 30.0
BASE_LOSS_S = 20.0  # the base model's held-out loss, measured by the first point
TINY_POLICIES = ("collm", "fixed_ratio")
# Per-point run directories (logs, requests, telemetry), outside the committed results.
DEFAULT_RUNS_DIR = Path(__file__).resolve().parents[3] / "bench" / "results" / "frontier-runs"


@dataclass(frozen=True)
class LiveFrontierConfig:
    replicas: int = 2
    window_s: float = 60.0
    min_requests: int = 100
    load: float = 0.5
    rate_rps: float | None = None
    alone_attainment: float | None = None  # the rate where the simulator says serving alone attains it
    policies: tuple[str, ...] = ()
    tiny: bool = False
    knobs_per_policy: int | None = None
    runs_dir: Path | None = None
    data_dirs: Mapping[str, Path] = dataclasses.field(default_factory=dict)
    dry_run: bool = False  # the plan and the time estimate only
    resume: Path | None = None  # an earlier run's results (`resume_from`): its points are kept

    @classmethod
    def from_args(cls, args: argparse.Namespace, policies: tuple[str, ...]) -> LiveFrontierConfig:
        data: dict[str, Path] = {}
        for item in args.data or []:
            domain, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"--data: want DOMAIN=DIR (got {item!r})")
            data[domain.strip()] = Path(path)
        if args.tiny:
            # The quick check: 2 policies x 2 knobs, seconds-long windows of a handful of requests.
            return cls(
                replicas=args.replicas or 2,
                window_s=args.window_s or 3.0,
                min_requests=args.min_requests or 4,
                rate_rps=args.rate or 2.0,
                policies=TINY_POLICIES,
                tiny=True,
                knobs_per_policy=2,
                runs_dir=args.runs_dir,
                data_dirs=data,
                dry_run=args.dry_run,
            )
        return cls(
            replicas=args.replicas or 2,
            window_s=args.window_s or 60.0,
            min_requests=args.min_requests or 100,
            load=args.load,
            rate_rps=args.rate,
            alone_attainment=args.alone_attainment,
            policies=policies,
            runs_dir=args.runs_dir,
            data_dirs=data,
            dry_run=args.dry_run,
            resume=args.resume,
        )

    def apply(self, cfg: ExperimentConfig) -> ExperimentConfig:
        """The experiment configuration of every point's stack."""
        cfg = dataclasses.replace(cfg, data_dirs=dict(self.data_dirs))
        if self.tiny:
            cfg = dataclasses.replace(
                tiny_preset(cfg), duration_s=self.window_s, drain_s=min(cfg.drain_s, 10.0)
            )
        return cfg


def knob_env(knob: Knob) -> dict[str, dict[str, str]]:
    """The services' environment that sets the knob (module docstring)."""
    env: dict[str, dict[str, str]] = {"coordinator": {}}
    for name, value in knob.core.items():
        if name == "fixed_ratio_k":
            env["coordinator"]["COLLM_FIXED_RATIO_K"] = str(int(value))
            env["replica"] = {"COLLM_FIXED_RATIO_K": str(int(value))}
        else:
            env["coordinator"][f"COLLM_COORDINATOR_{name.upper()}"] = str(value)
    return env


def estimate_s(points: int, window_s: float, drain_s: float, prep_s: float = 0.0) -> float:
    """Wall seconds of a live frontier of `points` points (`POINT_OVERHEAD_S` each beside the window
    and the drain, the base loss once, `prep_s` of setup)."""
    return prep_s + BASE_LOSS_S + points * (POINT_OVERHEAD_S + window_s + drain_s)


def live_rate(
    cfg: ExperimentConfig,
    live: LiveFrontierConfig,
    source: setup.TraceSource,
    slo: Slo,
    say: Callable[[str], None],
) -> tuple[float, str]:
    """The offered rate and how it was had: given; the simulator's rate where serving alone attains
    `alone_attainment` on windows sized as the live ones (`sim.alone_rate`); or `load` x the capacity
    estimate."""
    if live.rate_rps is not None:
        return live.rate_rps, "given"
    if cfg.calibration is None or not Path(cfg.calibration).is_file():
        raise setup.SetupError("without --rate the rate comes from a calibration (--calibration FILE)")
    cal = Calibration.load(cfg.calibration)
    cap = setup.capacity_rps(cfg, cal, source, max_batch())
    if live.alone_attainment is not None:
        cal, _ = with_default_curves(cal, cfg.domains)
        return alone_rate(
            cfg,
            cal,
            slo,
            cap,
            live.alone_attainment,
            lambda r: sized_window(r, cfg.duration_s, live.min_requests)[0],
            say,
        )
    return live.load * cap, f"{live.load:g} x the capacity estimate {cap:.3f} req/s"


def sized_plan(
    cfg: ExperimentConfig, source: setup.TraceSource, rate: float, min_requests: int
) -> ExperimentConfig:
    """The config whose window holds at least `min_requests` of the slice at `rate` (the trace's
    arrivals are not evenly spaced: the window grows by a tenth until the slice holds them)."""
    window, _ = sized_window(rate, cfg.duration_s, min_requests)
    cfg = dataclasses.replace(cfg, duration_s=window)
    while len(setup.shapes(cfg, source, rate)) < min_requests:
        cfg = dataclasses.replace(cfg, duration_s=cfg.duration_s * 1.1)
    return cfg


# What must be equal for an earlier run's points to stand beside this run's: the same plan and stack.
SAME_PLAN = ("model", "replicas", "window_s", "drain_s", "rate_rps", "min_requests", "slo", "domains", "seed")


def same_plan_config(
    cfg: ExperimentConfig, live: LiveFrontierConfig, rate: float, slo: Slo
) -> dict[str, Any]:
    """The result file's configuration entries that make its plan (`SAME_PLAN`)."""
    return {
        "model": cfg.model,
        "replicas": cfg.replicas,
        "window_s": cfg.duration_s,
        "drain_s": cfg.drain_s,
        "rate_rps": rate,
        "min_requests": live.min_requests,
        "slo": dataclasses.asdict(slo),
        "domains": list(cfg.domains),
        "seed": cfg.seed,
    }


# (policy, knob label) -> (point, its run entry) of the points an earlier run lends this one.
Kept = dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any] | None]]


def resume_from(
    prior: Mapping[str, Any], trace: str, config: Mapping[str, Any], knobs: Sequence[Knob]
) -> tuple[Kept, dict[str, float] | None]:
    """The points of an earlier live run (a result file, or the `results.json` a run keeps in its runs
    directory after every point) that this run can keep: (policy, knob label) -> (point, its run entry)
    for the knobs of this grid it holds, and its base losses. Raises ValueError when the earlier run
    replayed another trace or plan (`SAME_PLAN`), or has points but no base losses to score against."""
    if prior.get("mode") != "live":
        raise ValueError("not a live frontier result")
    check_same_plan(prior, trace, config, SAME_PLAN)
    wanted = {(k.policy, k.label) for k in knobs}
    runs = {(r.get("policy"), r.get("knob")): r for r in prior.get("runs", []) if "error" not in r}
    kept = {
        (p["policy"], p["knob"]): (dict(p), runs.get((p["policy"], p["knob"])))
        for p in prior.get("points", [])
        if (p.get("policy"), p.get("knob")) in wanted
    }
    base = prior.get("base_losses")
    if kept and not base:
        raise ValueError("it has points but no base losses")
    return kept, (dict(base) if base else None)


def _resumed(
    live: LiveFrontierConfig,
    trace: str,
    config: Mapping[str, Any],
    knobs: Sequence[Knob],
    say: Callable[[str], None],
) -> tuple[Kept, dict[str, float] | None]:
    """The points and base losses kept from `live.resume` (`resume_from`); none without it."""
    if live.resume is None:
        return {}, None
    prior = json.loads(Path(live.resume).read_text(encoding="utf-8"))
    try:
        kept, base = resume_from(prior, trace, config, knobs)
    except ValueError as exc:
        raise setup.SetupError(f"--resume {live.resume}: {exc}") from exc
    say(f"kept {len(kept)} of {len(knobs)} points from {live.resume}")
    return kept, base


@dataclass
class _Points:
    """What every point of one live frontier shares, and the result file's content as it grows."""

    cfg: ExperimentConfig
    plan: Sequence[PlannedRequest]
    datasets: dict[str, Path]
    root: Path
    results: dict[str, Any]
    base: dict[str, float] | None
    say: Callable[[str], None]
    err: IO[str]

    def keep(self, knob: Knob, point: dict[str, Any], run: dict[str, Any] | None) -> None:
        """A point kept from an earlier run."""
        self.results["points"].append(point)
        self.results["runs"].append({**(run or {"policy": knob.policy, "knob": knob.label}), "resumed": True})

    def run(self, i: int, knob: Knob) -> bool:
        """Point `i` on a fresh stack; whether it ran (its failure is recorded and said)."""
        run_dir = self.root / f"{i:02d}-{knob.policy}"
        self.say(f"{knob.policy} {knob.label} ...")
        t_point = time.monotonic()
        try:
            data = setup.replica_data(self.cfg, self.datasets, run_dir)
            env = knob_env(knob)
            res = run_live(self.cfg, knob.policy, self.plan, data, run_dir, self.err, self.base, env)
        except (LiveRunError, OSError) as exc:
            self.results["runs"].append({"policy": knob.policy, "knob": knob.label, "error": str(exc)})
            self.say(f"  FAILED: {exc}")
            return False
        self.base = self.base or dict(res["base_losses"])
        p = point_of(knob, res["summary"], res["ft_tokens"])
        self.results["points"].append(p.as_dict())
        self.results["runs"].append(
            {
                "policy": knob.policy,
                "knob": knob.label,
                "rounds": res["rounds"],
                "quality_gain_end_nats": res["summary"]["quality"].get("final_quality_gain"),
                "wall_s": round(time.monotonic() - t_point, 1),
                "run_dir": str(run_dir),
            }
        )
        (self.root / "results.json").write_text(
            json.dumps({**self.results, "base_losses": self.base}, indent=1, default=str) + "\n",
            encoding="utf-8",
        )
        self.say(
            f"  attainment {p.slo_attainment or 0:.3f}, goodput {p.goodput_rps or 0:.3f} req/s, ft tokens "
            f"{p.finetune_tokens or 0:.0f}, quality gain {p.quality_gain_nats or 0:.4f} "
            f"({time.monotonic() - t_point:.0f} s)"
        )
        return True


def live_frontier(
    cfg: ExperimentConfig,
    live: LiveFrontierConfig,
    knobs: Sequence[Knob],
    say: Callable[[str], None],
    err: IO[str],
) -> tuple[dict[str, Any], int]:
    """Every knob's point on a fresh stack (none with `dry_run`: the plan and the estimate only); (the
    result file's content less goals and frontiers, the number of points that failed)."""
    t0 = time.monotonic()
    (source,) = setup.resolve_sources(cfg)
    cal = None
    if cfg.calibration is not None and Path(cfg.calibration).is_file():
        cal = Calibration.load(cfg.calibration)
    slo = setup.slo_for(cfg, source, cal, max_batch())
    rate, how = live_rate(cfg, live, source, slo, say)
    cfg = sized_plan(cfg, source, rate, live.min_requests)
    kept, base = _resumed(live, source.name, same_plan_config(cfg, live, rate, slo), knobs, say)
    root = (live.runs_dir or DEFAULT_RUNS_DIR) / time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    datasets = setup.prepare_data(cfg, root / "data")
    plan = setup.build_plan(cfg, source, rate, setup.prompt_builder(cfg, setup.token_counter(cfg.model)), slo)
    total = estimate_s(len(knobs) - len(kept), cfg.duration_s, cfg.drain_s, time.monotonic() - t0)
    say(
        f"{source.label(cfg)}, model {cfg.model}, {cfg.replicas} replicas: {rate:.3f} req/s ({how}), "
        f"{len(plan)} requests in {cfg.duration_s:.0f} s windows, SLO TTFT {slo.ttft_ms:.0f} ms / TPOT "
        f"{slo.tpot_ms:.0f} ms; {len(knobs) - len(kept)} points to run, estimated {total / 60:.1f} min "
        f"({POINT_OVERHEAD_S:.0f} s per stack + {cfg.duration_s:.0f} s window + {cfg.drain_s:.0f} s drain "
        f"each); runs in {root}"
    )
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "mode": "live",
        "trace": {"name": source.name, "label": source.label(cfg), "path": str(source.path)},
        "config": {
            **same_plan_config(cfg, live, rate, slo),
            "rate_from": how,
            "estimated_s": round(total),
            "runs_dir": str(root),
        },
        "points": [],
        "runs": [],
    }
    if live.resume is not None:
        results["config"]["resumed_from"] = str(live.resume)
    points = _Points(cfg, plan, datasets, root, results, base, say, err)
    failed = 0
    for i, knob in enumerate([] if live.dry_run else knobs):
        if (knob.policy, knob.label) in kept:
            points.keep(knob, *kept[(knob.policy, knob.label)])
        elif not points.run(i, knob):
            failed += 1
    results["base_losses"] = points.base
    results["wall_s"] = round(time.monotonic() - t0, 1)
    return results, failed
