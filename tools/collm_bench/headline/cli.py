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
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from collm_workload import flags

from .bench import Headline
from .config import RATE_LABELS, HeadlineConfig, tiny_preset
from .outputs import render
from .setup import SetupError


def _add_what_runs(g: argparse._ArgumentGroup, d: HeadlineConfig) -> None:
    g.add_argument(
        "--model", default=None, help=f"smollm2, tiny, an HF directory or .gguf (default {d.model})"
    )
    g.add_argument("--replicas", type=int, default=None, help=f"replicas per stack (default {d.replicas})")
    g.add_argument(
        "--domains", default=None, help=f"replica i holds domain i mod n (default {','.join(d.domains)})"
    )
    g.add_argument("--policies", default=None, help=f"default {','.join(d.policies)}")
    g.add_argument("--traces", default=None, help=f"Azure traces to replay (default {','.join(d.traces)})")
    flags.add_traces_dir(g, default=None, help=f"default {d.traces_dir}")
    g.add_argument(
        "--domains-dir", type=Path, default=None, help=f"public datasets (default {d.domains_dir})"
    )
    g.add_argument("--data", action="append", metavar="DOMAIN=DIR", help="a prepared dataset directory")
    g.add_argument(
        "--synthetic-fallback",
        action="store_true",
        help="replay synthetic gamma arrivals when a trace file is absent (labelled SYNTHETIC)",
    )


def _add_slice(g: argparse._ArgumentGroup, d: HeadlineConfig) -> None:
    g.add_argument("--trace-start-s", type=float, default=None, help="slice start in trace time")
    g.add_argument(
        "--duration", type=float, default=None, help=f"seconds of arrivals per run (default {d.duration_s:g})"
    )
    g.add_argument(
        "--drain-s", type=float, default=None, help=f"wait after the last arrival (default {d.drain_s:g})"
    )
    flags.add_seed(g, default=None, help=f"default {d.seed}")
    flags.add_length_scales(
        g, default=None, input_help=f"default {d.input_scale}", output_help=f"default {d.output_scale}"
    )
    g.add_argument("--max-input-tokens", type=int, default=None)
    g.add_argument("--max-output-tokens", type=int, default=None, help=f"default {d.max_output_tokens}")
    g.add_argument("--max-context-tokens", type=int, default=None, help=f"default {d.max_context_tokens}")


def _add_rates_and_slos(g: argparse._ArgumentGroup, d: HeadlineConfig) -> None:
    g.add_argument("--rates", default=None, help="light=R1,heavy=R2 (req/s); omitted ones are searched")
    g.add_argument("--rate-labels", default=None, help="which rates run: light,heavy (default both)")
    flags.add_slo(
        g,
        ttft_help="default: 3 x unloaded p99-prompt TTFT",
        tpot_help="default: 3 x a full-batch decode step",
    )
    flags.add_calibration(g, default=None, help=f"default {d.calibration}")


def _add_stack(g: argparse._ArgumentGroup, d: HeadlineConfig) -> None:
    g.add_argument(
        "--slow-interval-s", type=float, default=None, help=f"round plans (default {d.slow_interval_s:g})"
    )
    g.add_argument("--round-deadline-s", type=float, default=None, help=f"default {d.round_deadline_s:g}")
    flags.add_round_mode(g, help=f"default {d.rounds}")
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


def _add_output(g: argparse._ArgumentGroup, d: HeadlineConfig) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m collm_bench headline",
        description="The headline benchmark: each coordinator policy on the live stack over the same trace "
        "slice, at a light and a heavy rate found with the simulator; goodput, SLO attainment, latency, "
        "fine-tuning, rounds and served quality in one table, the simulator's prediction beside it.",
        epilog="Defaults fit a 2-core CPU machine in about 15 minutes; --model tiny sets quick-check sizes.",
    )
    d = HeadlineConfig()
    _add_what_runs(p.add_argument_group("what runs"), d)
    _add_slice(p.add_argument_group("the slice"), d)
    _add_rates_and_slos(p.add_argument_group("rates and SLOs"), d)
    _add_stack(p.add_argument_group("the stack"), d)
    _add_output(p.add_argument_group("output"), d)
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
