"""Measure a calibration of the cluster simulator on the real engine (`collm_common.calibration`).

`python -m collm_bench engine calibrate` writes `bench/calibration/<model>.json` with these functions, and the
check of the calibration against a live run (`tests/integration/bench/test_sim_agrees_with_live.py`)
measures the model it runs with them, so the simulator's costs always come from the same code.

What is timed, all on the replica's own `Executor` (no engine loop, no NATS):

* prefill: one sequence of n tokens; a line through two sizes gives `prefill_fixed_ms` and
  `prefill_ms_per_token`;
* decode: one step of a batch of b sequences at a fixed context (the KV caches are filled once for the
  largest batch; a batch of b reuses the first b of them, rewound to the context each step);
* context: one decode step of the largest batch at several contexts (a line through the smallest and
  the largest gives `decode_ms_per_context_token`), and one prefill chunk after 0 and after p earlier
  tokens (`prefill_ms_per_token_per_context_token`);
* LoRA: one decode step of a batch spread over k distinct adapters, against the same batch without any;
* training: a micro-step (forward and backward through the frozen base into the LoRA) of n tokens;
* evaluation: a held-out batch of n tokens (half prompt, half response) scored with an adapter the way
  the engine scores one (`EvalRun`, in the evaluation precision the replica picks on this machine); a
  line through two sizes gives `eval_fixed_ms` and `eval_ms_per_token`;
* quality: held-out loss of a domain's adapter against the tokens a `TrainingJob` trained it on.

Each size is timed `reps` times round-robin (on a shared machine the speed drifts; interleaving lets a
slow period hit every size alike), and one figure is kept per size: the fastest timing (`min`, the
least disturbed: what the engine costs on a quiet machine) or the median (`median`, the typical step).

`measure_costs_together` times `processes` engines at once, each in its own process with its own copy
of the model, and pools their timings: the cost of one replica's step while the other replicas of the
same machine compute too, which is what each replica of a live stack with several replicas per
machine pays (on a CPU the replicas share caches, memory bandwidth and, with SMT, cores).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import statistics
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from collm_common.calibration import Calibration, CostModel, QualityCurve
from collm_common.data import Example
from collm_common.lora import AdapterWeights, LoraSpec
from collm_replica.engine import eval_dtype
from collm_replica.engine.executor import Executor, ForwardItem
from collm_replica.lora_bank import LiveLora, LoraBank
from collm_replica.models import LoadedModel, load_model
from collm_replica.training import EvalRun, JobConfig, JobSpec, Rendered, TrainingJob, render_example

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class CostSizes:
    """What the calibration times (the defaults are the committed calibration's)."""

    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24)
    decode_context: int = 128
    # Decode at these contexts too (the batch of `context_batch`), and a prefill chunk of
    # `chunk_tokens` after 0 and after `chunk_start` earlier tokens: how attention grows with context.
    decode_contexts: tuple[int, ...] = (32, 512)
    context_batch: int = 16
    chunk_tokens: int = 64
    chunk_start: int = 256
    lora_adapters: tuple[int, ...] = (0, 1, 2, 4, 8)  # distinct adapters in the batch; must include 0
    lora_batch: int = 16
    train_tokens: tuple[int, ...] = (32, 64, 128)
    eval_tokens: tuple[int, ...] = (64, 256)
    reps: int = 7
    # The figure kept of each size's timings: "min" (the least disturbed) or "median" (the typical one).
    statistic: str = "min"
    max_batch: int = 16  # the replica's batch size the cost model is for

    def __post_init__(self) -> None:
        if len(self.prefill_tokens) < 2 or len(self.train_tokens) < 2 or len(self.eval_tokens) < 2:
            raise ValueError("prefill, training and evaluation need two sizes each (a line through them)")
        if not self.decode_batches or 0 not in self.lora_adapters or len(self.lora_adapters) < 2:
            raise ValueError("decode needs a batch size; LoRA needs 0 and at least one adapter count")
        if self.reps < 1:
            raise ValueError("reps must be >= 1")
        if len({*self.decode_contexts, self.decode_context}) < 2 or self.chunk_start < 1:
            raise ValueError("context needs two decode contexts and a chunk start >= 1")
        if self.statistic not in ("min", "median"):
            raise ValueError("statistic must be 'min' or 'median'")

    @property
    def prompts_needed(self) -> int:
        return max(2, max(self.decode_batches), self.lora_batch, self.context_batch)

    @property
    def contexts(self) -> list[int]:
        """Every context the decode step is timed at by `context_batch` sequences."""
        return sorted({*self.decode_contexts, self.decode_context})

    @property
    def prompt_tokens_needed(self) -> int:
        return max(
            max(self.prefill_tokens),
            max(self.contexts),
            self.chunk_start + self.chunk_tokens,
            max(self.train_tokens),
            max(self.eval_tokens),
        )


@dataclass(frozen=True)
class CostMeasurement:
    cost: CostModel
    prefill_ms: dict[int, float]
    decode_ms: dict[int, float]
    lora_ms_by_adapters: dict[int, float]
    train_ms: dict[int, float]
    eval_ms: dict[int, float]
    decode_ms_by_context: dict[int, float]  # the batch of `context_batch`
    chunk_ms_by_start: dict[int, float]  # a prefill chunk of `chunk_tokens` after 0 and more tokens
    statistic: str
    timings_ms: dict[str, dict[int, list[float]]]  # every timing by kind (`cost_timings`), and size

    def as_dict(self) -> dict[str, Any]:
        return {
            "prefill_ms": self.prefill_ms,
            "decode_ms": self.decode_ms,
            "decode_ms_by_context": self.decode_ms_by_context,
            "chunk_ms_by_start": self.chunk_ms_by_start,
            "lora_ms_by_adapters": self.lora_ms_by_adapters,
            "train_ms": self.train_ms,
            "eval_ms": self.eval_ms,
            "statistic": self.statistic,
            "timings_ms": self.timings_ms,
        }


def timings_ms(fns: Mapping[K, Callable[[], object]], reps: int) -> dict[K, list[float]]:
    """`reps` timings of each function (ms), taken round-robin after one warm-up call each."""
    for fn in fns.values():
        fn()
    out: dict[K, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[k].append((time.perf_counter() - t0) * 1e3)
    return out


def reduce_ms(timings: Mapping[K, Sequence[float]], statistic: str) -> dict[K, float]:
    """One figure per size: the fastest timing ("min") or the median ("median") (pure)."""
    if statistic == "min":
        return {k: min(v) for k, v in timings.items()}
    if statistic == "median":
        return {k: statistics.median(v) for k, v in timings.items()}
    raise ValueError(f"statistic must be 'min' or 'median' (got {statistic!r})")


def line_through(points: Mapping[int, float], a: int, b: int) -> tuple[float, float]:
    """(intercept >= 0, slope) of the line through the points at sizes a and b (pure)."""
    slope = (points[b] - points[a]) / (b - a)
    return max(0.0, points[a] - slope * a), slope


def random_adapter(
    loaded: LoadedModel, seed: int, scale: float = 0.02, spec: LoraSpec | None = None
) -> AdapterWeights:
    """An adapter with seeded random A and B (a zero B would change nothing the timing could see)."""
    ex = Executor(loaded)
    live = LiveLora.init_new(spec or LoraSpec(), ex.n_layers, ex.shapes, loaded.name, seed=seed)
    g = torch.Generator().manual_seed(seed + 99)
    for _a, b in live.params.values():
        b.data.copy_(torch.randn(b.shape, generator=g) * scale)
    return live.to_weights()


KINDS = ("prefill", "decode", "lora", "context", "chunk", "train", "eval")


def cost_timings(
    loaded: LoadedModel, prompts: Sequence[Sequence[int]], sz: CostSizes, kinds: Sequence[str] = KINDS
) -> dict[str, dict[int, list[float]]]:
    """Every timing of one engine: {kind: {size: [ms, ...]}}, kinds "prefill" (tokens), "decode"
    (batch), "lora" (distinct adapters), "train" (tokens), "context" (decode context), "chunk" (start),
    "eval" (tokens); only those of `kinds` ("lora" needs "decode")."""
    if len(prompts) < sz.prompts_needed or min(len(p) for p in prompts) < sz.prompt_tokens_needed:
        raise ValueError(f"need {sz.prompts_needed} prompts of >= {sz.prompt_tokens_needed} tokens")
    if "lora" in kinds and "decode" not in kinds:
        raise ValueError("the LoRA timings reuse the decode caches: time 'decode' too")
    ex = Executor(loaded)
    raw: dict[str, dict[int, list[float]]] = {}
    if "prefill" in kinds:
        _time_prefill(ex, prompts, sz, raw)
    if "decode" in kinds:
        _time_decode_and_lora(loaded, ex, prompts, sz, raw, with_lora="lora" in kinds)
    if "context" in kinds or "chunk" in kinds:
        _time_context(ex, prompts, sz, raw, kinds)
    if "train" in kinds or "eval" in kinds:
        _time_with_adapter(loaded, ex, prompts, sz, raw, kinds)
    return raw


def _time_prefill(
    ex: Executor, prompts: Sequence[Sequence[int]], sz: CostSizes, raw: dict[str, dict[int, list[float]]]
) -> None:
    """Prefill: one sequence of n tokens."""
    raw["prefill"] = timings_ms(
        {
            n: lambda n=n: ex.forward([ForwardItem(list(prompts[0][:n]), 0, ex.new_kv(n + 1))])
            for n in sz.prefill_tokens
        },
        sz.reps,
    )


def _time_decode_and_lora(
    loaded: LoadedModel,
    ex: Executor,
    prompts: Sequence[Sequence[int]],
    sz: CostSizes,
    raw: dict[str, dict[int, list[float]]],
    with_lora: bool,
) -> None:
    """Decode: batch b at the context; the caches of the largest batch are filled once and shared. LoRA
    overhead: the LoRA batch spread over k distinct adapters (k = 0: no adapter)."""
    reps = sz.reps
    ctx = sz.decode_context
    kvs = [ex.new_kv(ctx + 32) for _ in range(max(max(sz.decode_batches), sz.lora_batch))]
    fill = [ForwardItem(list(p[:ctx]), 0, kv) for kv, p in zip(kvs, prompts, strict=False)]
    for i in range(0, len(fill), 4):  # four sequences a forward: the same caches, filled sooner
        ex.forward(fill[i : i + 4])

    def step(batch: list[ForwardItem]) -> None:
        for it in batch:
            it.kv.length = ctx
        ex.forward(batch)

    raw["decode"] = timings_ms(
        {b: lambda b=b: step([ForwardItem([5], ctx, kv) for kv in kvs[:b]]) for b in sz.decode_batches},
        reps,
    )
    if not with_lora:
        return
    most = max(sz.lora_adapters)
    bank = LoraBank(most, ex.n_layers, ex.shapes, LORA_MODULES, 16, ex.dtype, ex.device)
    for i in range(most):
        bank.write(i, random_adapter(loaded, i))
    ex.bank = bank
    lora_fns = {}
    for k in sz.lora_adapters:
        slots = [(i % k) if k else -1 for i in range(sz.lora_batch)]
        order = sorted(range(sz.lora_batch), key=lambda i, slots=slots: slots[i])
        lora_fns[k] = lambda order=order, slots=slots: step(
            [ForwardItem([5], ctx, kvs[i], slot=slots[i]) for i in order]
        )
    raw["lora"] = timings_ms(lora_fns, reps)
    ex.bank = None


def _time_context(
    ex: Executor,
    prompts: Sequence[Sequence[int]],
    sz: CostSizes,
    raw: dict[str, dict[int, list[float]]],
    kinds: Sequence[str],
) -> None:
    """Context: the batch of `context_batch` decoding at each context (caches filled to the longest),
    and one prefill chunk after 0 and after `chunk_start` earlier tokens."""
    reps = sz.reps
    if "context" in kinds:
        longest = max(sz.contexts)
        ckvs = [ex.new_kv(longest + 32) for _ in range(sz.context_batch)]
        cfill = [ForwardItem(list(p[:longest]), 0, kv) for kv, p in zip(ckvs, prompts, strict=False)]
        for it in cfill:
            ex.forward([it])

        def decode_at(c: int) -> None:
            for kv in ckvs:
                kv.length = c
            ex.forward([ForwardItem([5], c, kv) for kv in ckvs])

        raw["context"] = timings_ms({c: lambda c=c: decode_at(c) for c in sz.contexts}, reps)
    if "chunk" not in kinds:
        return
    chunk_kv = ex.new_kv(sz.chunk_start + sz.chunk_tokens + 1)
    ex.forward([ForwardItem(list(prompts[1][: sz.chunk_start]), 0, chunk_kv)])
    chunk = list(prompts[0][: sz.chunk_tokens])

    def chunk_at(start: int) -> None:
        chunk_kv.length = start
        ex.forward([ForwardItem(chunk, start, chunk_kv)])

    raw["chunk"] = timings_ms({p: lambda p=p: chunk_at(p) for p in (0, sz.chunk_start)}, reps)


def _time_with_adapter(
    loaded: LoadedModel,
    ex: Executor,
    prompts: Sequence[Sequence[int]],
    sz: CostSizes,
    raw: dict[str, dict[int, list[float]]],
    kinds: Sequence[str],
) -> None:
    """With one fresh adapter: training, micro-steps of n tokens (one sequence); evaluation, one held-out
    batch of n tokens with the second half scored, in the evaluation precision the replica picks here."""
    live = LiveLora.init_new(LoraSpec(), ex.n_layers, ex.shapes, loaded.name)
    reps = max(2, sz.reps // 2)

    def train(n: int) -> None:
        ids = torch.tensor([list(prompts[1][:n])])
        with torch.enable_grad():
            loss, _ = ex.response_loss(ids, torch.ones_like(ids), ids, live)
            loss.backward()

    if "train" in kinds:
        raw["train"] = timings_ms({n: lambda n=n: train(n) for n in sz.train_tokens}, reps)
    if "eval" not in kinds:
        return
    fast = eval_dtype("auto", loaded.device, loaded.dtype)
    if fast is not None and not ex.fast_all:
        ex.enable_fast_eval(fast)
    pad = int(loaded.tokenizer.pad_token_id or 0)

    def score(n: int) -> None:
        ids = list(prompts[2][:n])
        labels = [-100] * (n // 2) + ids[n // 2 :]
        EvalRun([Rendered("calibration", "calibration", ids, labels)], live, n).run_all(ex, pad)

    raw["eval"] = timings_ms({n: lambda n=n: score(n) for n in sz.eval_tokens}, reps)


READY = "ready"


def _time_in_child(
    spec: str,
    cache_dir: Path | None,
    matmul_dtype: str,
    threads: int,
    prompts: list[list[int]],
    sz: CostSizes,
    barrier: Any,
    results: Any,
    kinds: Sequence[str] = KINDS,
) -> None:
    """One more engine of `measure_costs_together` (a spawned process): load, say so, wait for all, time."""
    try:
        torch.set_num_threads(threads)
        loaded = load_model(spec, device="cpu", cache_dir=cache_dir, matmul_dtype=matmul_dtype)
        results.put(READY)
        barrier.wait()
        results.put(cost_timings(loaded, prompts, sz, kinds))
    except Exception as exc:  # the parent reports it; a broken barrier releases the others
        barrier.abort()
        results.put(f"{type(exc).__name__}: {exc}")


def _next(results: Any, children: Sequence[Any], deadline: float) -> Any:
    """The next message of a timing process; an error when one failed, exited or the deadline passed."""
    while time.monotonic() < deadline:
        try:
            got = results.get(timeout=1.0)
        except queue.Empty:
            # A process that failed, or all of them gone with nothing left to read.
            if any(c.exitcode not in (None, 0) for c in children) or all(
                c.exitcode is not None for c in children
            ):
                with contextlib.suppress(queue.Empty):  # its last words, if it had any
                    got = results.get(timeout=1.0)
                    if isinstance(got, str) and got != READY:
                        raise RuntimeError(f"a timing process failed: {got}") from None
                raise RuntimeError("a timing process exited before it reported its timings") from None
            continue
        if isinstance(got, str) and got != READY:
            raise RuntimeError(f"a timing process failed: {got}")
        return got
    raise RuntimeError("the timing processes did not report in time")


def measure_costs_together(
    loaded: LoadedModel,
    spec: str,
    prompts: Sequence[Sequence[int]],
    sizes: CostSizes | None = None,
    processes: int = 2,
    cache_dir: Path | None = None,
    while_loading: Callable[[], object] | None = None,
    timeout_s: float = 600.0,
) -> CostMeasurement:
    """The simulator's cost model of `loaded` on this machine, with `processes` engines timed at once:
    this process (`loaded`) and `processes - 1` spawned ones that load `spec` themselves (same torch
    threads), all released together by a barrier once every one has loaded; the timings of all of them
    are pooled before each size is reduced. `while_loading` runs here while the others load (work that
    is not timed)."""
    sz = sizes or CostSizes()
    pooled = timings_together(loaded, spec, prompts, sz, processes, cache_dir, while_loading, timeout_s)
    return costs_from_timings(pooled, sz)


def timings_together(
    loaded: LoadedModel,
    spec: str,
    prompts: Sequence[Sequence[int]],
    sz: CostSizes,
    processes: int = 2,
    cache_dir: Path | None = None,
    while_loading: Callable[[], object] | None = None,
    timeout_s: float = 600.0,
    kinds: Sequence[str] = KINDS,
) -> dict[str, dict[int, list[float]]]:
    """The pooled timings (`cost_timings`, of `kinds`) of `measure_costs_together`."""
    if processes <= 1:
        if while_loading is not None:
            while_loading()
        return cost_timings(loaded, prompts, sz, kinds)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    args = (
        spec, cache_dir, loaded.matmul_precision, torch.get_num_threads(), [list(p) for p in prompts], sz,
        barrier, results, kinds,
    )  # fmt: skip
    children = [ctx.Process(target=_time_in_child, args=args, daemon=True) for _ in range(processes - 1)]
    for c in children:
        c.start()
    deadline = time.monotonic() + timeout_s
    try:
        if while_loading is not None:
            while_loading()
        for _ in children:
            _next(results, children, deadline)  # READY
        try:
            barrier.wait(max(1.0, deadline - time.monotonic()))
        except threading.BrokenBarrierError:
            raise RuntimeError("the timing processes could not start together") from None
        pooled = cost_timings(loaded, prompts, sz, kinds)
        for _ in children:
            got = _next(results, children, deadline)
            for name, by in got.items():
                for size, ms in by.items():
                    pooled[name][size].extend(ms)
    finally:
        for c in children:
            c.join(timeout=10)
            if c.is_alive():
                c.kill()
    return pooled


def costs_from_timings(raw: Mapping[str, Mapping[int, Sequence[float]]], sz: CostSizes) -> CostMeasurement:
    """The cost model of `cost_timings`' timings, each size reduced by `sz.statistic` (pure)."""
    statistic = sz.statistic
    pre = reduce_ms(raw["prefill"], statistic)
    decode = reduce_ms(raw["decode"], statistic)
    lora_ms = reduce_ms(raw["lora"], statistic)
    tr = reduce_ms(raw["train"], statistic)
    by_context = reduce_ms(raw["context"], statistic)
    by_start = reduce_ms(raw["chunk"], statistic)
    xs = sorted(pre)
    fixed, slope = line_through(pre, xs[1] if len(xs) > 2 else xs[0], xs[-1])
    most = max(lora_ms)
    per_adapter = max(0.0, (lora_ms[most] - lora_ms[0]) / lora_ms[0] / most)
    ts = sorted(tr)
    t_fixed, t_slope = line_through(tr, ts[0], ts[-1])
    ev = reduce_ms(raw["eval"], statistic) if "eval" in raw else {}
    e_fixed, e_slope = line_through(ev, min(ev), max(ev)) if len(ev) >= 2 else (0.0, None)
    cs = sorted(by_context)
    _, per_batch_context = line_through(by_context, cs[0], cs[-1])
    starts = sorted(by_start)
    chunk_extra = (by_start[starts[-1]] - by_start[starts[0]]) / (sz.chunk_tokens * starts[-1])
    cost = CostModel(
        prefill_fixed_ms=fixed,
        prefill_ms_per_token=slope,
        decode_step_ms=decode,
        decode_context_tokens=sz.decode_context,
        decode_ms_per_context_token=max(0.0, per_batch_context / sz.context_batch),
        prefill_ms_per_token_per_context_token=max(0.0, chunk_extra),
        lora_overhead_frac_per_adapter=per_adapter,
        train_fixed_ms=t_fixed,
        train_ms_per_token=t_slope,
        eval_fixed_ms=max(0.0, e_fixed),
        eval_ms_per_token=None if e_slope is None else max(0.0, e_slope),
        max_batch=sz.max_batch,
    )
    timings = {name: {k: list(v) for k, v in by.items()} for name, by in raw.items()}
    return CostMeasurement(cost, pre, decode, lora_ms, tr, ev, by_context, by_start, statistic, timings)


def measure_quality(
    loaded: LoadedModel,
    domain: str,
    train: Sequence[Example],
    held_out: Sequence[Example],
    token_targets: Sequence[int],
    eval_examples: int = 16,
    learning_rate: float = 1e-3,
    on_point: Callable[[int, float], None] | None = None,
) -> QualityCurve:
    """Held-out loss of a fresh adapter of `domain` before training and after a `TrainingJob` (micro-steps
    of 128 tokens, optimizer steps of 256) has trained it on `train` up to each of `token_targets`."""
    ex = Executor(loaded)
    tok = loaded.tokenizer
    items_eval = [r for e in held_out[:eval_examples] if (r := render_example(tok, e, 128))]
    if not items_eval:
        raise ValueError(f"{domain}: no held-out example to score")
    live = LiveLora.init_new(LoraSpec(), ex.n_layers, ex.shapes, loaded.name, seed=1)
    job = TrainingJob(
        JobSpec(
            domain, f"{domain}@v1", 1, live, token_budget=max(token_targets), learning_rate=learning_rate
        ),
        ex,
        tok,
        list(train),
        [],
        JobConfig(micro_tokens=128, batch_tokens=256, max_seq_len=128),
    )
    pad = int(tok.pad_token_id or 0)
    base_loss = EvalRun(items_eval, None, 256).run_all(ex, pad).mean()
    points: list[tuple[int, float]] = [(0, EvalRun(items_eval, live, 256).run_all(ex, pad).mean())]
    for target in sorted(token_targets):
        with torch.enable_grad():
            while job.tokens_done < target and job.active:
                job.step(128)
        points.append((job.tokens_done, EvalRun(items_eval, live, 256).run_all(ex, pad).mean()))
        if on_point is not None:
            on_point(*points[-1])
    return QualityCurve(domain=domain, base_loss=base_loss, points=points)


def calibration(
    model: str,
    cost: CostModel,
    curves: Sequence[QualityCurve],
    command: str,
    matmul_dtype: str = "float32",
) -> Calibration:
    """The calibration file's content, stamped with this process's device, threads and time, and the
    precision of the measured engines' products."""
    return Calibration(
        model=model,
        device="cpu",
        matmul_dtype=matmul_dtype,
        torch_threads=torch.get_num_threads(),
        measured_unix_s=time.time(),
        command=command,
        cost=cost,
        quality=list(curves),
    )
