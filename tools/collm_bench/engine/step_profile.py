"""Where the milliseconds of one engine step go, on SmolLM2-135M-Instruct (CPU, `--threads` torch
threads, default one): steady-state decode steps at batch 1, 16 and 64 and one prefill chunk at batch 1,
each split into torch ops by kind and the Python around them. Writes bench/results/engine/profile.json.

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench engine profile
    ... --batches 1 16 64 --steps 30 --profile-steps 5 --prompt-tokens 128 --prefill-tokens 200 --adapters 1

The real `Engine` runs every step. The benchmark calls the engine's iteration (`Engine._iteration`, what
the engine thread loops on) from its own thread, one call per step and no engine thread, so a step is
exactly one schedule -> forward -> sample -> detokenise -> stream iteration and the profiler sees it.
A decode case submits `batch` requests with `--prompt-tokens` prompts, steps until every one of them
decodes, then measures; the prefill case submits one request of `--prefill-tokens` prompt tokens per
step and measures the step that prefills it in one chunk (and samples its first token). Each case is
measured twice:

* plain: `--steps` steps with nothing attached, timed with `perf_counter` (ms per step, tokens/s) and
  split with the engine's own counters (`forward_ms_total`, `infer_ms_total`) into the forward, the rest
  of the step's execution (building the batch, sampling, detokenising, streaming) and what the iteration
  does around it (queues, planning, admission, the background decision);
* profiled: `--profile-steps` steps under `torch.profiler`, with `record_function` ranges that this benchmark
  puts around the engine's own methods for the duration (the planner, the background decision, the
  forward, each decoder layer, each projection, the LoRA bank, the paged attention, sampling, token
  emission; the services' code is not changed). Each torch op called from Python (an op not inside
  another op) is charged to a category by the ranges around it and its name; a range's time outside
  ops is Python (with whatever else happens between ops: freeing tensors, the OS running another
  thread). The categories sum to the profiled step. The first step under the profiler is not counted.
  The profiler and the ranges slow the step (both step times are reported, and what one range costs,
  `range_cost_us`): read the profiled figures as shares.

The benchmark raises the engine's `max_batch` to the largest batch measured where the default is smaller,
and its 128-token prefill chunk (and the step's token budget) to the prefill case's prompt,
and the result says so (`config.changed_from_defaults`). `--adapters N` spreads the requests over N
random LoRA adapters (0: the base model alone, no LoRA category).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from typing import Any

import torch
from torch.profiler import ProfilerActivity, record_function
from torch.profiler import profile as torch_profile

import collm_replica.engine.batcher as batcher_mod
import collm_replica.engine.executor as executor_mod
from collm_bench.engine.common import (
    greedy,
    load_smollm2,
    matmul_dtype,
    random_adapter,
    save_result,
    submit,
    token_prompts,
)
from collm_bench.groups import add_prompt_tokens, add_result_name, add_threads, prog
from collm_bench.readme.engine import profile_table
from collm_common.stats import percentiles
from collm_replica.engine import Engine, EngineConfig
from collm_replica.engine.cosched import NoTraining
from collm_replica.engine.scheduler import BatchConfig

PREFIX = "collm:"

# The categories of a step, in the table's order: (key, label, python?).
CATEGORIES: list[tuple[str, str, bool]] = [
    ("linear", "base projections (q, k, v, o, gate, up, down)", False),
    ("lora", "LoRA (grouped A and B products)", False),
    ("attention", "attention in the layers: KV write, gather, SDPA", False),
    ("attn_setup", "attention's KV slot tables and masks (once per step)", False),
    ("pointwise", "RMSNorm, SiLU, rotary, residual adds", False),
    ("lm_head", "LM head (logits)", False),
    ("forward_other", "embedding, rotary tables, final norm, LoRA mask", False),
    ("sampling", "sampling (penalties, argmax) on the logits", False),
    ("other_ops", "other torch ops", False),
    ("py_forward", "Python in the forward (layer glue, attention index setup)", True),
    ("py_sampling", "Python in sampling", True),
    ("py_emit", "Python: detokenise, stop strings, stream events", True),
    ("py_scheduler", "Python: scheduler (batch plan, background decision)", True),
    ("py_engine", "Python: engine loop (queues, admission, batch build, counters)", True),
]

LINEAR_OPS = frozenset({"aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm"})

# The Python time of a range goes to the category of its label.
PYTHON_OF = {
    "step": "py_engine",
    "execute": "py_engine",
    "plan": "py_scheduler",
    "background": "py_scheduler",
    "forward": "py_forward",
    "layer": "py_forward",
    "proj": "py_forward",
    "linear": "py_forward",
    "lora": "py_forward",
    "attn_setup": "py_forward",
    "attention": "py_forward",
    "sample": "py_sampling",
    "emit": "py_emit",
}


def op_category(stack: tuple[str, ...], name: str) -> str:
    """The category of a torch op called from Python inside the ranges `stack` (outermost first)."""
    inner = stack[-1] if stack else ""
    if "lora" in stack:
        return "lora"
    if "attn_setup" in stack:
        return "attn_setup"
    if "attention" in stack:
        return "attention"
    if "emit" in stack:
        return "other_ops"
    if "sample" in stack:
        return "sampling"
    if "layer" in stack:
        return "linear" if inner in ("proj", "linear") else "pointwise"
    if "forward" in stack:
        return "lm_head" if inner == "linear" or name in LINEAR_OPS else "forward_other"
    return "other_ops"


def attribute(step: Any) -> tuple[dict[str, float], Counter[str], Counter[str], dict[str, float]]:
    """One profiled step (its `collm:step` event): ms and op calls by category; counts of the ops inside
    decoder layers (`layer_ops`), of the layers (`layers`) and of the ranges (`ranges`); ms by op name
    (ops called from Python only)."""
    ms: dict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    by_name: dict[str, float] = defaultdict(float)

    def visit(ev: Any, stack: tuple[str, ...]) -> None:
        label = ev.name.removeprefix(PREFIX)
        stack = (*stack, label)
        inside = 0.0
        for ch in ev.cpu_children:
            us = ch.time_range.elapsed_us()
            inside += us
            if ch.name.startswith(PREFIX):
                visit(ch, stack)
                continue
            cat = op_category(stack, ch.name)
            ms[cat] += us / 1e3
            calls[cat] += 1
            by_name[ch.name] += us / 1e3
            if "layer" in stack:
                counts["layer_ops"] += 1
        ms[PYTHON_OF.get(label, "py_engine")] += (ev.time_range.elapsed_us() - inside) / 1e3
        counts["ranges"] += 1
        if label == "layer":
            counts["layers"] += 1

    visit(step, ())
    return ms, calls, counts, by_name


def _ranged(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` called inside a `collm:<label>` range."""
    name = PREFIX + label

    def ranged(*args: Any, **kw: Any) -> Any:
        with record_function(name):
            return fn(*args, **kw)

    return ranged


def range_cost_us(n: int = 5000) -> float:
    """What one of this benchmark's ranges adds to a profiled step, in µs (it lands in the Python
    categories): an empty function called through `_ranged` against the same called directly, under the
    profiler."""

    def noop() -> None:
        return None

    ranged = _ranged("probe", noop)
    with torch_profile(activities=[ProfilerActivity.CPU]):
        t0 = time.perf_counter()
        for _ in range(n):
            noop()
        t1 = time.perf_counter()
        for _ in range(n):
            ranged()
        t2 = time.perf_counter()
    return max(0.0, ((t2 - t1) - (t1 - t0)) / n * 1e6)


@contextmanager
def ranges(eng: Engine) -> Iterator[None]:
    """`record_function` ranges around the engine's own methods while profiling: instance attributes of
    the engine core, its executor and its LoRA bank, and the planner and paged attention names of their
    modules, all put back on exit."""

    core, ex, bank = eng.core, eng.executor, eng.bank
    methods: list[tuple[Any, str, str]] = [
        (core, "_execute", "execute"),
        (core, "_decide_background", "background"),
        (core, "_sample", "sample"),
        (core, "_on_token", "emit"),
        (ex, "forward", "forward"),
        (ex, "_layer", "layer"),
        (ex, "_proj", "proj"),
        (ex, "_fast_linear", "linear"),
        (bank, "apply", "lora"),
        (bank, "apply_grouped", "lora"),
    ]
    base_attention = executor_mod.PagedAttention

    class Attention(base_attention):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any) -> None:
            with record_function(PREFIX + "attn_setup"):
                super().__init__(*args)

        def __call__(self, *args: Any) -> torch.Tensor:
            with record_function(PREFIX + "attention"):
                return super().__call__(*args)

    plan = batcher_mod.plan_iteration
    for obj, attr, label in methods:
        setattr(obj, attr, _ranged(label, getattr(obj, attr)))
    batcher_mod.plan_iteration = _ranged("plan", plan)
    executor_mod.PagedAttention = Attention
    try:
        yield
    finally:
        for obj, attr, _ in methods:
            vars(obj).pop(attr)
        batcher_mod.plan_iteration = plan
        executor_mod.PagedAttention = base_attention


def plain_step(eng: Engine) -> tuple[float, float, float]:
    """One iteration: (its wall ms, the forward's ms, the step execution's ms) from the engine's counters."""
    f0, i0 = eng.forward_ms_total, eng.infer_ms_total
    t0 = time.perf_counter()
    eng._iteration()
    wall = (time.perf_counter() - t0) * 1e3
    return wall, eng.forward_ms_total - f0, eng.infer_ms_total - i0


def profiled_steps(eng: Engine, n: int, before: Callable[[], None], after: Callable[[], None]) -> list[Any]:
    """`n` iterations under the profiler, each inside a `collm:step` range (`before` and `after` run
    outside it), after one more that is not counted (the profiler's first step pays its start); returns
    the counted steps' events."""
    with ranges(eng), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n + 1):
            before()
            with record_function(PREFIX + "step"):
                eng._iteration()
            after()
    return [ev for ev in prof.events() if ev.name == PREFIX + "step"][1:]


def summarise(
    case: dict[str, Any], plain: list[tuple[float, float, float]], steps: list[Any]
) -> dict[str, Any]:
    """A case's figures: plain medians, profiled means by category, op calls, the heaviest ops."""
    walls = [w for w, _, _ in plain]
    ms_step = statistics.median(walls)
    tokens = case["tokens_per_step"]
    cats: dict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    names: dict[str, float] = defaultdict(float)
    for ev in steps:
        m, c, cnt, by = attribute(ev)
        for k, v in m.items():
            cats[k] += v / len(steps)
        calls.update(c)
        counts.update(cnt)
        for k, v in by.items():
            names[k] += v / len(steps)
    n = len(steps)
    top = sorted(names.items(), key=lambda kv: -kv[1])[:8]
    return {
        **case,
        "steps": len(plain),
        "ms_per_step": round(ms_step, 3),
        "ms_per_step_p10_p90": [round(q, 3) for q in percentiles(walls, (10, 90)) if q is not None],
        "tokens_per_s": round(tokens / (ms_step / 1e3), 2),
        "phases_ms": {
            "forward": round(statistics.median(f for _, f, _ in plain), 3),
            "rest_of_step": round(statistics.median(e - f for _, f, e in plain), 3),
            "around_step": round(statistics.median(w - e for w, _, e in plain), 3),
        },
        "profiled": {
            "steps": n,
            "ms_per_step": round(sum(ev.time_range.elapsed_us() for ev in steps) / n / 1e3, 3),
            "ms": {k: round(cats.get(k, 0.0), 3) for k, _, _ in CATEGORIES},
            "op_calls": {
                k: round(calls.get(k, 0) / n, 1) for k, _, _ in CATEGORIES if not k.startswith("py_")
            },
            "op_calls_per_step": round(sum(calls.values()) / n, 1),
            "op_calls_per_layer": round(counts["layer_ops"] / max(1, counts["layers"]), 1),
            "ranges_per_step": round(counts["ranges"] / n, 1),
            "top_ops_ms": {k: round(v, 3) for k, v in top},
        },
    }


def decode_case(
    eng: Engine, prompts: list[list[int]], batch: int, adapters: list[str | None], args: argparse.Namespace
) -> dict[str, Any]:
    """`batch` requests decoding together: measured once every one of them is past its prompt."""
    budget = eng.cfg.batch.max_batch_tokens
    fill = math.ceil(batch * args.prompt_tokens / max(1, budget - batch)) + 2
    max_tokens = fill + args.warmup + args.steps + args.profile_steps + 4
    ids = [f"d{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        submit(eng, greedy(rid, prompts[i % len(prompts)], max_tokens, adapter=adapters[i % len(adapters)]))

    def decoding() -> bool:
        return (
            len(eng.running) == batch
            and not eng.waiting
            and all(s.prompt_len + len(s.output) - s.computed == 1 for s in eng.running)
        )

    for _ in range(fill):
        if decoding():
            break
        eng._iteration()
    contexts: list[float] = []

    def check() -> None:
        if not decoding():
            raise RuntimeError(f"batch {batch}: not every request decodes at a measured step")
        contexts.append(sum(s.computed + 1 for s in eng.running) / batch)

    for _ in range(args.warmup):
        check()
        eng._iteration()
    plain = []
    for _ in range(args.steps):
        check()
        plain.append(plain_step(eng))
    steps = profiled_steps(eng, args.profile_steps, check, lambda: None)
    for rid in ids:
        eng.cancel(rid)
    eng._iteration()
    if eng.running or eng.waiting:
        raise RuntimeError("the engine did not drain after the decode case")
    case = {
        "case": "decode",
        "batch": batch,
        "tokens_per_step": batch,
        "context_tokens_mean": round(statistics.mean(contexts), 1),
    }
    return summarise(case, plain, steps)


def prefill_case(
    eng: Engine, prompts: list[list[int]], adapter: str | None, args: argparse.Namespace
) -> dict[str, Any]:
    """One request's whole prompt as one chunk (the step also samples and streams its first token); a
    second, unmeasured step finishes the request before the next."""
    n = args.prefill_tokens
    it = iter(prompts)
    k = 0

    def arrive() -> None:
        nonlocal k
        k += 1
        submit(eng, greedy(f"p{k}", next(it), 2, adapter=adapter))

    def drain() -> None:
        eng._iteration()
        if eng.running or eng.waiting:
            raise RuntimeError("the prefill request did not finish in its second step")

    for _ in range(args.warmup):
        arrive()
        eng._iteration()
        drain()
    plain = []
    for _ in range(args.steps):
        arrive()
        plain.append(plain_step(eng))
        if eng.running[0].computed != n:
            raise RuntimeError(f"the {n}-token prompt was not prefilled in one chunk")
        drain()
    steps = profiled_steps(eng, args.profile_steps, arrive, drain)
    return summarise({"case": "prefill", "batch": 1, "tokens_per_step": n}, plain, steps)


def main(argv: Sequence[str]) -> int:
    """Measure every case plain and profiled, write the result and print its table."""
    ap = argparse.ArgumentParser(
        prog=prog("engine", "profile"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_threads(ap, 1)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="decode batch sizes")
    ap.add_argument("--steps", type=int, default=30, help="plain (unprofiled) steps timed per case")
    ap.add_argument("--profile-steps", type=int, default=5, help="steps under the profiler per case")
    ap.add_argument("--warmup", type=int, default=3, help="steps run before measuring each case")
    add_prompt_tokens(ap, 128)
    ap.add_argument("--prefill-tokens", type=int, default=200, help="the prefill chunk (0: no prefill case)")
    ap.add_argument("--adapters", type=int, default=1, help="LoRA adapters the requests use (0: base model)")
    add_result_name(ap, "profile")
    args = ap.parse_args(argv)
    threading.current_thread().name = "bench"

    loaded = load_smollm2(args.threads)
    default = BatchConfig()
    batch_cfg = replace(
        default,
        max_batch=max(default.max_batch, *args.batches),
        max_batch_tokens=max(default.max_batch_tokens, args.prefill_tokens),
        prefill_chunk_tokens=max(default.prefill_chunk_tokens, args.prefill_tokens),
    )
    changed = {k: v for k, v in asdict(batch_cfg).items() if asdict(default)[k] != v}
    load0 = os.getloadavg()[0]
    t_start = time.perf_counter()
    cases = []
    # Never started: this thread runs the engine's iterations (see the module doc).
    resident = max(EngineConfig().max_resident_adapters, args.adapters)
    eng = Engine(loaded, EngineConfig(batch=batch_cfg, max_resident_adapters=resident), NoTraining())
    torch.set_grad_enabled(False)  # as the engine thread does
    names: list[str | None] = [None]
    if args.adapters:
        futures = [
            eng.install_version(f"a{i}@v1", random_adapter(loaded, seed=i)) for i in range(args.adapters)
        ]
        eng._iteration()
        for f in futures:
            f.result(0)
        names = [f"a{i}" for i in range(args.adapters)]
    prompts = token_prompts(loaded, max(args.batches), args.prompt_tokens, seed=11)
    for b in args.batches:
        cases.append(decode_case(eng, prompts, b, names, args))
        c = cases[-1]
        print(f"decode batch {b}: {c['ms_per_step']:.1f} ms/step, {c['tokens_per_s']:.1f} tok/s", flush=True)
    if args.prefill_tokens:
        reps = args.warmup + args.steps + args.profile_steps + 1
        cases.append(
            prefill_case(eng, token_prompts(loaded, reps, args.prefill_tokens, seed=12), names[0], args)
        )
        c = cases[-1]
        print(f"prefill {args.prefill_tokens}: {c['ms_per_step']:.1f} ms/step", flush=True)
    eng.stop()
    doc = {
        "model": loaded.name,
        "config": {
            "batch": asdict(batch_cfg),
            "changed_from_defaults": changed,
            "prompt_tokens": args.prompt_tokens,
            "prefill_tokens": args.prefill_tokens,
            "adapters": args.adapters,
            "steps": args.steps,
            "profile_steps": args.profile_steps,
            "warmup": args.warmup,
            "n_layers": eng.executor.n_layers,
            "matmul_dtype": matmul_dtype(),
        },
        "categories": [{"key": k, "label": label, "python": py} for k, label, py in CATEGORIES],
        "cases": cases,
        "range_cost_us": round(range_cost_us(), 2),
        "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    path = save_result(args.name, doc)
    print(profile_table(json.loads(path.read_text())))
    return 0
