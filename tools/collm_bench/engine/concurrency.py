"""Engine throughput at 64 concurrent requests with the Azure conversation trace's lengths, and how many
requests run at once under one KV budget.

Workload: the first 64 requests of `azure_llm_2023_conv.csv` (`../shared/data/traces`), their prompt and
output lengths fitted as the experiments fit them (x0.25 each, output <= 256, context <= 2048); prompts are
cut from real text; requests are greedy with `ignore_eos` and all 64 are submitted at once. Every
request asks for `max_tokens` = 1024 (a client's cap, as chat clients send) and ends after its trace
output length: the harness cancels it there, as the model's end-of-sequence token would end it, so the
KV cache a request holds is what it really uses while reserve admission holds prompt + 1024.

Variants, each in its own process, one after the other in one invocation:

* `paged`: this tree's engine, paged KV cache (admission by blocks needed now, recompute preemption);
* `reserve`: this tree's engine with `kv_admission="reserve"` (prompt + max_tokens held from admission);
* `before`: the engine at `--before` (a git commit, checked out into a temporary worktree), which
  reserves at admission and attends one sequence at a time;
* `generate`: the first `--generate-requests` requests served one at a time with Hugging Face
  `generate` (plain, no batching), for output tokens/s.

All engine variants use one batch configuration (`max_batch` 64, 256 tokens per iteration, 128-token
prefill chunks, a KV budget of `--kv-budget` tokens). With `--repeat N` the engine variants run N
rounds, interleaved (paged, reserve, before, paged, ...), and each variant's figures are the medians of
its rounds, so a machine that slows down for a minute weighs on every variant alike. Writes
`bench/results/engine/concurrency_kv<budget>.json`; `--table` prints its table again from that file.

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench engine concurrency --before f6ec4a0 --repeat 2
    .venv/bin/python -m collm_bench engine concurrency --kv-budget 32768 --table

Each variant runs in a child process, `python -m collm_bench.engine.concurrency --variant NAME`; the
`before` child has the earlier tree's services and libraries ahead on `PYTHONPATH` (this package still
comes from this tree: `collm_bench.engine.common` imports nothing the earlier engine lacks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from collm_bench.groups import REPO, RESULTS, command_line, prog
from collm_bench.readme.engine import concurrency_table

TRACE = REPO.parent / "shared" / "data" / "traces" / "azure_llm_2023_conv.csv"
# The earlier tree's packages that the `before` child imports instead of this tree's (the benchmark's
# own package, collm_bench under tools/, stays this tree's).
SOURCE_DIRS = (
    "libs",
    "services/gateway",
    "services/replica",
    "services/coordinator",
    "services/aggregator",
)
CLIENT_MAX_TOKENS = 1024


def workload(n: int, max_context: int = 2048) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of the trace's first `n` requests, fitted as the experiments do
    (`max_context` lower only for a model with a shorter context, the tiny one)."""
    from collm_workload.traces import LengthPolicy, fit_lengths, load_trace

    policy = LengthPolicy(
        input_scale=0.25, output_scale=0.25, max_output_tokens=256, max_context_tokens=min(2048, max_context)
    )
    reqs = fit_lengths(load_trace(TRACE)[:n], policy)
    return [(r.input_tokens, r.output_tokens) for r in reqs]


def run_engine(variant: str, n: int, kv_budget: int) -> dict[str, Any]:
    """One engine variant in this process (the tree on `PYTHONPATH` decides which engine it is)."""
    from collm_bench.engine.common import load_smollm2, token_prompts
    from collm_replica.engine import Engine, EngineConfig, EngineRequest
    from collm_replica.engine.cosched import NoTraining

    try:
        from collm_replica.engine.scheduler import BatchConfig
    except ImportError:  # an engine from before the engine package (`--before`)
        from collm_replica.batching import BatchConfig  # type: ignore[no-redef]

    loaded = load_smollm2()
    kw: dict[str, Any] = {}
    if variant in ("paged", "reserve"):
        kw["kv_admission"] = variant
    batch = BatchConfig(
        max_batch=64, max_batch_tokens=256, prefill_chunk_tokens=128, kv_budget_tokens=kv_budget, **kw
    )
    eng = Engine(loaded, EngineConfig(batch=batch, max_queue=n + 1), NoTraining())
    lengths = workload(n, eng.max_model_len // 2)
    prompts = [token_prompts(loaded, 1, p, seed=i)[0] for i, (p, _) in enumerate(lengths)]
    got = [0] * n
    done = [threading.Event() for _ in range(n)]

    def sink_for(i: int, want: int) -> Any:
        def sink(ev: Any) -> None:
            if ev.kind == "token":
                got[i] += len(ev.token_ids)
                if got[i] == want:
                    eng.cancel(f"q{i}")  # the request's own end (see the module doc)
            elif ev.kind in ("finished", "error"):
                done[i].set()

        return sink

    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(len(eng.running))
            time.sleep(0.005)

    with eng:
        t0 = time.perf_counter()
        for i, (ids, (_, out)) in enumerate(zip(prompts, lengths, strict=True)):
            cap = min(CLIENT_MAX_TOKENS, eng.max_model_len - len(ids))  # the tiny model's context is short
            req = EngineRequest(f"q{i}", ids, max_tokens=cap, temperature=0.0, ignore_eos=True)
            eng.submit(req, sink_for(i, out))
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for d in done:
            if not d.wait(3600):
                raise TimeoutError("a request did not finish")
        wall = time.perf_counter() - t0
        stop.set()
    out_tokens = sum(min(g, o) for g, (_, o) in zip(got, lengths, strict=True))
    busy = [s for s in samples if s > 0] or [0]
    return {
        "variant": variant,
        "requests": n,
        "wall_s": round(wall, 2),
        "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / wall, 2),
        "running_mean": round(sum(busy) / len(busy), 2),
        "running_peak": max(busy),
        "preemptions": getattr(eng, "preemptions_total", 0),
    }


def run_generate(n: int) -> dict[str, Any]:
    """The first `n` requests one at a time with Hugging Face `generate` (greedy, exact output length)."""
    import torch

    from collm_bench.engine.common import load_smollm2, token_prompts

    loaded = load_smollm2()
    lengths = workload(n)
    total_s, tokens = 0.0, 0
    for i, (p, out) in enumerate(lengths):
        ids = torch.tensor([token_prompts(loaded, 1, p, seed=i)[0]])
        t0 = time.perf_counter()
        with torch.no_grad():
            loaded.model.generate(
                ids,
                max_new_tokens=out,
                min_new_tokens=out,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        total_s += time.perf_counter() - t0
        tokens += out
    return {
        "variant": "generate",
        "requests": n,
        "wall_s": round(total_s, 2),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / total_s, 2),
    }


def child(args: list[str], pythonpath: str | None = None) -> dict[str, Any]:
    """Run one variant in a child process (`pythonpath` ahead of this tree's packages); its result."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "collm_bench.engine.concurrency", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"variant {args[-1]} failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def result_path(kv_budget: int) -> Path:
    """The result file of a KV budget."""
    return RESULTS / "engine" / f"concurrency_kv{kv_budget}.json"


def median(xs: list[float]) -> float:
    """The median of `xs` (the mean of the middle two when their number is even)."""
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's figures over its rounds: medians, and every round's output tok/s."""
    out = dict(rounds[0])
    for k in ("wall_s", "output_tok_s", "running_mean", "running_peak", "preemptions"):
        if k in out:
            out[k] = round(median([r[k] for r in rounds]), 2)
    out["rounds_output_tok_s"] = [r["output_tok_s"] for r in rounds]
    return out


def main(argv: Sequence[str]) -> int:
    """Run every variant (or one, `--variant`, in a child), write the result and print its table."""
    ap = argparse.ArgumentParser(
        prog=prog("engine", "concurrency"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--before", default="f6ec4a0", help="git commit of the engine to compare with")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--generate-requests", type=int, default=8)
    ap.add_argument("--kv-budget", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=1, help="interleaved rounds of the engine variants")
    ap.add_argument("--table", action="store_true", help="print the table of the committed result")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # one variant in this process (internal)
    a = ap.parse_args(argv)
    if a.table:
        print(concurrency_table(json.loads(result_path(a.kv_budget).read_text())))
        return 0
    if a.variant:
        res = (
            run_generate(a.generate_requests)
            if a.variant == "generate"
            else run_engine(a.variant, a.requests, a.kv_budget)
        )
        print(json.dumps(res), flush=True)
        os._exit(0)  # the result is out; torch's worker threads need no orderly teardown
    common = ["--requests", str(a.requests), "--kv-budget", str(a.kv_budget)]
    rounds: dict[str, list[dict[str, Any]]] = {"paged": [], "reserve": [], "before": []}
    with tempfile.TemporaryDirectory(prefix="collm-before-") as tmp:
        wt = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(wt), a.before], check=True)
        try:
            before_path = os.pathsep.join(str(wt / d) for d in SOURCE_DIRS)
            for _ in range(a.repeat):
                for v in rounds:
                    path = before_path if v == "before" else None
                    rounds[v].append(child([*common, "--variant", v], pythonpath=path))
                    print(rounds[v][-1], flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(wt)], check=False)
    runs = [summarize(rs) for rs in rounds.values()]
    runs.append(child(["--generate-requests", str(a.generate_requests), "--variant", "generate"]))
    print(runs[-1], flush=True)
    by = {r["variant"]: r for r in runs}
    res = {
        "benchmark": "engine concurrency",
        "command": command_line(lock=True),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "before": a.before,
        "config": {
            "model": os.environ.get("COLLM_BENCH_MODEL", "smollm2"),
            "max_batch": 64,
            "max_batch_tokens": 256,
            "prefill_chunk_tokens": 128,
            "kv_budget_tokens": a.kv_budget,
            "client_max_tokens": CLIENT_MAX_TOKENS,
            "trace": "azure_llm_2023_conv (first requests; lengths x0.25, output <= 256, context <= 2048)",
            "torch_threads": 1,
            "repeat": a.repeat,
        },
        "runs": runs,
        "ratios": {
            "paged_over_before": round(by["paged"]["output_tok_s"] / by["before"]["output_tok_s"], 2),
            "paged_over_generate": round(by["paged"]["output_tok_s"] / by["generate"]["output_tok_s"], 2),
            "running_paged_over_reserve": round(
                by["paged"]["running_mean"] / by["reserve"]["running_mean"], 2
            ),
        },
    }
    path = result_path(a.kv_budget)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(concurrency_table(res))
    return 0


if __name__ == "__main__":  # a variant's child process (`child`)
    sys.exit(main(sys.argv[1:]))
