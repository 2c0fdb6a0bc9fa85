"""One replica with two torch threads against two replicas with one thread each, on this machine's two
cores, serving SmolLM2-135M-Instruct (CPU) on the real `Engine`. Writes bench/results/engine/threads.json.

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench engine threads
    ... --concurrency 1 64 --prompt-tokens 200 --output-tokens 128

Layouts, each engine in its own process (`multiprocessing`, spawn), each process loading its own model:

* (a) one process with `--threads` (2) torch threads serving all C streams;
* (b) two processes with one torch thread each, process 0 serving ceil(C/2) streams and process 1
  floor(C/2), at the same time (at C = 1 one process serves the lone stream and the other idles, its
  engine running with nothing to do).

For each C of `--concurrency`, each layout runs once, (a) then (b), the three processes staying up for
the whole run (the idle ones wait on a pipe). A run builds a fresh engine in each process, warms it with
`WARMUP_REQUESTS` requests (prompts of their own), waits until every process of the layout is ready,
then starts them together: each submits all its streams at once, greedy with `ignore_eos`, prompts of
`--prompt-tokens` tokens cut from real text (the same C prompts in both layouts), `--output-tokens`
each. Figures per layout: output tokens/s (every generated token over the wall time from the first
submit to the last finish over all its processes, on the system-wide monotonic clock), TTFT p50 / p99
and TPOT p50 (each request's mean gap) over all requests, and per process its streams, wall time and
tokens/s; then (b) / (a).

A process serving more streams than the default `max_batch` runs with `max_batch` (and `max_queue`, if
needed) raised to its streams, recorded per run in `changed_from_defaults`. Where C is over the default,
the same C runs again at the default `max_batch`, what a replica runs unless configured
(`--no-default-batch` skips it). The engine's other settings are its defaults; nothing trains.
`COLLM_MATMUL_DTYPE` picks the products' precision as in the other engine benchmarks.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from collm_bench.engine.common import (
    greedy,
    load_smollm2,
    matmul_dtype,
    save_result,
    submit,
    token_prompts,
    wait_all,
)
from collm_bench.groups import add_output_tokens, add_prompt_tokens, add_result_name, prog
from collm_bench.readme.engine import threads_table
from collm_common.stats import percentile, ratio
from collm_replica.engine import Engine, EngineConfig
from collm_replica.engine.cosched import NoTraining
from collm_replica.engine.scheduler import BatchConfig

PROMPT_SEED = 21
WARMUP_REQUESTS = 4
WARMUP_TOKENS = 4


def worker(conn: Connection, threads: int, n_prompts: int, prompt_tokens: int) -> None:
    """One engine process: loads the model with `threads` torch threads, then runs what the pipe asks."""
    t0 = time.perf_counter()
    loaded = load_smollm2(threads)
    prompts = token_prompts(loaded, n_prompts + WARMUP_REQUESTS, prompt_tokens, seed=PROMPT_SEED)
    conn.send({"model": loaded.name, "load_s": round(time.perf_counter() - t0, 1)})
    while (msg := conn.recv()) is not None:
        streams, offset, cfg = msg["streams"], msg["offset"], msg["config"]
        eng = Engine(loaded, cfg, NoTraining())
        with eng:
            warm = [greedy(f"w{i}", prompts[n_prompts + i], WARMUP_TOKENS) for i in range(WARMUP_REQUESTS)]
            wait_all([submit(eng, r) for r in warm])
            it0, pre0 = eng.iteration, eng.preemptions_total
            conn.send("ready")
            conn.recv()  # go
            start = time.monotonic()
            reqs = [greedy(f"s{i}", prompts[offset + i], msg["output_tokens"]) for i in range(streams)]
            traces = [submit(eng, r) for r in reqs]
            wait_all(traces)
            end = time.monotonic()
            iterations, preemptions = eng.iteration - it0, eng.preemptions_total - pre0
        conn.send(
            {
                "streams": streams,
                "start": start,
                "end": end,
                "tokens": sum(len(t.token_ids) for t in traces),
                "errors": sum(t.error is not None for t in traces),
                "ttft_s": [t.ttft_s for t in traces if t.ttft_s is not None],
                "tpot_s": [t.tpot_s for t in traces if t.tpot_s is not None],
                "iterations": iterations,
                "preemptions": preemptions,
            }
        )
        del eng, traces
        gc.collect()


def engine_config(streams: int, raise_batch: bool) -> tuple[EngineConfig, dict[str, int]]:
    """The engine's configuration for a process serving `streams` at once, and what differs from the
    defaults."""
    default = EngineConfig()
    mb = max(default.batch.max_batch, streams) if raise_batch else default.batch.max_batch
    cfg = replace(
        default, batch=replace(default.batch, max_batch=mb), max_queue=max(default.max_queue, streams)
    )
    changed = {"max_batch": mb} if mb != default.batch.max_batch else {}
    if cfg.max_queue != default.max_queue:
        changed["max_queue"] = cfg.max_queue
    return cfg, changed


def run_layout(
    conns: list[Connection], concurrency: int, raise_batch: bool, output_tokens: int
) -> dict[str, Any]:
    """C streams over the processes of one layout (split ceil / floor), started together."""
    n = len(conns)
    shares = [concurrency // n + (1 if i < concurrency % n else 0) for i in range(n)]
    offsets = [sum(shares[:i]) for i in range(n)]
    changed = []
    for conn, streams, offset in zip(conns, shares, offsets, strict=True):
        cfg, diff = engine_config(streams, raise_batch)
        changed.append(diff)
        conn.send({"streams": streams, "offset": offset, "config": cfg, "output_tokens": output_tokens})
    for conn in conns:
        if conn.recv() != "ready":
            raise RuntimeError("a worker did not get ready")
    for conn in conns:
        conn.send("go")
    procs = [conn.recv() for conn in conns]
    busy = [p for p in procs if p["streams"]]
    wall = max(p["end"] for p in busy) - min(p["start"] for p in busy)
    tokens = sum(p["tokens"] for p in procs)
    ttft = [x for p in procs for x in p["ttft_s"]]
    tpot = [x for p in procs for x in p["tpot_s"]]
    return {
        "processes": n,
        "streams": shares,
        "max_batch": [d.get("max_batch", BatchConfig().max_batch) for d in changed],
        "changed_from_defaults": changed,
        "output_tokens": tokens,
        "errors": sum(p["errors"] for p in procs),
        "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 2),
        "ttft_ms_p50": round(1e3 * percentile(ttft, 50), 1),
        "ttft_ms_p99": round(1e3 * percentile(ttft, 99), 1),
        "tpot_ms_p50": round(1e3 * percentile(tpot, 50), 2),
        "per_process": [
            {
                "streams": p["streams"],
                "wall_s": round(p["end"] - p["start"], 3),
                "output_tok_s": round(p["tokens"] / (p["end"] - p["start"]), 2) if p["streams"] else 0.0,
                "iterations": p["iterations"],
                "preemptions": p["preemptions"],
            }
            for p in procs
        ],
    }


def b_over_a(b: float, a: float) -> float | None:
    """b / a (`collm_common.stats.ratio`) to 3 places; None when it has no finite value."""
    r = ratio(b, a)
    return round(r, 3) if r is not None and math.isfinite(r) else None


def build_parser() -> argparse.ArgumentParser:
    """The flags of `engine threads`."""
    ap = argparse.ArgumentParser(
        prog=prog("engine", "threads"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64], help="streams at once (C)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of layout (a)'s one process")
    add_prompt_tokens(ap, 200)
    add_output_tokens(ap, 128)
    ap.add_argument("--no-default-batch", action="store_true", help="skip the runs at the default max_batch")
    add_result_name(ap, "threads")
    return ap


def start_workers(
    layouts: dict[str, list[int]], n_prompts: int, prompt_tokens: int
) -> tuple[dict[str, list[Connection]], list[BaseProcess]]:
    """One spawned `worker` per entry of each layout (its torch threads): each layout's pipes, and the
    processes."""
    ctx = mp.get_context("spawn")
    conns: dict[str, list[Connection]] = {}
    procs = []
    for key, threads in layouts.items():
        conns[key] = []
        for t in threads:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker, args=(child, t, n_prompts, prompt_tokens), daemon=True)
            p.start()
            child.close()  # a worker that dies ends its pipe: the parent's recv raises instead of waiting
            procs.append(p)
            conns[key].append(parent)
    return conns, procs


def stop_workers(conns: dict[str, list[Connection]], procs: list[BaseProcess]) -> None:
    """Ask every worker to exit (a dead one's pipe is skipped) and wait up to 60 s for each."""
    for conn in [c for cs in conns.values() for c in cs]:
        try:
            conn.send(None)
        except OSError:
            pass
    for p in procs:
        p.join(60)


def run_cases(
    args: argparse.Namespace, layouts: dict[str, list[int]], conns: dict[str, list[Connection]]
) -> list[dict[str, Any]]:
    """Each layout at each `--concurrency` (again at the default `max_batch` where C is over it, unless
    `--no-default-batch`), printed as it runs, with the ratios (b) / (a)."""
    default_mb = BatchConfig().max_batch
    cases = []
    for c in args.concurrency:
        for raise_batch in (True, False):
            if not raise_batch and (args.no_default_batch or c <= default_mb):
                continue
            case: dict[str, Any] = {"concurrency": c, "default_max_batch": not raise_batch}
            for key in layouts:
                case[key] = run_layout(conns[key], c, raise_batch, args.output_tokens)
                r = case[key]
                print(
                    f"C={c} max_batch {r['max_batch']} ({key}) {layouts[key]} threads: "
                    f"{r['output_tok_s']:.1f} tok/s, TTFT p50 {r['ttft_ms_p50']:.0f} ms, "
                    f"TPOT p50 {r['tpot_ms_p50']:.1f} ms",
                    flush=True,
                )
            keys = ("output_tok_s", "ttft_ms_p50", "tpot_ms_p50")
            case["ratio_b_over_a"] = {k: b_over_a(case["b"][k], case["a"][k]) for k in keys}
            cases.append(case)
    return cases


def main(argv: Sequence[str]) -> int:
    """Run both layouts at each concurrency, write the result and print its table."""
    args = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    layouts = {"a": [args.threads], "b": [1, 1]}
    conns, procs = start_workers(layouts, max(args.concurrency), args.prompt_tokens)
    loads = {key: [c.recv() for c in cs] for key, cs in conns.items()}
    model = loads["a"][0]["model"]
    print(f"loaded {model} in {len(procs)} processes", flush=True)
    try:
        cases = run_cases(args, layouts, conns)
    finally:
        stop_workers(conns, procs)
    doc = {
        "model": model,
        "config": {
            "concurrency": args.concurrency,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "matmul_dtype": matmul_dtype(),
            "engine_batch_defaults": asdict(BatchConfig()),
            "warmup_requests": WARMUP_REQUESTS,
        },
        "layouts": {
            key: {"torch_threads": threads, "load_s": [x["load_s"] for x in loads[key]]}
            for key, threads in layouts.items()
        },
        "cases": cases,
        "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    path = save_result(args.name, doc)
    print(threads_table(json.loads(path.read_text())))
    return 0
