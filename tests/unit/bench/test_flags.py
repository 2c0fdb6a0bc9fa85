"""`collm_workload.flags`: every experiment CLI that takes SLOs spells them `--slo-ttft-ms` /
`--slo-tpot-ms` (none still takes `--ttft-slo-ms`), and each shared flag has one type in every CLI that
takes it."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from collm_bench import cli as bench_cli
from collm_bench.faults import soak
from collm_bench.frontier import cli as frontier_cli
from collm_bench.peer import llamacpp
from collm_coordinator.core.config import ROUND_MODES
from collm_sim import cli as sim_cli
from collm_workload import flags

pytestmark = pytest.mark.unit

# Each CLI that takes SLOs: its parser's public builder and the arguments it needs besides the SLOs.
SLO_CLIS: dict[str, tuple[Callable[[], argparse.ArgumentParser], list[str]]] = {
    "collm_sim": (sim_cli.build_parser, []),
    "collm_bench loadgen": (bench_cli.build_parser, ["loadgen", "--out", "out"]),
    "collm_bench summarize": (bench_cli.build_parser, ["summarize", "requests.jsonl"]),
    "collm_bench frontier": (frontier_cli.build_parser, []),
}
# Every experiment CLI parser whose builder is public, the shared flags' users among them.
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "collm_sim": sim_cli.build_parser,
    "collm_bench": bench_cli.build_parser,
    "collm_bench frontier": frontier_cli.build_parser,
    "collm_bench faults soak": soak.build_parser,
    "collm_bench peer llamacpp": llamacpp.build_parser,
}
# The shared flags' one type each (argparse's `type`; None: the string as given).
TYPES = {
    "--slo-ttft-ms": float,
    "--slo-tpot-ms": float,
    "--seed": int,
    "--trace": None,
    "--traces-dir": Path,
    "--calibration": Path,
    "--input-scale": float,
    "--output-scale": float,
}


def options(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action]]:
    """Every option string of `parser` and of its sub-commands' parsers, with its action."""
    for action in parser._actions:
        yield from ((opt, action) for opt in action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from options(sub)


@pytest.mark.parametrize("cli", list(SLO_CLIS))
def test_every_cli_with_slos_takes_slo_ttft_and_slo_tpot(cli: str) -> None:
    build, rest = SLO_CLIS[cli]
    args = build().parse_args([*rest, "--slo-ttft-ms", "1500", "--slo-tpot-ms", "120"])
    assert (args.slo_ttft_ms, args.slo_tpot_ms) == (1500.0, 120.0)


@pytest.mark.parametrize("cli", list(PARSERS))
def test_no_cli_takes_the_old_spelling(cli: str) -> None:
    names = {opt for opt, _ in options(PARSERS[cli]())}
    assert not names & {"--ttft-slo-ms", "--tpot-slo-ms"}


@pytest.mark.parametrize("cli", list(PARSERS))
def test_each_shared_flag_has_one_type(cli: str) -> None:
    for opt, action in options(PARSERS[cli]()):
        if opt in TYPES:
            assert action.type is TYPES[opt], f"{cli} {opt}"
        if opt == "--rounds":  # the coordinator's round mode (the federated benchmarks' count is not here)
            assert tuple(action.choices or ()) == ROUND_MODES, cli


def test_the_simulator_keeps_its_slo_defaults() -> None:
    args = sim_cli.build_parser().parse_args([])
    assert (args.slo_ttft_ms, args.slo_tpot_ms) == (2000.0, 250.0)


def test_the_flags_fill_a_group_with_the_callers_defaults() -> None:
    p = argparse.ArgumentParser()
    g = p.add_argument_group("workload")
    flags.add_slo(g, ttft_default=1000.0)
    flags.add_seed(g, default=None)
    flags.add_trace(g)
    flags.add_traces_dir(g, default=Path("traces"))
    flags.add_calibration(g, default=None)
    flags.add_length_scales(g, default=0.5)
    flags.add_round_mode(g, default="sync")
    args = p.parse_args(["--traces-dir", "/t", "--rounds", "async"])
    assert vars(args) == {
        "slo_ttft_ms": 1000.0,
        "slo_tpot_ms": None,
        "seed": None,
        "trace": "conv",
        "traces_dir": Path("/t"),
        "calibration": None,
        "input_scale": 0.5,
        "output_scale": 0.5,
        "rounds": "async",
    }
    with pytest.raises(SystemExit):
        p.parse_args(["--rounds", "never"])
