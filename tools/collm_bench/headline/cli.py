"""`python -m collm_bench headline` (what `make bench` runs): every policy on the live stack, one table.

    python -m collm_bench headline                                   # defaults (SmolLM2, 2 replicas, conv)
    python -m collm_bench headline --traces conv,code                # both Azure traces
    python -m collm_bench headline --model tiny                      # quick check of the pipeline
    python -m collm_bench headline --no-live                         # the rate search and simulator only
    python -m collm_bench headline --replicas 8 --duration 600 --rates light=4,heavy=6   # a bigger machine

Writes `OUT/<timestamp>/` (results.json, table.md, headline.png, one directory per run with the
requests, summary, stack logs and telemetry) and copies the table and figure to `OUT/latest.md` and
`OUT/latest.png`. Exit status: 0 done (goals met or not: the table says), 2 something required is
missing (trace files, domain data, calibration), 1 a run failed, 130 interrupted (SIGINT or SIGTERM:
the stack of the run in progress is stopped first).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from collm_bench.records import write_records
from collm_bench.step_costs import describe_kinds, describe_training, training_totals
from collm_common.calibration import Calibration
from collm_common.step_log import read_step_log
from collm_replica.naming import served_name
from collm_replica.settings import ReplicaSettings

from . import setup
from .config import BASELINES, RATE_LABELS, HeadlineConfig, tiny_preset
from .live import LiveRunError, eval_shapes_of_run, run_live, step_costs, training_by_replica
from .plot import plot
from .predict import cost_band, simulate_run
from .rates import BestBaseline, capacity_estimate_rps, grid_counts, search_rate
from .replay_fit import (
    OFFSET_REQUESTS,
    REPLAY_SERIES,
    EvalFit,
    measured_eval_fit,
    measured_first_slow_s,
    measured_inference_factor,
    ms_per_token,
    replay_start_s,
    with_inference_factor,
)
from .setup import SetupError, TraceSource
from .table import compact, compare, markdown


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m collm_bench headline",
        description="The headline benchmark: each coordinator policy on the live stack over the same trace "
        "slice, at a light and a heavy rate found with the simulator; goodput, SLO attainment, latency, "
        "fine-tuning, rounds and served quality in one table, the simulator's prediction beside it.",
        epilog="Defaults fit a 2-core CPU machine in about 15 minutes; --model tiny sets quick-check sizes.",
    )
    d = HeadlineConfig()
    g = p.add_argument_group("what runs")
    g.add_argument(
        "--model", default=None, help=f"smollm2, tiny, an HF directory or .gguf (default {d.model})"
    )
    g.add_argument("--replicas", type=int, default=None, help=f"replicas per stack (default {d.replicas})")
    g.add_argument(
        "--domains", default=None, help=f"replica i holds domain i mod n (default {','.join(d.domains)})"
    )
    g.add_argument("--policies", default=None, help=f"default {','.join(d.policies)}")
    g.add_argument("--traces", default=None, help=f"Azure traces to replay (default {','.join(d.traces)})")
    g.add_argument("--traces-dir", type=Path, default=None, help=f"default {d.traces_dir}")
    g.add_argument(
        "--domains-dir", type=Path, default=None, help=f"public datasets (default {d.domains_dir})"
    )
    g.add_argument("--data", action="append", metavar="DOMAIN=DIR", help="a prepared dataset directory")
    g.add_argument(
        "--synthetic-fallback",
        action="store_true",
        help="replay synthetic gamma arrivals when a trace file is absent (labelled SYNTHETIC)",
    )
    g = p.add_argument_group("the slice")
    g.add_argument("--trace-start-s", type=float, default=None, help="slice start in trace time")
    g.add_argument(
        "--duration", type=float, default=None, help=f"seconds of arrivals per run (default {d.duration_s:g})"
    )
    g.add_argument(
        "--drain-s", type=float, default=None, help=f"wait after the last arrival (default {d.drain_s:g})"
    )
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--input-scale", type=float, default=None, help=f"default {d.input_scale}")
    g.add_argument("--output-scale", type=float, default=None, help=f"default {d.output_scale}")
    g.add_argument("--max-input-tokens", type=int, default=None)
    g.add_argument("--max-output-tokens", type=int, default=None, help=f"default {d.max_output_tokens}")
    g.add_argument("--max-context-tokens", type=int, default=None, help=f"default {d.max_context_tokens}")
    g = p.add_argument_group("rates and SLOs")
    g.add_argument("--rates", default=None, help="light=R1,heavy=R2 (req/s); omitted ones are searched")
    g.add_argument("--rate-labels", default=None, help="which rates run: light,heavy (default both)")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="default: 3 x unloaded p99-prompt TTFT")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="default: 3 x a full-batch decode step")
    g.add_argument("--calibration", type=Path, default=None, help=f"default {d.calibration}")
    g = p.add_argument_group("the stack")
    g.add_argument(
        "--slow-interval-s", type=float, default=None, help=f"round plans (default {d.slow_interval_s:g})"
    )
    g.add_argument("--round-deadline-s", type=float, default=None, help=f"default {d.round_deadline_s:g}")
    g.add_argument("--rounds", choices=("async", "sync"), default=None, help=f"default {d.rounds}")
    g.add_argument(
        "--coordinator-warmup-s", type=float, default=None, help=f"default {d.coordinator_warmup_s:g}"
    )
    g.add_argument("--eval-max-examples", type=int, default=None, help=f"default {d.eval_max_examples}")
    g.add_argument("--eval-max-tokens", type=int, default=None, help=f"default {d.eval_max_tokens}")
    g.add_argument(
        "--train-examples", type=int, default=None, help=f"local data (default {d.train_examples})"
    )
    g.add_argument("--eval-examples", type=int, default=None, help=f"default {d.eval_examples}")
    g.add_argument("--torch-threads", type=int, default=None, help=f"per replica (default {d.torch_threads})")
    g.add_argument("--request-timeout-s", type=float, default=None)
    g = p.add_argument_group("output")
    g.add_argument("--out-dir", type=Path, default=None, help=f"default {d.out_dir}")
    g.add_argument("--no-simulate", action="store_true", help="no simulator prediction beside the live runs")
    g.add_argument("--no-live", action="store_true", help="only the rate search and the simulator")
    g.add_argument(
        "--no-speed-probe",
        action="store_true",
        help="use the calibration's step costs as they are (default: scaled by a probe of the engine now)",
    )
    g.add_argument(
        "--no-calibration-replay",
        action="store_true",
        help="no calibration replay (default: before each trace's runs, another slice of it is replayed "
        "live with fine-tuning off, and the simulator's inference costs are scaled by what its steps took "
        "over what the simulator charges for them)",
    )
    g.add_argument(
        "--probe-after",
        action="store_true",
        help="probe the engine's speed again after the runs and say it beside the first probe",
    )
    g.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="RESULTS_JSON",
        help="recompute the ratios, table and figure of a finished run (nothing runs)",
    )
    return p


def _pairs(values: Sequence[str] | None) -> dict[str, str]:
    out = {}
    for v in values or []:
        for part in v.split(","):
            k, sep, val = part.partition("=")
            if not sep:
                raise SetupError(f"{part!r} is not DOMAIN=DIR")
            out[k.strip()] = val.strip()
    return out


def parse_rates(spec: str | None) -> dict[str, float]:
    """`light=0.5,heavy=1.2` or `0.5,1.2` (light first)."""
    if not spec:
        return {}
    out: dict[str, float] = {}
    for i, part in enumerate(p for p in spec.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        label, value = (key.strip(), value) if sep else (RATE_LABELS[min(i, 1)], key)
        try:
            out[label] = float(value)
        except ValueError:
            raise SetupError(f"--rates: {part!r} is not LABEL=REQ_PER_S") from None
    return out


def _csv(v: str | None) -> tuple[str, ...] | None:
    return None if v is None else tuple(x.strip() for x in v.split(",") if x.strip())


def config_from_args(args: argparse.Namespace) -> HeadlineConfig:
    base = HeadlineConfig()
    if args.model == "tiny":
        base = tiny_preset(base)
    given: dict[str, Any] = {
        "model": args.model,
        "replicas": args.replicas,
        "domains": _csv(args.domains),
        "policies": _csv(args.policies),
        "traces": _csv(args.traces),
        "traces_dir": args.traces_dir,
        "domains_dir": args.domains_dir,
        "trace_start_s": args.trace_start_s,
        "duration_s": args.duration,
        "drain_s": args.drain_s,
        "seed": args.seed,
        "input_scale": args.input_scale,
        "output_scale": args.output_scale,
        "max_input_tokens": args.max_input_tokens,
        "max_output_tokens": args.max_output_tokens,
        "max_context_tokens": args.max_context_tokens,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "calibration": args.calibration,
        "slow_interval_s": args.slow_interval_s,
        "round_deadline_s": args.round_deadline_s,
        "rounds": args.rounds,
        "coordinator_warmup_s": args.coordinator_warmup_s,
        "eval_max_examples": args.eval_max_examples,
        "eval_max_tokens": args.eval_max_tokens,
        "train_examples": args.train_examples,
        "eval_examples": args.eval_examples,
        "torch_threads": args.torch_threads,
        "request_timeout_s": args.request_timeout_s,
        "out_dir": args.out_dir,
        "rate_labels": _csv(args.rate_labels),
    }
    changes = {k: v for k, v in given.items() if v is not None}
    rates = parse_rates(args.rates)
    if rates:
        changes["rates"] = {**base.rates, **rates}
    data = _pairs(args.data)
    if data:
        changes["data_dirs"] = {k: Path(v) for k, v in data.items()}
    if args.synthetic_fallback:
        changes["synthetic_fallback"] = True
    if args.no_simulate:
        changes["simulate"] = False
    if args.no_live:
        changes["live"] = False
    if args.no_speed_probe:
        changes["speed_probe"] = False
    if args.probe_after:
        changes["speed_probe_after"] = True
    if args.no_calibration_replay:
        changes["calibration_replay"] = False
    return dataclasses.replace(base, **changes)


def _jsonable(cfg: HeadlineConfig) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


class Headline:
    """One invocation: the setup shared by every run, then per trace the rates, then per rate every
    policy (simulated and live), saving `results.json` after each run so a partial run is kept."""

    def __init__(self, cfg: HeadlineConfig, argv: Sequence[str], out: TextIO, err: TextIO) -> None:
        self.cfg, self.out, self.err = cfg, out, err
        self.t_start = time.monotonic()
        self.sources = setup.resolve_sources(cfg)
        self.cal: Calibration | None = None
        if cfg.calibration is not None:
            if not Path(cfg.calibration).is_file():
                raise SetupError(
                    f"calibration {cfg.calibration} does not exist: `python -m collm_bench engine calibrate` "
                    "writes it (or pass --rates, --slo-ttft-ms, --slo-tpot-ms and --no-simulate)"
                )
            self.cal = Calibration.load(cfg.calibration)
            if self.cal.model != served_name(cfg.model):
                err.write(
                    f"collm-bench headline: warning: the calibration measured {self.cal.model}, the stack "
                    f"runs {served_name(cfg.model)}: simulated rates and predictions are for the former\n"
                )
            stack_dtype = ReplicaSettings().matmul_dtype  # the replicas inherit this environment
            if self.cal.matmul_dtype != stack_dtype:
                err.write(
                    f"collm-bench headline: warning: the calibration measured {self.cal.matmul_dtype} "
                    f"products, the stack's replicas run {stack_dtype} (COLLM_MATMUL_DTYPE): the speed "
                    "probe, simulated rates and predictions are for the former\n"
                )
        if self.cal is None and (cfg.needs_search() or cfg.simulate):
            raise SetupError("the rate search and the simulator need a calibration (--calibration FILE)")
        if not cfg.live and self.cal is None:
            raise SetupError("--no-live without a calibration leaves nothing to run")
        self.max_batch = int(ReplicaSettings.model_fields["max_batch"].default)
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
        self.prediction_cal: Calibration | None = self.cal  # the costs of the trace's predictions
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

    # --- per trace ------------------------------------------------------------------------------------
    def run(self) -> int:
        for source in self.sources:
            self.run_trace(source)
        if self.cfg.speed_probe_after and self.unscaled_cal is not None:
            self.probe_speed(after=True)
        return self.finish()

    def run_trace(self, source: TraceSource) -> None:
        cfg = self.cfg
        slo = setup.slo_for(cfg, source, self.cal, self.max_batch)
        label = source.label(cfg)
        tr: dict[str, Any] = {
            "trace": source.name,
            "label": label,
            "path": str(source.path) if source.path else None,
            "slo": dataclasses.asdict(slo),
            "rates": {},
        }
        self.results["traces"].append(tr)
        self.say(f"{label}: SLO TTFT {slo.ttft_ms:.0f} ms, TPOT {slo.tpot_ms:.0f} ms")
        cache: dict[tuple[str, int, float | None], dict[str, Any]] = {}
        replay_factor = 1.0  # this trace's inference cost factor from the calibration replay (`replay_fit`)
        self.prediction_cal = self.cal  # the costs the predictions of this trace use
        self.eval_fit: EvalFit | None = None  # the evaluations' batches, measured on this trace's replay
        self.first_slow_s: float | None = None  # the coordinator's first round plans, likewise

        def sim(
            policy: str, n: int, factor: float | None = None, step_logs_dir: Path | None = None
        ) -> dict[str, Any]:
            """The simulated run; with `factor`, on the calibration as measured with every cost times that
            (an end of the speed probe's range) instead of scaled by kind; either with the replay's factor.
            With `step_logs_dir`, simulated again (not cached) with its replicas' step logs written there."""
            if (policy, n, factor) not in cache or step_logs_dir is not None:
                cal = self.cal if factor is None else self.unscaled_cal
                assert cal is not None
                if factor is not None:
                    cal = cal.scaled(factor)
                if replay_factor != 1.0:
                    cal = with_inference_factor(cal, replay_factor)
                rate = n / cfg.duration_s
                run = simulate_run(
                    cfg,
                    cal,
                    source,
                    rate,
                    slo,
                    policy,
                    self.samples,
                    step_logs_dir,
                    self.eval_fit,
                    self.first_slow_s,
                )
                if step_logs_dir is not None:
                    return run
                cache[policy, n, factor] = run
            return cache[policy, n, factor]

        t_search = time.monotonic()
        choices = self.search(source, sim)
        if choices:
            self.say(f"rate search: {time.monotonic() - t_search:.1f} s ({len(cache)} simulations)")
        if self.calibration_replay_wanted():
            fitted = self.calibration_replay(source, slo, self._replay_rate(choices), tr)
            if fitted is not None:
                replay_factor = fitted
                assert self.cal is not None
                self.prediction_cal = with_inference_factor(self.cal, fitted)
                cache.clear()
                t_search = time.monotonic()
                choices = self.search(source, sim)
                if choices:
                    self.say(
                        f"rate search again, inference costs x{replay_factor:.3f}: "
                        f"{time.monotonic() - t_search:.1f} s ({len(cache)} simulations)"
                    )
        for lab in cfg.rate_labels:
            rate = cfg.rates.get(lab, choices.get(lab, {}).get("rate_rps"))
            if rate is None:
                continue
            n = max(1, round(rate * cfg.duration_s))
            same = [k for k, b in tr["rates"].items() if b["n_requests"] == n]
            if same:
                # A slice is its request count: the same count is the same replay, run once.
                tr.setdefault("notes", []).append(
                    f"{lab} and {same[0]} are the same {n} requests in {cfg.duration_s:g} s: run once"
                )
                self.say(tr["notes"][-1])
                continue
            block: dict[str, Any] = {"rate_rps": n / cfg.duration_s, "n_requests": n, "runs": {}}
            block.update({"choice": choices[lab]} if lab in choices else {"given": True})
            tr["rates"][lab] = block
            plan = []
            if self.builder is not None:
                plan = setup.build_plan(cfg, source, block["rate_rps"], self.builder, slo)
                block["plan"] = setup.plan_stats(plan)
            for policy in cfg.policies:
                block["runs"][policy] = self.run_policy(source, lab, block, policy, plan, sim)
                self.save()
            self.compare_block(block)
            self.save()

    def calibration_replay_wanted(self) -> bool:
        """A calibration replay is of use: live runs, the simulator, and a calibration of this model."""
        cfg = self.cfg
        return (
            cfg.calibration_replay
            and cfg.live
            and cfg.simulate
            and self.cal is not None
            and self.cal.model == served_name(cfg.model)
        )

    def _replay_rate(self, choices: dict[str, dict[str, Any]]) -> float | None:
        """The calibration replay's rate: the light rate (searched or given), else the first one run."""
        cfg = self.cfg
        for lab in ("light", *cfg.rate_labels):
            rate = cfg.rates.get(lab, choices.get(lab, {}).get("rate_rps"))
            if rate is not None:
                return float(rate)
        return None

    def calibration_replay(
        self, source: TraceSource, slo: Any, rate: float | None, tr: dict[str, Any]
    ) -> float | None:
        """Replay another slice of `source` live at `rate` with fine-tuning off (`serving_only`) and measure
        its inference steps against the simulator's costs (`replay_fit`); the factor, or None when it
        cannot be had."""
        cfg = self.cfg
        assert self.cal is not None
        if rate is None:
            return None
        if source.synthetic:
            replay_cfg = dataclasses.replace(cfg, seed=cfg.seed + 1)
            where = f"synthetic arrivals, seed {cfg.seed + 1}"
        else:
            start = replay_start_s(source.requests, cfg.trace_start_s)
            if start is None:
                tr.setdefault("notes", []).append(
                    f"no calibration replay: the trace has fewer than {OFFSET_REQUESTS} requests after "
                    "the slice's start"
                )
                self.say(tr["notes"][-1])
                return None
            replay_cfg = dataclasses.replace(cfg, trace_start_s=start)
            where = f"trace from {start:.1f} s, {OFFSET_REQUESTS} requests after the slice's start"
        n = max(1, round(rate * cfg.duration_s))
        rate = n / cfg.duration_s
        self.say(f"{source.label(cfg)}: calibration replay, {where}, {rate:.3f} req/s, {REPLAY_SERIES} ...")
        t0 = time.monotonic()
        run_dir = self.root / f"{source.name}-calibration-replay"
        plan = setup.build_plan(replay_cfg, source, rate, self.builder, slo)
        try:
            data = setup.replica_data(replay_cfg, self.datasets, run_dir)
            res = run_live(replay_cfg, REPLAY_SERIES, plan, data, run_dir, self.err, self.base_losses)
        except (LiveRunError, OSError) as exc:
            tr["calibration_replay"] = {"error": str(exc)}
            self.say(f"  calibration replay FAILED ({exc}): the probe's costs as they are")
            return None
        if res["base_losses_measured"]:
            self.base_losses = dict(res["base_losses"])
            self.results["base_losses"] = {"losses": self.base_losses, "measured_in": str(run_dir)}
        busy = res.get("busy_s_by_replica") or {}
        live_s = sum(b.get("inference", 0.0) for b in busy.values())
        live_tokens = sum((res.get("inference_tokens_by_replica") or {}).values())
        live_attainment = res["summary"].get("attainment")
        record: dict[str, Any] = {
            "policy": REPLAY_SERIES,
            "trace_start_s": replay_cfg.trace_start_s,
            "seed": replay_cfg.seed,
            "rate_rps": rate,
            "n_requests": n,
            "live_attainment": live_attainment,
            "live_inference_s": live_s,
            "live_inference_tokens": live_tokens,
            "live": compact(res["summary"], {"busy_s_by_replica": busy, "run_dir": str(run_dir)}),
        }
        tr["calibration_replay"] = record
        self.record_step_costs(record, res, self.cal)
        factor = measured_inference_factor(record.get("step_costs") or {})
        if factor is None:
            self.say("  calibration replay: no inference step logged; the probe's costs as they are")
            return None
        shapes = eval_shapes_of_run(res, cfg.replica_ids())
        self.eval_fit = measured_eval_fit(shapes, cfg.eval_max_tokens)
        record["eval_shapes"] = {rid: dataclasses.asdict(s) for rid, s in shapes.items()}
        record["eval_fit"] = dataclasses.asdict(self.eval_fit) if self.eval_fit else None
        self.first_slow_s = measured_first_slow_s(res.get("coordinator_slow_ticks_s") or [])
        record["coordinator_first_slow_s"] = self.first_slow_s
        sims = {
            f: simulate_run(
                replay_cfg,
                with_inference_factor(self.cal, f),
                source,
                rate,
                slo,
                REPLAY_SERIES,
                self.samples,
                eval_fit=self.eval_fit,
                first_slow_s=self.first_slow_s,
            )
            for f in (1.0, factor)
        }
        sim_attainment = {f: sims[f]["summary"]["attainment"] for f in sims}
        live_ms = ms_per_token([(live_s, live_tokens)])
        sim_ms = {f: ms_per_token(sims[f]["sim"]["inference_by_replica_to_cut"].values()) for f in sims}
        record |= {
            "factor": factor,
            # The check: the replay's attainment, simulated at the probe's costs and at the measured ones.
            "sim_attainment": {"probe": sim_attainment[1.0], "measured": sim_attainment[factor]},
            # Inference time per token served, live and simulated (probe's costs, measured ones).
            "ms_per_token": {"live": live_ms, "sim_probe": sim_ms[1.0], "sim_measured": sim_ms[factor]},
            "wall_s": time.monotonic() - t0,
        }

        def att(a: float | None) -> str:
            return "-" if a is None else f"{a:.3f}"

        tr.setdefault("notes", []).append(
            f"the simulator's prefill and decode costs x{factor:.3f}: the live inference steps' time over "
            f"what the simulator charges for them, measured on a calibration replay ({where}; {n} requests "
            f"at {rate:.3f} req/s, {REPLAY_SERIES}); the replay attained {att(live_attainment)} live, "
            f"{att(sim_attainment[1.0])} simulated at the probe's costs and {att(sim_attainment[factor])} "
            "at the measured ones"
        )
        self.say(tr["notes"][-1] + f" ({time.monotonic() - t0:.0f} s)")
        if self.eval_fit is not None:
            each = ", ".join(
                f"{rid} {s.batches} of {s.tokens_per_batch:.0f} tokens in {s.pieces_per_batch:.1f} pieces"
                for rid, s in sorted(shapes.items())
                if s.tokens_per_batch is not None and s.pieces_per_batch is not None
            )
            by = ", ".join(f"{rid} {n}" for rid, n in self.eval_fit.batches_by_replica.items())
            tr["notes"].append(
                f"the simulator's evaluations of {cfg.eval_max_tokens} tokens in batches of "
                f"{self.eval_fit.pieces_per_batch} pieces, per replica {by} batches (else "
                f"{self.eval_fit.batches}): the replay's evaluation batches, {each}"
            )
            self.say(tr["notes"][-1])
        if self.first_slow_s is not None:
            tr["notes"].append(
                f"the simulator's first round plans {self.first_slow_s:.1f} s into the trace: the replay's "
                f"coordinator planned its first rounds then (it starts with the stack, before the replay; "
                f"its warmup is {cfg.coordinator_warmup_s:g} s)"
            )
            self.say(tr["notes"][-1])
        return factor

    def search(self, source: TraceSource, sim: Any) -> dict[str, dict[str, Any]]:
        """The rates not given on the command line, found with the simulator (`rates`)."""
        cfg, cal = self.cfg, self.cal
        if not cfg.needs_search():
            return {}
        assert cal is not None
        probe = setup.shapes(cfg, source, max(1.0, 200 / cfg.duration_s))
        cap = capacity_estimate_rps(
            cal.cost.prefill_ms_per_token,
            cal.cost.decode_ms(self.max_batch),
            self.max_batch,
            cal.cost.lora_overhead_frac_per_adapter,
            sum(s.input_tokens for s in probe) / len(probe),
            sum(s.output_tokens for s in probe) / len(probe),
            cfg.replicas,
        )
        grid = grid_counts(cap, cfg.duration_s, cfg.rate_grid_fractions)
        best = BestBaseline(lambda p, n: sim(p, n)["summary"]["attainment"] or 0.0, BASELINES)
        targets = {"light": cfg.light_attainment, "heavy": cfg.heavy_attainment}
        out = {}
        for lab in cfg.needs_search():
            c = search_rate(best, lab, targets[lab], grid, cfg.duration_s, nearest=lab == "heavy")
            out[lab] = c.as_dict() | {"capacity_estimate_rps": cap, "grid_requests": grid}
            self.say(
                f"{lab} rate {c.rate_rps:.3f} req/s ({c.n_requests} requests): {c.how}; "
                f"simulated {c.best_baseline} attains {c.attainment:.3f}"
            )
        return out

    # --- per policy -----------------------------------------------------------------------------------
    def run_policy(
        self, source: TraceSource, lab: str, block: dict[str, Any], policy: str, plan: list[Any], sim: Any
    ) -> dict[str, Any]:
        cfg = self.cfg
        entry: dict[str, Any] = {}
        if cfg.simulate and self.cal is not None:
            s = sim(policy, block["n_requests"])
            extra = {
                # Up to the drain cut, as the live counters are read; the whole simulated run apart.
                "ft_tokens": s["sim"]["ft_tokens_to_cut"],
                "ft_tokens_whole_run": s["sim"]["ft_tokens"],
                "rounds": s["sim"]["rounds"],
                "quality_gain_model": s["sim"]["quality_gain_mix"],
                "busy_s_by_replica": s["sim"].get("busy_s_by_replica"),
            }
            entry["sim"] = compact(s["summary"], extra)
            probe = (self.results.get("calibration") or {}).get("speed_probe")
            if probe and self.unscaled_cal is not None:
                # The prediction's spread: every cost at the probe's lowest and at its highest ratio to the
                # calibration instead of each kind's own factor.
                factors = cost_band(probe["ratios"].values())
                ends = [sim(policy, block["n_requests"], f)["summary"]["goodput_rps"] for f in factors]
                entry["sim"]["goodput_range"] = {
                    "cost_factors": list(factors),
                    "goodput_rps": ends,
                    "range_rps": [
                        min(*ends, s["summary"]["goodput_rps"]),
                        max(*ends, s["summary"]["goodput_rps"]),
                    ],
                }
        if not cfg.live:
            return entry
        run_dir = self.root / f"{source.name}-{lab}-{policy}"
        self.say(f"{source.label(cfg)}, {lab} {block['rate_rps']:.3f} req/s: {policy} ...")
        t0 = time.monotonic()
        try:
            data = setup.replica_data(cfg, self.datasets, run_dir)
            res = run_live(cfg, policy, plan, data, run_dir, self.err, self.base_losses)
        except (LiveRunError, OSError) as exc:
            self.failed += 1
            entry["live_error"] = str(exc)
            self.say(f"  {policy} FAILED: {exc}")
            return entry
        sim_cut_s: float | None = None  # the simulated run's drain cut (its time base)
        if cfg.simulate and self.cal is not None:
            # The prediction's requests and steps beside the live ones (`requests.jsonl`, the stack's step
            # logs), to compare one by one.
            predicted = sim(policy, block["n_requests"], step_logs_dir=run_dir)
            write_records(run_dir / "sim_requests.jsonl", predicted["records"])
            sim_cut_s = predicted["sim"]["cut_s"]
        if res["base_losses_measured"]:
            self.base_losses = dict(res["base_losses"])
            self.results["base_losses"] = {"losses": self.base_losses, "measured_in": str(run_dir)}
        keep = (
            "ft_tokens",
            "ft_limits_by_replica",
            "busy_s_by_replica",
            "forward_s_by_replica",
            "cpu_s_by_process",
            "machine_cpu_s",
            "rounds",
            "stack_ready_s",
            "wall_s",
            "phases_s",
            "coordinator_slow_ticks_s",
            "coordinator_policy",
            "coscheduler",
            "run_dir",
        )
        extra = {k: res.get(k) for k in keep} | {"quality_gain_current_end": res["final_current_gain"]}
        lv = entry["live"] = compact(res["summary"], extra)
        self.record_step_costs(lv, res, self.prediction_cal)
        limits: dict[str, float] = {}
        for per in res["ft_limits_by_replica"].values():
            for k, n in per.items():
                limits[k] = limits.get(k, 0.0) + n
        self.say(
            f"  {policy}: goodput {lv['goodput_rps']:.3f} req/s, attainment {lv['attainment']:.3f}, "
            f"ft tokens {lv['ft_tokens']:.0f}, rounds {lv['rounds']}, quality gain end "
            f"{lv['quality_gain_end']}, serving iterations with a job by what bounded training "
            f"{ {k: int(n) for k, n in sorted(limits.items())} } ({time.monotonic() - t0:.0f}s)"
        )
        busy = res.get("busy_s_by_replica") or {}
        if busy:
            self.say("    busy s (inference / training / evaluation): " + busy_line(busy))
            forward = res.get("forward_s_by_replica") or {}
            if forward:
                self.say(
                    "    of the inference, in the model's forward passes: "
                    + ", ".join(f"{r} {s:.0f} s" for r, s in sorted(forward.items()))
                )
        cpu = res.get("cpu_s_by_process") or {}
        if cpu:
            machine = res.get("machine_cpu_s") or {}
            whole = ", ".join(f"{k} {v:.0f}" for k, v in machine.items())
            self.say(
                "    cpu s during the replay: "
                + ", ".join(f"{n} {s:.0f}" for n, s in sorted(cpu.items()))
                + (f"; the machine: {whole}" if whole else "")
            )
        simulated = (entry.get("sim") or {}).get("busy_s_by_replica") or {}
        if simulated:
            self.say("    simulated (whole run):                      " + busy_line(simulated))
        self.record_training(lv, res, run_dir, sim_cut_s)
        return entry

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

    def compare_block(self, block: dict[str, Any]) -> None:
        compare_block(block)

    # --- the end ---------------------------------------------------------------------------------------
    def finish(self) -> int:
        self.results["wall_s"] = time.monotonic() - self.t_start
        self.save()
        write_outputs(self.results, self.root, Path(self.cfg.out_dir), self.out)
        return 1 if self.failed else 0


def compare_block(block: dict[str, Any]) -> None:
    """Ratios and goals of one rate's runs (live, with the simulator's error; else simulated only)."""
    live = {p: e["live"] for p, e in block["runs"].items() if e.get("live")}
    sims = {p: e["sim"] for p, e in block["runs"].items() if e.get("sim")}
    if live:
        block["compare"] = compare(live, sims or None)
    else:
        block["compare"] = compare(sims, None) | {"simulated_only": True}


def _probe_note(results: dict[str, Any]) -> str:
    probe = (results.get("calibration") or {}).get("speed_probe")
    if not probe:
        return ""
    after = (results.get("calibration") or {}).get("speed_probe_after")
    then = f" and {after['factor']:.2f}x in one after them" if after else ""
    kinds = probe.get("kind_factors")
    how = "by that"  # results of the benchmark before costs were scaled by kind
    if kinds:
        decode = " / ".join(
            f"{float(f):.2f}" for _, f in sorted(kinds["decode"].items(), key=lambda x: int(x[0]))
        )
        batches = " / ".join(str(b) for b in sorted(int(b) for b in kinds["decode"]))
        how = (
            f"by kind: prefill {kinds['prefill']:.2f}, decode at batch {batches} {decode}, "
            f"training {kinds['train']:.2f}"
        )
    return (
        f"; the engine's step times {probe['factor']:.2f}x the calibration's (median) in a probe before the "
        f"runs, its costs scaled {how}{then}"
    )


def write_outputs(results: dict[str, Any], root: Path, latest_dir: Path | None, out: TextIO) -> None:
    """table.md and headline.png beside results.json (and as latest.* in `latest_dir`); prints the table."""
    cfg = results["config"]
    started = time.strftime("%Y-%m-%d %H:%M", time.localtime(results.get("started_unix_s", time.time())))
    header = (
        f"Command: `{results['command']}` ({started}, {results.get('wall_s', 0.0) / 60:.1f} min; "
        f"model {cfg['model']}, {cfg['replicas']} replicas, {cfg['duration_s']:g} s of arrivals per run, "
        f"seed {cfg['seed']}" + _probe_note(results) + ")\n\n"
    )
    table = markdown(results)
    (root / "table.md").write_text(header + table + "\n", encoding="utf-8")
    png = plot(results, root / "headline.png")
    if latest_dir is not None:
        shutil.copyfile(root / "table.md", latest_dir / "latest.md")
        if png is not None:
            shutil.copyfile(png, latest_dir / "latest.png")
    out.write("\n" + header + table + "\n\n")
    out.write(f"[headline] {root / 'results.json'}\n")
    if png is not None:
        out.write(f"[headline] {png}\n")


def render(path: Path, out: TextIO) -> int:
    """`--render`: recompute the comparisons of a finished run's results.json and write its outputs."""
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise SetupError(f"--render {path}: {exc}") from None
    for tr in results["traces"]:
        for block in tr["rates"].values():
            compare_block(block)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    write_outputs(results, path.parent, None, out)
    return 0


def busy_line(busy: dict[str, dict[str, float]]) -> str:
    """`r0 81 / 2 / 6, r1 ...`: seconds of inference, training and evaluation per replica."""
    kinds = ("inference", "training", "evaluation")
    rows = sorted(busy.items())
    return ", ".join(f"{r} " + " / ".join(f"{b.get(w, 0.0):.0f}" for w in kinds) for r, b in rows)


def _samples_per_replica(datasets: dict[str, Path], cfg: HeadlineConfig) -> int:
    """Local training examples of a replica (the simulator's data-volume input), from the manifests."""
    counts = []
    for d in datasets.values():
        m = Path(d) / "manifest.json"
        if m.is_file():
            counts.append(int(json.loads(m.read_text()).get("train", cfg.train_examples)))
    return round(sum(counts) / len(counts)) if counts else cfg.train_examples


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.render is not None:
            return render(args.render, out)
        cfg = config_from_args(args)
        return Headline(cfg, argv, out, err).run()
    except (SetupError, ValueError) as exc:
        err.write(f"collm-bench headline: {exc}\n")
        return 2
    except KeyboardInterrupt:
        # SIGINT or SIGTERM (`signals`): the run in progress stopped its stack before this.
        err.write("collm-bench headline: interrupted; the stack of the run in progress is stopped\n")
        return 130
