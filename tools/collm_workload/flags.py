"""The flags that several experiment CLIs take, one definition each: one spelling, one type.

`python -m collm_sim`, `python -m collm_bench loadgen|summarize|traces`, `frontier` and the
`collm_bench.groups` benchmarks add these flags with the functions here, each adding one flag, or one
tightly related pair, to a parser or an argument group. The spelling, the type and the attribute name
(`dest`) are fixed here; a caller chooses the default and the help where its meaning differs (a CLI
whose config fills the defaults later passes `default=None` and a help naming the config's default).

    add_slo             --slo-ttft-ms, --slo-tpot-ms   float (ms)
    add_seed            --seed                         int
    add_trace           --trace                        str: a named trace or a file
    add_traces_dir      --traces-dir                   Path
    add_calibration     --calibration                  Path
    add_length_scales   --input-scale, --output-scale  float
    add_round_mode      --rounds                       async | sync (the coordinator's round mode)
"""

from __future__ import annotations

import argparse
from pathlib import Path

# A parser or one of its argument groups: where a flag is added.
Flags = argparse.ArgumentParser | argparse._ArgumentGroup  # argparse names no public type for a group


def add_slo(
    p: Flags,
    *,
    ttft_default: float | None = None,
    tpot_default: float | None = None,
    ttft_help: str | None = "TTFT SLO (ms)",
    tpot_help: str | None = "TPOT SLO (ms)",
) -> None:
    """`--slo-ttft-ms`, `--slo-tpot-ms` (`args.slo_ttft_ms`, `args.slo_tpot_ms`): the SLOs requests are
    scored against, in milliseconds; None where the caller has no default (no SLO, or its config's)."""
    p.add_argument("--slo-ttft-ms", type=float, default=ttft_default, help=ttft_help)
    p.add_argument("--slo-tpot-ms", type=float, default=tpot_default, help=tpot_help)


def add_seed(p: Flags, *, default: int | None = 0, help: str | None = "seed of the random draws") -> None:
    """`--seed` (`args.seed`): the seed of the run's random draws (arrivals, domains, prompts)."""
    p.add_argument("--seed", type=int, default=default, help=help)


def add_trace(
    p: Flags, *, default: str | None = "conv", help: str | None = "a named trace or a file"
) -> None:
    """`--trace` (`args.trace`): the trace replayed, a name of `collm_workload.traces.NAMED_TRACES`
    (a file in `--traces-dir`) or a path."""
    p.add_argument("--trace", default=default, help=help)


def add_traces_dir(
    p: Flags, *, default: Path | None, help: str | None = "where the named traces live"
) -> None:
    """`--traces-dir` (`args.traces_dir`, a Path): the directory of the named traces."""
    p.add_argument("--traces-dir", type=Path, default=default, help=help)


def add_calibration(
    p: Flags, *, default: Path | None, help: str | None = "the simulator's calibration"
) -> None:
    """`--calibration` (`args.calibration`, a Path): the calibration file the simulator runs on
    (`collm_common.calibration`, bench/calibration/<model>.json)."""
    p.add_argument("--calibration", type=Path, default=default, help=help)


def add_length_scales(
    p: Flags,
    *,
    default: float | None = 1.0,
    input_help: str | None = "scale of prompt lengths",
    output_help: str | None = "scale of output lengths",
) -> None:
    """`--input-scale`, `--output-scale` (`args.input_scale`, `args.output_scale`): the factors a trace's
    prompt and output lengths are multiplied by (`collm_workload.traces.LengthPolicy`)."""
    p.add_argument("--input-scale", type=float, default=default, help=input_help)
    p.add_argument("--output-scale", type=float, default=default, help=output_help)


def add_round_mode(
    p: Flags, *, default: str | None = None, help: str | None = "the coordinator's round mode"
) -> None:
    """`--rounds` (`args.rounds`): the coordinator's round mode, async or sync (`CoreConfig.rounds`)."""
    # Imported here: only the CLIs that take the flag load the coordinator core.
    from collm_coordinator.core.config import ROUND_MODES

    p.add_argument("--rounds", choices=ROUND_MODES, default=default, help=help)
