"""`python -m collm_bench GROUP NAME [args]`: the benchmarks of the engine, the fault stack, the promotion
gate, federated learning, the gateway, the simulator and `collm up`'s adaptation. Each NAME is a module
of this package with its own `main(argv)`; `--help` after NAME lists its flags, GROUP alone lists its
names.

    python -m collm_bench engine batching|multilora|swap|coexec|memory|calibrate|all
    python -m collm_bench engine threads|concurrency|profile|constrained|grammar-libs
    python -m collm_bench faults scenarios|supervise|soak
    python -m collm_bench gate noise
    python -m collm_bench federated rounds|strategies
    python -m collm_bench gateway overhead|overload
    python -m collm_bench sim speed|routing-check
    python -m collm_bench adaptation run|report|step
    python -m collm_bench peer llamacpp

Flags that several of these benchmarks take are defined once here (`add_*`), so that they keep one name
and one meaning; those that the other experiment CLIs take too come from `collm_workload.flags`. Results
go under bench/results/ (`RESULTS`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from collm_workload import flags

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
CALIBRATION = REPO / "bench" / "calibration" / "smollm2.json"  # the committed SmolLM2 calibration
DOMAINS = REPO.parent / "shared" / "data" / "domains"  # the raw domain data (never copied in)
TRACES = REPO.parent / "shared" / "data" / "traces"  # the named traces (`collm_workload.traces`)
HEAVY_LOCK = "/tmp/collm-heavy.lock"  # the machine's heavy-work lock (`flock`), as `make bench` takes it


@dataclass(frozen=True)
class Command:
    """One benchmark: the module whose `main(argv)` runs it, a one-line summary, and whether its parser
    takes the benchmark's name as its first argument (a module that holds several benchmarks)."""

    module: str
    summary: str
    named: bool = False


_SUITE = "collm_bench.engine.suite"
_ADAPTATION = "collm_bench.adaptation_run"
GROUPS: dict[str, dict[str, Command]] = {
    "engine": {
        "batching": Command(_SUITE, "continuous batching against one-at-a-time HF generate", True),
        "multilora": Command(_SUITE, "unmerged multi-LoRA against the base and merge-run-unmerge", True),
        "swap": Command(_SUITE, "inter-token gaps while a new adapter version is swapped in", True),
        "coexec": Command(_SUITE, "SLO attainment and fine-tuning throughput of co-execution", True),
        "memory": Command(_SUITE, "peak RSS with adapters, training and concurrent requests", True),
        "calibrate": Command(_SUITE, "the simulator's calibration (bench/calibration/)", True),
        "all": Command(_SUITE, "batching to calibrate, each in its own process", True),
        "threads": Command("collm_bench.engine.threads", "one replica with 2 threads against 2 with 1 each"),
        "concurrency": Command("collm_bench.engine.concurrency", "paged KV cache at 64 concurrent requests"),
        "profile": Command("collm_bench.engine.step_profile", "where the milliseconds of one step go"),
        "constrained": Command("collm_bench.engine.constrained", "decode speed with constrained requests"),
        "grammar-libs": Command("collm_bench.engine.grammar_libs", "llguidance, xgrammar and outlines-core"),
    },
    "faults": {
        "scenarios": Command("collm_bench.faults.scenarios", "the fault scenarios on one live stack"),
        "supervise": Command("collm_bench.faults.supervise", "a replica of `collm up` SIGKILLed under load"),
        "soak": Command("collm_bench.faults.soak", "the stack at 80% of capacity: errors and memory"),
    },
    "gate": {"noise": Command("collm_bench.gate.noise", "the promotion gate's false publications")},
    "federated": {
        "rounds": Command("collm_bench.federated.rounds", "federated rounds on the real stack"),
        "strategies": Command("collm_bench.federated.strategies", "FedAvg against product-SVD aggregation"),
    },
    "gateway": {
        "overhead": Command("collm_bench.gateway.overhead", "the gateway's added latency over direct NATS"),
        "overload": Command("collm_bench.gateway.overload", "the default stack past its capacity, then back"),
    },
    "sim": {
        "speed": Command("collm_bench.sim.speed", "simulated seconds per wall second at 8, 64, 256 replicas"),
        "routing-check": Command("collm_bench.sim.routing", "collm with and without routing weights"),
    },
    "adaptation": {
        "run": Command(_ADAPTATION, "`collm up`'s stack for a window: its adapters' held-out loss", True),
        "report": Command(_ADAPTATION, "the table and figure of adaptation results again", True),
        "step": Command("collm_bench.adaptation_step", "collm's control live under a step in load"),
    },
    "peer": {"llamacpp": Command("collm_bench.peer.llamacpp", "CoLLM against llama.cpp's llama-server")},
}


def prog(group: str, name: str) -> str:
    """The program name a benchmark's parser shows: `python -m collm_bench GROUP NAME`."""
    return f"python -m collm_bench {group} {name}"


def command_line(argv: Sequence[str] | None = None, *, lock: bool = False) -> str:
    """The command as result files record it: `.venv/bin/python -m collm_bench ARGV` (ARGV defaults to this
    process's arguments), after `flock` on the heavy-work lock when `lock`."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(
        [*(["flock", HEAVY_LOCK] if lock else []), ".venv/bin/python", "-m", "collm_bench", *args]
    )


def usage(group: str) -> str:
    """GROUP's benchmarks, one line each."""
    width = max(len(name) for name in GROUPS[group])
    lines = [f"usage: python -m collm_bench {group} NAME [--help | ARGS]", "", "names:"]
    lines += [f"  {name:<{width}}  {cmd.summary}" for name, cmd in GROUPS[group].items()]
    return "\n".join(lines) + "\n"


def main(group: str, argv: Sequence[str], out: TextIO, err: TextIO) -> int:
    """Run GROUP's benchmark `argv[0]` with the rest of `argv`; its exit status."""
    commands = GROUPS[group]
    if not argv or argv[0] in ("-h", "--help"):
        (out if argv else err).write(usage(group))
        return 0 if argv else 2
    name, rest = argv[0], list(argv[1:])
    command = commands.get(name)
    if command is None:
        err.write(f"collm-bench {group}: no benchmark {name!r}\n" + usage(group))
        return 2
    module = importlib.import_module(command.module)
    return int(module.main([name, *rest] if command.named else rest) or 0)


# --- flags that several benchmarks take ---------------------------------------------------------------------
def add_result_name(p: argparse.ArgumentParser, default: str) -> None:
    """`--name`: the result file's stem under bench/results/engine/."""
    p.add_argument("--name", default=default, help="results go to bench/results/engine/<name>.json")


def add_prompt_tokens(p: argparse.ArgumentParser, default: int) -> None:
    """`--prompt-tokens`: every request's prompt length."""
    p.add_argument("--prompt-tokens", type=int, default=default, help="prompt tokens of each request")


def add_output_tokens(p: argparse.ArgumentParser, default: int) -> None:
    """`--output-tokens`: the tokens every request generates (greedy or sampled, `ignore_eos`)."""
    p.add_argument("--output-tokens", type=int, default=default, help="tokens each request generates")


def add_max_tokens(p: argparse.ArgumentParser, default: int) -> None:
    """`--max-tokens`: the `max_tokens` of every request sent to the stack."""
    p.add_argument("--max-tokens", type=int, default=default, help="max_tokens of each request")


def add_lr(p: argparse.ArgumentParser) -> None:
    """`--lr`: the learning rate of the training the benchmark runs."""
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (AdamW)")


def add_eval_dtype(p: argparse.ArgumentParser) -> None:
    """`--eval-dtype`: the replicas' `COLLM_EVAL_MATMUL_DTYPE`."""
    p.add_argument(
        "--eval-dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="COLLM_EVAL_MATMUL_DTYPE (auto keeps a bf16 copy on AMX CPUs)",
    )


def add_out(p: argparse.ArgumentParser, default: Path) -> None:
    """`--out`: the result file."""
    p.add_argument("--out", type=Path, default=default, help="the result file")


def add_report(p: argparse.ArgumentParser) -> None:
    """`--report`: print the committed result's table instead of measuring."""
    p.add_argument("--report", action="store_true", help="print the table of the committed result")


def add_model(p: argparse.ArgumentParser, default: str) -> None:
    """`--model`: the model the started replicas serve (`COLLM_MODEL`)."""
    p.add_argument("--model", default=default, help="COLLM_MODEL of the replicas: tiny, smollm2 or a path")


def add_seed(p: argparse.ArgumentParser) -> None:
    """`--seed`: the seed of the benchmark's random draws (arrivals, prompts)."""
    flags.add_seed(p, help="seed of the random arrivals and prompts")


def add_run_dir(p: argparse.ArgumentParser, default: str | None) -> None:
    """`--run-dir`: where the started processes keep their state and logs."""
    p.add_argument("--run-dir", default=default, help="state and logs of the started processes")


def add_threads(p: argparse.ArgumentParser, default: int) -> None:
    """`--threads`: torch's intra-op threads of the benchmark's own process."""
    p.add_argument("--threads", type=int, default=default, help="torch threads")


def add_domain_data(p: argparse.ArgumentParser, train_examples: int, eval_examples: int) -> None:
    """`--domains`, `--source`, `--train-examples`, `--eval-examples`: the real domains the participants
    train on, converted from ../shared/data/domains (`collm_data`), and how many examples each keeps."""
    p.add_argument("--domains", default="math,medical,customer_support", help="one domain per participant")
    p.add_argument("--source", default=str(DOMAINS), help="the raw domain data")
    p.add_argument("--train-examples", type=int, default=train_examples, help="training examples per domain")
    p.add_argument("--eval-examples", type=int, default=eval_examples, help="held-out examples per domain")


def add_sim_trace(p: argparse.ArgumentParser) -> None:
    """`--calibration`, `--trace`, `--traces-dir`: the simulator's calibration and the trace it replays."""
    flags.add_calibration(p, default=CALIBRATION)
    flags.add_trace(p, help="the trace replayed: a name (conv, code, ...) or a file")
    flags.add_traces_dir(p, default=TRACES)
