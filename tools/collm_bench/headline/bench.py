"""One invocation of the headline benchmark (`Headline`): the setup every run shares (calibration, speed
probe, data, prompt builder, output directory and the results document), then per trace its runs
(`trace_run.TraceRun`), then the outputs (`outputs.write_outputs`)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from collm_bench.step_costs import describe_kinds, describe_training, training_totals
from collm_common.calibration import Calibration
from collm_common.step_log import read_step_log
from collm_replica.naming import served_name
from collm_replica.settings import ReplicaSettings
from collm_sim.config import EngineSpec

from . import setup
from .config import HeadlineConfig
from .live import step_costs, training_by_replica
from .outputs import write_outputs
from .setup import SetupError
from .trace_run import TraceRun


def load_calibration(cfg: HeadlineConfig, err: TextIO) -> Calibration | None:
    """`cfg.calibration` (None without one), warning on `err` when it measured another model or another
    matmul precision than the stack runs; a SetupError when the file is missing."""
    if cfg.calibration is None:
        return None
    if not Path(cfg.calibration).is_file():
        raise SetupError(
            f"calibration {cfg.calibration} does not exist: `python -m collm_bench engine calibrate` "
            "writes it (or pass --rates, --slo-ttft-ms, --slo-tpot-ms and --no-simulate)"
        )
    cal = Calibration.load(cfg.calibration)
    if cal.model != served_name(cfg.model):
        err.write(
            f"collm-bench headline: warning: the calibration measured {cal.model}, the stack "
            f"runs {served_name(cfg.model)}: simulated rates and predictions are for the former\n"
        )
    stack_dtype = ReplicaSettings().matmul_dtype  # the replicas inherit this environment
    if cal.matmul_dtype != stack_dtype:
        err.write(
            f"collm-bench headline: warning: the calibration measured {cal.matmul_dtype} "
            f"products, the stack's replicas run {stack_dtype} (COLLM_MATMUL_DTYPE): the speed "
            "probe, simulated rates and predictions are for the former\n"
        )
    return cal


def _jsonable(cfg: HeadlineConfig) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def _samples_per_replica(datasets: dict[str, Path], cfg: HeadlineConfig) -> int:
    """Local training examples of a replica (the simulator's data-volume input), from the manifests."""
    counts = []
    for d in datasets.values():
        m = Path(d) / "manifest.json"
        if m.is_file():
            counts.append(int(json.loads(m.read_text()).get("train", cfg.train_examples)))
    return round(sum(counts) / len(counts)) if counts else cfg.train_examples


class Headline:
    """One invocation: the setup shared by every run, then per trace the rates, then per rate every
    policy (simulated and live), saving `results.json` after each run so a partial run is kept. The
    state every trace's runs share: the calibration (`cal`, scaled by the speed probe; `unscaled_cal`
    as measured when a probe scaled it), the data, the results document, the base model's losses and
    the count of failed runs."""

    def __init__(self, cfg: HeadlineConfig, argv: Sequence[str], out: TextIO, err: TextIO) -> None:
        self.cfg, self.out, self.err = cfg, out, err
        self.t_start = time.monotonic()
        self.sources = setup.resolve_sources(cfg)
        self.cal = load_calibration(cfg, err)
        if self.cal is None and (cfg.needs_search() or cfg.simulate):
            raise SetupError("the rate search and the simulator need a calibration (--calibration FILE)")
        if not cfg.live and self.cal is None:
            raise SetupError("--no-live without a calibration leaves nothing to run")
        self.max_batch = EngineSpec().max_batch  # the simulator's, its calibration's
        self.root = Path(cfg.out_dir) / time.strftime("%Y%m%d-%H%M%S")
        self.root.mkdir(parents=True, exist_ok=True)
        cal = self.cal
        self.results: dict[str, Any] = {
            "schema": "collm-headline/1",
            "command": ("python -m collm_bench headline " + " ".join(argv)).strip(),
            "config": _jsonable(cfg),
            "calibration": None
            if cal is None
            else {
                "path": str(cfg.calibration),
                "command": cal.command,
                "measured_unix_s": cal.measured_unix_s,
            },
            "started_unix_s": time.time(),
            "traces": [],
        }
        self.failed = 0
        self.say(f"{self.results['command']}\n[headline] results in {self.root}")
        self.datasets: dict[str, Path] = {}
        self.builder: Any = None
        self.unscaled_cal: Calibration | None = None  # the calibration as measured, when a probe scaled it
        if cfg.live:
            self.datasets = setup.prepare_data(cfg, self.root / "data")
            self.builder = setup.prompt_builder(cfg, setup.token_counter(cfg.model))
            if cfg.speed_probe and self.cal is not None and self.cal.model == served_name(cfg.model):
                self.probe_speed()
        self.samples = _samples_per_replica(self.datasets, cfg)
        # The base model's held-out loss per domain: measured by the first live run, passed to the others.
        self.base_losses: dict[str, float] | None = None
        self.say(f"setup (traces, data, tokenizer): {time.monotonic() - self.t_start:.1f} s")

    def probe_speed(self, after: bool = False) -> None:
        """Scale the calibration's step costs to the engine's speed on this machine now (`probe_speed`);
        `after` the runs, only measure and record it, so the table says whether the speed moved."""
        from collm_bench.calibrate import probe_speed
        from collm_common.data import load_dataset

        assert self.cal is not None
        text = " ".join(
            f"{e.prompt} {e.response}" for path in self.datasets.values() for e in load_dataset(path).train
        )
        if not text:
            self.say("speed probe: no local data to cut prompts from; the calibration's costs as they are")
            return
        reference = self.unscaled_cal if after else self.cal
        assert reference is not None
        probe = probe_speed(
            self.cfg.model,
            reference,
            text,
            processes=self.cfg.replicas,
            cache_dir=ReplicaSettings().model_cache_dir,
        )
        ratios = ", ".join(f"{k} {r:.2f}" for k, r in probe.ratios.items())
        if after:
            self.results["calibration"]["speed_probe_after"] = probe.as_dict()
            self.say(
                f"speed probe after the runs ({probe.wall_s:.0f} s): step times {probe.factor:.2f}x the "
                f"calibration's (median of {ratios})"
            )
            return
        self.unscaled_cal = self.cal
        kinds = probe.kind_factors()
        self.cal = self.cal.scaled_by_kind(**kinds)
        self.results["calibration"]["speed_probe"] = probe.as_dict()
        decode = ", ".join(f"{b} {f:.2f}" for b, f in sorted(kinds["decode"].items()))
        self.say(
            f"speed probe ({probe.wall_s:.0f} s, {self.cfg.replicas} engines at once): step times "
            f"{probe.factor:.2f}x the calibration's (median of {ratios}); its costs are scaled by kind: "
            f"prefill {kinds['prefill']:.2f}, decode by batch {decode}, training {kinds['train']:.2f} "
            "(evaluation as prefill)"
        )

    def say(self, line: str) -> None:
        self.out.write(f"[headline] {line}\n")
        self.out.flush()

    def save(self) -> None:
        text = json.dumps(self.results, indent=1, default=str) + "\n"
        (self.root / "results.json").write_text(text, encoding="utf-8")

    def run(self) -> int:
        for source in self.sources:
            TraceRun(self, source).run()
        if self.cfg.speed_probe_after and self.unscaled_cal is not None:
            self.probe_speed(after=True)
        return self.finish()

    def keep_base_losses(self, res: dict[str, Any], run_dir: Path) -> None:
        """The base model's losses, when live run `res` (in `run_dir`) measured them: passed to the
        later runs and recorded."""
        if res["base_losses_measured"]:
            self.base_losses = dict(res["base_losses"])
            self.results["base_losses"] = {"losses": self.base_losses, "measured_in": str(run_dir)}

    def record_training(
        self, into: dict[str, Any], res: dict[str, Any], run_dir: Path, sim_cut_s: float | None
    ) -> None:
        """The run's training stretches per replica (step logs) beside the simulated run's up to its
        drain cut, when both were written: kept as `training_by_replica` {live, sim} and said, one line
        per replica."""
        live = training_by_replica(res, self.cfg.replica_ids())
        if not live:
            return
        sim = {
            rid: training_totals(read_step_log(run_dir / f"sim_steps-{rid}.jsonl"), None, sim_cut_s).as_dict()
            for rid in live
            if (run_dir / f"sim_steps-{rid}.jsonl").is_file()
        }
        into["training_by_replica"] = {"live": live, "sim": sim}
        for rid, t in sorted(live.items()):
            line = f"    training, {rid}: live {describe_training(t)}"
            if rid in sim:
                line += f"; simulated {describe_training(sim[rid])}"
            self.say(line)

    def record_step_costs(self, into: dict[str, Any], res: dict[str, Any], cal: Calibration | None) -> None:
        """The run's steps (the replicas' step logs) against the costs its prediction used: kept as
        `step_costs` (per replica, per kind of step) and said, one line per replica."""
        if cal is None:
            return
        by_replica = step_costs(res, cal.cost, self.cfg.replica_ids())
        if not by_replica:
            return
        into["step_costs"] = by_replica
        for rid, kinds in sorted(by_replica.items()):
            self.say(f"    step time / the simulator's cost, {rid}: {describe_kinds(kinds)}")

    def finish(self) -> int:
        self.results["wall_s"] = time.monotonic() - self.t_start
        self.save()
        write_outputs(self.results, self.root, Path(self.cfg.out_dir), self.out)
        return 1 if self.failed else 0
