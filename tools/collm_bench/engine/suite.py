"""The engine's benchmark suite on SmolLM2-135M-Instruct (CPU, one torch thread). Each prints its ratios
against a baseline measured in the same run and writes bench/results/engine/<name>.json (plus a PNG
where useful).

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench engine batching
    ... multilora | swap | coexec | memory | calibrate | all

`all` runs each one in its own process (so `memory` measures a clean peak RSS).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from collm_bench.calibrate import (
    CostSizes,
    calibration,
    measure_costs_together,
    measure_quality,
)
from collm_bench.engine.common import (
    ENGINE_RESULTS,
    Trace,
    domain_examples,
    engine_command_line,
    greedy,
    load_smollm2,
    matmul_dtype,
    peak_rss_mb,
    random_adapter,
    save_result,
    submit,
    token_prompts,
    wait_all,
)
from collm_bench.groups import REPO, add_eval_dtype, add_lr, add_result_name
from collm_common.data import LocalDataset
from collm_common.lora import LoraSpec, decode_adapter, encode_adapter
from collm_common.stats import percentile
from collm_replica.engine import Engine, EngineConfig, EngineRequest
from collm_replica.engine.cosched import (
    CoScheduler,
    FixedRatioCoScheduler,
    NoTraining,
    SloAwareCoScheduler,
)
from collm_replica.engine.scheduler import BatchConfig
from collm_replica.lora_bank import MODULE_PATHS, LiveLora, parse_adapter
from collm_replica.naming import served_name
from collm_replica.settings import ReplicaSettings
from collm_replica.training import JobConfig, JobSpec

BENCHMARKS = ("batching", "multilora", "swap", "coexec", "memory", "calibrate")
CFG16 = BatchConfig(max_batch=16, max_batch_tokens=256, prefill_chunk_tokens=128, kv_budget_tokens=32768)


def plot(path: Path, draw: Any) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        draw(ax)
        fig.tight_layout()
        if matmul_dtype() != "float32":  # beside the fp32 figure, as `save_result` does
            path = path.with_name(f"{path.stem}_{matmul_dtype()}{path.suffix}")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"wrote {path.relative_to(REPO)}")
    except Exception as exc:  # noqa: BLE001 - a plot is optional
        print(f"(no plot: {exc})")


def run_batch(engine: Engine, reqs: list[EngineRequest]) -> tuple[list[Trace], float]:
    t0 = time.perf_counter()
    traces = [submit(engine, r) for r in reqs]
    wait_all(traces)
    return traces, time.perf_counter() - t0


# ======================================================================================== 1. batching
def bench_batching(args: argparse.Namespace) -> None:
    loaded = load_smollm2()
    prompts = token_prompts(loaded, 16, 128)
    n_new = 64
    model = loaded.model
    with torch.no_grad():  # warm-up
        model.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    base_n = args.baseline_requests
    t0 = time.perf_counter()
    hf_out = []
    with torch.no_grad():
        for p in prompts[:base_n]:
            out = model.generate(
                torch.tensor([p]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=0
            )
            hf_out.append(out[0, len(p) :].tolist())
    base_s = time.perf_counter() - t0
    base_tps = base_n * n_new / base_s
    print(f"baseline: {base_n} requests one at a time with HF generate: {base_s:.1f}s, {base_tps:.1f} tok/s")

    with Engine(loaded, EngineConfig(batch=CFG16), NoTraining()) as eng:
        run_batch(eng, [greedy("warm", prompts[0][:16], 4)])
        traces, eng_s = run_batch(eng, [greedy(f"r{i}", p, n_new) for i, p in enumerate(prompts)])
    eng_tps = 16 * n_new / eng_s
    same = sum(1 for t, h in zip(traces, hf_out, strict=False) if t.token_ids == h)
    ratio = eng_tps / base_tps
    print(f"engine: 16 concurrent requests: {eng_s:.1f}s, {eng_tps:.1f} tok/s")
    print(
        f"RATIO continuous batching / one-at-a-time = {ratio:.2f}x (goal >= 3x); "
        f"greedy outputs identical to HF for {same}/{base_n}"
    )
    save_result(
        "batching",
        {
            "prompt_tokens": 128,
            "new_tokens": n_new,
            "requests": 16,
            "baseline_requests": base_n,
            "baseline_s": base_s,
            "baseline_tokens_per_s": base_tps,
            "engine_s": eng_s,
            "engine_tokens_per_s": eng_tps,
            "ratio": ratio,
            "goal": 3.0,
            "greedy_identical": same,
            "ttft_s_p50": percentile([t.ttft_s or 0 for t in traces], 50),
            "tpot_ms_p50": 1e3 * percentile([t.tpot_s or 0 for t in traces], 50),
        },
    )
    plot(
        ENGINE_RESULTS / "batching.png",
        lambda ax: (
            ax.bar(["HF generate, one at a time", "CoLLM engine, 16 concurrent"], [base_tps, eng_tps]),
            ax.set_ylabel("output tokens/s"),
            ax.set_title(f"Continuous batching: {ratio:.2f}x (SmolLM2, CPU, 1 thread)"),
        ),
    )


# ======================================================================================== 2. multi-LoRA
def merge(loaded: Any, parsed: dict, scaling: float, sign: float) -> None:
    layers = loaded.model.model.layers
    with torch.no_grad():
        for (layer, mod), (a, b) in parsed.items():
            parent, attr = MODULE_PATHS[mod].split(".")
            lin = getattr(getattr(layers[layer], parent), attr)
            lin.weight.add_(sign * scaling * (b @ a))


def bench_multilora(args: argparse.Namespace) -> None:  # noqa: ARG001
    loaded = load_smollm2()
    prompts = token_prompts(loaded, 16, 128, seed=1)
    n_new = 64
    adapters = {f"a{i}": random_adapter(loaded, seed=i) for i in range(8)}
    cfg = EngineConfig(batch=CFG16, max_resident_adapters=8)
    with Engine(loaded, cfg, NoTraining()) as eng:
        for name, w in adapters.items():
            eng.install_version(f"{name}@v1", w).result(60)
        run_batch(eng, [greedy("warm", prompts[0][:16], 4, adapter="a0")])
        _, base_s = run_batch(eng, [greedy(f"b{i}", p, n_new) for i, p in enumerate(prompts)])
        _, lora_s = run_batch(
            eng, [greedy(f"l{i}", p, n_new, adapter=f"a{i % 8}") for i, p in enumerate(prompts)]
        )
        # Adapter by adapter: merge into the base weights, run its requests, unmerge.
        t0 = time.perf_counter()
        for k, (_name, w) in enumerate(adapters.items()):
            parsed = parse_adapter(w, eng.executor.n_layers, eng.executor.shapes, cfg.lora_targets)
            merge(loaded, parsed, w.spec.scaling, +1.0)
            mine = [greedy(f"m{i}", p, n_new) for i, p in enumerate(prompts) if i % 8 == k]
            run_batch(eng, mine)
            merge(loaded, parsed, w.spec.scaling, -1.0)
        merged_s = time.perf_counter() - t0
    tps = {k: 16 * n_new / s for k, s in (("base", base_s), ("lora", lora_s), ("merged", merged_s))}
    r_base, r_merged = tps["lora"] / tps["base"], tps["lora"] / tps["merged"]
    print(f"16 base requests in one batch: {base_s:.1f}s ({tps['base']:.1f} tok/s)")
    print(f"16 requests over 8 adapters in one batch (unmerged): {lora_s:.1f}s ({tps['lora']:.1f} tok/s)")
    print(
        f"adapter by adapter (merge, run 2 requests, unmerge) x8: {merged_s:.1f}s ({tps['merged']:.1f} tok/s)"
    )
    print(f"RATIO unmerged multi-LoRA / base = {r_base:.2f} (goal >= 0.85)")
    print(f"RATIO unmerged multi-LoRA / merge-run-unmerge = {r_merged:.2f}x (goal >= 2x)")
    save_result(
        "multilora",
        {
            "prompt_tokens": 128,
            "new_tokens": n_new,
            "requests": 16,
            "adapters": 8,
            "lora": LoraSpec().to_json(),
            "seconds": {"base": base_s, "lora": lora_s, "merged": merged_s},
            "tokens_per_s": tps,
            "ratio_vs_base": r_base,
            "goal_vs_base": 0.85,
            "ratio_vs_merged": r_merged,
            "goal_vs_merged": 2.0,
        },
    )


# ======================================================================================== 3. shadow swap
def bench_swap(args: argparse.Namespace) -> None:  # noqa: ARG001
    loaded = load_smollm2()
    prompts = token_prompts(loaded, 16, 128, seed=2)
    n_new, swap_after = 96, 32
    v1, v2 = random_adapter(loaded, 1), random_adapter(loaded, 2)
    with Engine(loaded, EngineConfig(batch=CFG16), NoTraining()) as eng:
        eng.install_version("med@v1", v1).result(60)
        run_batch(eng, [greedy("warm", prompts[0][:16], 4, adapter="med")])
        # Run 1: no swap.
        calm, _ = run_batch(eng, [greedy(f"c{i}", p, n_new, adapter="med") for i, p in enumerate(prompts)])
        steady = [g for t in calm for g in t.gaps()[swap_after:]]
        p99 = percentile(steady, 99)
        # Run 2: publish v2 while the 16 requests stream.
        traces = [submit(eng, greedy(f"s{i}", p, n_new, adapter="med")) for i, p in enumerate(prompts)]
        while min(len(t.token_ids) for t in traces) < swap_after:
            time.sleep(0.005)
        t_swap0 = time.perf_counter()
        blob = encode_adapter(v2)  # what the store holds; the replica decodes it and copies it into a slot
        eng.install_version("med@v2", decode_adapter(blob)).result(60)
        t_swap1 = time.perf_counter()
        wait_all(traces)
        probe = run_batch(eng, [greedy("after", prompts[0][:16], 4, adapter="med")])[0][0]
    during, outside = [], []
    for t in traces:
        for k, (a, b) in enumerate(zip(t.token_times, t.token_times[1:], strict=False)):
            if b >= t_swap0 and a <= t_swap1:
                during.append(b - a)
            elif k >= swap_after - 8:  # steady decoding around the swap, same run
                outside.append(b - a)
    p99_same_run = percentile(outside, 99)
    # The iteration boundary at which the swap took effect: the gap that contains t_swap1 and the next one.
    worst = max(during) if during else float("nan")
    failures = sum(1 for t in traces if t.error is not None or t.finished is None)
    versions_ok = all(
        t.accepted_version == "med@v1" and t.finished.adapter_version_id == "med@v1" for t in traces
    )
    ratio = worst / p99
    print(f"p99 inter-token gap without a swap: {p99 * 1e3:.1f} ms (max {max(steady) * 1e3:.1f} ms)")
    print(f"swap took {(t_swap1 - t_swap0) * 1e3:.1f} ms wall (decode blob + copy at an iteration boundary)")
    print(
        f"largest inter-token gap during the swap: {worst * 1e3:.1f} ms over {len(during)} gaps; "
        f"p99 gap of the same run outside the swap {p99_same_run * 1e3:.1f} ms ({worst / p99_same_run:.2f}x)"
    )
    print(
        f"RATIO max gap during swap / p99 gap without = {ratio:.2f} (goal <= 1.2); failures {failures}; "
        f"every token on its start version: {versions_ok}; new request after swap -> {probe.accepted_version}"
    )
    save_result(
        "swap",
        {
            "requests": 16,
            "new_tokens": n_new,
            "swap_after_tokens": swap_after,
            "p99_gap_ms_no_swap": p99 * 1e3,
            "max_gap_ms_no_swap": max(steady) * 1e3,
            "max_gap_ms_during_swap": worst * 1e3,
            "gaps_during_swap": len(during),
            "p99_gap_ms_same_run_outside_swap": p99_same_run * 1e3,
            "ratio_vs_same_run_p99": worst / p99_same_run,
            "swap_wall_ms": (t_swap1 - t_swap0) * 1e3,
            "ratio": ratio,
            "goal": 1.2,
            "failures": failures,
            "versions_consistent": versions_ok,
            "new_request_version": probe.accepted_version,
        },
    )
    t0 = min(t.submitted_s for t in traces)

    def draw(ax: Any) -> None:
        for t in traces:
            ax.plot([x - t0 for x in t.token_times[1:]], [g * 1e3 for g in t.gaps()], ".", ms=2)
        ax.axvspan(t_swap0 - t0, t_swap1 - t0, color="red", alpha=0.3, label="swap")
        ax.axhline(p99 * 1e3, color="k", ls="--", lw=0.8, label="p99 gap, no swap")
        ax.set_xlabel("s since submission")
        ax.set_ylabel("inter-token gap (ms)")
        ax.set_title("Shadow swap under load (16 streams, SmolLM2, CPU)")
        ax.legend()

    plot(ENGINE_RESULTS / "swap.png", draw)


# ======================================================================================== 4. co-execution
def chat_ids(loaded: Any, question: str) -> list[int]:
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return loaded.tokenizer.encode(text, add_special_tokens=False)


def coexec_engine(
    loaded: Any, policy: CoScheduler, ds: LocalDataset, job_cfg: JobConfig, share: float, slack_frac: float
) -> Engine:
    cfg = EngineConfig(batch=CFG16, ft_share_default=share, job=job_cfg, train_slack_frac=slack_frac)
    return Engine(loaded, cfg, policy, dataset=ds)


def start_job(eng: Engine, loaded: Any, lr: float) -> LiveLora:
    ex = eng.executor
    live = LiveLora.init_new(LoraSpec(), ex.n_layers, ex.shapes, loaded.name, seed=0)
    eng.start_job(JobSpec("medical", "medical@v1", 1, live, token_budget=10**9, learning_rate=lr)).result(60)
    end = time.perf_counter() + 120
    while eng.snapshot().jobs[0].steps_done == 0 and eng.jobs["medical"].eval_loss_before is None:
        if time.perf_counter() > end:  # the baseline evaluation runs before training; wait it out
            break
        time.sleep(0.1)
    return live


def open_loop(eng: Engine, reqs: list[EngineRequest], arrivals_s: list[float]) -> tuple[list[Trace], float]:
    traces: list[Trace] = []
    t0 = time.perf_counter()
    for r, at in zip(reqs, arrivals_s, strict=True):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        traces.append(submit(eng, r))
    wait_all(traces)
    return traces, time.perf_counter() - t0


def slo_stats(
    traces: list[Trace], ttft_slo_s: float, tpot_slo_s: float, duration_s: float
) -> dict[str, float]:
    good = 0
    for t in traces:
        ok = t.error is None and t.finished is not None and t.ttft_s is not None and t.ttft_s <= ttft_slo_s
        if ok and t.tpot_s is not None and t.tpot_s > tpot_slo_s:
            ok = False
        good += ok
    return {
        "submitted": len(traces),
        "good": good,
        "attainment": good / len(traces),
        "goodput_rps": good / duration_s,
        "ttft_ms_p50": 1e3 * percentile([t.ttft_s or 0 for t in traces], 50),
        "ttft_ms_p99": 1e3 * percentile([t.ttft_s or 0 for t in traces], 99),
        "tpot_ms_p50": 1e3 * percentile([t.tpot_s or 0 for t in traces if t.tpot_s], 50),
        "tpot_ms_p99": 1e3 * percentile([t.tpot_s or 0 for t in traces if t.tpot_s], 99),
    }


def eval_loss(eng: Engine, live: LiveLora | None) -> float | None:
    runs = eng.evaluate([("x", live.to_weights() if live is not None else None)], max_examples=16).result(600)
    return runs["x"].mean()


def pool(runs: list[dict[str, Any]], train_only_tps: float) -> dict[str, Any]:
    """Repetitions of one run pooled: counts and durations summed, the rest averaged."""
    good = sum(r["good"] for r in runs)
    submitted = sum(r["submitted"] for r in runs)
    dur = sum(r["duration_s"] for r in runs)
    ft = sum(r["ft_tokens"] for r in runs)
    out = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0] if isinstance(runs[0][k], int | float)}
    out.update(
        {
            "good": good,
            "submitted": submitted,
            "attainment": good / submitted,
            "goodput_rps": good / dur,
            "duration_s": dur,
            "ft_tokens": ft,
            "ft_tokens_per_s": ft / dur,
            "ft_frac_of_train_only": ft / dur / train_only_tps,
            "longest_background_ms": max(r["longest_background_ms"] for r in runs),
            "train_limits": {
                k: sum(r.get("train_limits", {}).get(k, 0) for r in runs)
                for k in sorted({k for r in runs for k in r.get("train_limits", {})})
            },
        }
    )
    return out


@dataclass(frozen=True)
class _Coexec:
    """The co-execution benchmark's fixed parts: the flags, the model, the medical dataset, the job's
    configuration and the tokenised questions (eval then train examples)."""

    args: argparse.Namespace
    loaded: Any
    ds: LocalDataset
    job_cfg: JobConfig
    questions: list[list[int]]

    def engine(self, policy: CoScheduler, share: float) -> Engine:
        return coexec_engine(self.loaded, policy, self.ds, self.job_cfg, share, self.args.slack_frac)


@dataclass(frozen=True)
class _Unloaded:
    """Measured with fine-tuning off: each lone request, the medians (s), the capacity at 16 concurrent
    requests, and the base model's eval loss."""

    singles: list[Trace]
    ttft_s: float
    tpot_s: float
    capacity_rps: float
    base_eval: float | None


@dataclass(frozen=True)
class _OfferedLoad:
    """The open-loop load every run replays: Poisson arrivals at `rate_rps`, their questions, the SLOs."""

    rate_rps: float
    ttft_slo_s: float
    tpot_slo_s: float
    arrivals_s: list[float]
    questions: list[list[int]]

    def requests(self, tag: str, n_new: int) -> list[EngineRequest]:
        return [
            greedy(
                f"{tag}{i}", q, n_new, ttft_slo_ms=self.ttft_slo_s * 1e3, tpot_slo_ms=self.tpot_slo_s * 1e3
            )
            for i, q in enumerate(self.questions)
        ]


def _coexec_setup(args: argparse.Namespace) -> _Coexec | None:
    """The model, dataset, job and questions; None (after a SKIP line) without the medical data."""
    examples = domain_examples("medical", 600)
    if not examples:
        print("SKIP: ../shared/data/domains/medical is absent")
        return None
    loaded = load_smollm2()
    ds = LocalDataset([], [])
    for e in examples:
        ds.add(e, 0.1)
    job_cfg = JobConfig(
        micro_tokens=args.micro_tokens,
        batch_tokens=256,
        max_seq_len=128,
        publish_every_steps=10**6,
        eval_max_examples=16,
    )
    questions = [chat_ids(loaded, e.prompt) for e in ds.eval + ds.train][: args.requests + 40]
    return _Coexec(args, loaded, ds, job_cfg, questions)


def _measure_unloaded(cx: _Coexec) -> _Unloaded:
    """Unloaded latency and capacity, fine-tuning off."""
    n_new = cx.args.new_tokens
    questions = cx.questions
    with cx.engine(NoTraining(), 0.0) as eng:
        run_batch(eng, [greedy("warm", questions[0], 4)])
        # Unloaded latency: the median of 5 requests alone (the machine is shared: a single one is noisy).
        singles = [run_batch(eng, [greedy(f"u{i}", questions[i], n_new)])[0][0] for i in range(5)]
        ttft0 = percentile([t.ttft_s for t in singles], 50)  # type: ignore[misc]
        tpot0 = percentile([t.tpot_s for t in singles], 50)  # type: ignore[misc]
        cap_traces, cap_s = run_batch(eng, [greedy(f"c{i}", q, n_new) for i, q in enumerate(questions[5:21])])
        base_eval = eval_loss(eng, None)
    return _Unloaded(singles, ttft0, tpot0, len(cap_traces) / cap_s, base_eval)


def _offered_load(cx: _Coexec, unloaded: _Unloaded) -> _OfferedLoad:
    """`--load` x the capacity, with SLOs scaled from the unloaded latency (printed)."""
    args = cx.args
    rate = args.load * unloaded.capacity_rps
    ttft_slo, tpot_slo = args.ttft_scale * unloaded.ttft_s, args.tpot_scale * unloaded.tpot_s
    print(
        f"unloaded TTFT {unloaded.ttft_s * 1e3:.0f} ms, TPOT {unloaded.tpot_s * 1e3:.0f} ms; "
        f"capacity {unloaded.capacity_rps:.2f} req/s "
        f"(16 concurrent); offered load {rate:.2f} req/s; "
        f"SLOs TTFT {ttft_slo * 1e3:.0f} ms, TPOT {tpot_slo * 1e3:.0f} ms"
    )
    rnd = random.Random(7)
    arrivals, t = [], 0.0
    for _ in range(args.requests):
        t += rnd.expovariate(rate)
        arrivals.append(t)
    return _OfferedLoad(rate, ttft_slo, tpot_slo, arrivals, cx.questions[21 : 21 + args.requests])


def _train_only(cx: _Coexec) -> tuple[float, float, float | None]:
    """The reference fine-tuning throughput: the same job on an idle replica (tokens/s, busy, step ms)."""
    args = cx.args
    with cx.engine(SloAwareCoScheduler(slack_frac=args.slack_frac), 1.0) as eng:
        start_job(eng, cx.loaded, args.lr)
        snap0, t0 = eng.snapshot(), time.perf_counter()
        time.sleep(args.train_only_s)
        snap1 = eng.snapshot()
        dt = time.perf_counter() - t0
    tps = (snap1.ft_tokens_total - snap0.ft_tokens_total) / dt
    busy = (snap1.train_ms_total - snap0.train_ms_total) / 1e3 / dt
    print(
        f"train only: {tps:.1f} training tokens/s (training busy {busy:.2f}; "
        f"step {snap1.train_step_ms or 0:.0f} ms)"
    )
    return tps, busy, snap1.train_step_ms


def _coexec_run(
    cx: _Coexec,
    load: _OfferedLoad,
    base_eval: float | None,
    name: str,
    policy: CoScheduler,
    train: bool,
    rep: int,
    ref_tps: float,
) -> dict[str, Any]:
    """One run of the offered load under `policy` (training when `train`): its SLO and fine-tuning
    figures, printed on one line."""
    with cx.engine(policy, 1.0 if train else 0.0) as eng:
        live = start_job(eng, cx.loaded, cx.args.lr) if train else None
        s0 = eng.snapshot()
        f0, tm0, im0 = s0.ft_tokens_total, s0.train_ms_total, s0.infer_ms_total
        eng.longest_background_ms = 0.0
        traces, dur = open_loop(eng, load.requests(f"{name[:1]}{rep}-", cx.args.new_tokens), load.arrivals_s)
        s1 = eng.snapshot()
        ft_tokens = s1.ft_tokens_total - f0
        eng.pause_training()
        stats: dict[str, Any] = slo_stats(traces, load.ttft_slo_s, load.tpot_slo_s, dur)
        stats.update(
            {
                "duration_s": dur,
                "ft_tokens": ft_tokens,
                "ft_tokens_per_s": ft_tokens / dur,
                "train_only_tokens_per_s": ref_tps,
                "ft_frac_of_train_only": (ft_tokens / dur) / ref_tps,
                "eval_loss_after": eval_loss(eng, live) if live is not None else base_eval,
                "optimizer_steps": eng.snapshot().jobs[0].steps_done if train else 0,
                # Where the wall time went during the run (ms of inference iterations, of training
                # pieces), and the longest stretch of background work between two iterations.
                "infer_busy_frac": (s1.infer_ms_total - im0) / 1e3 / dur,
                "train_busy_frac": (s1.train_ms_total - tm0) / 1e3 / dur,
                "longest_background_ms": eng.longest_background_ms,
                "train_step_ms": s1.train_step_ms,
                # Serving iterations by what bounded their training (`collm_replica.engine.cosched.Limit`).
                "train_limits": {k: v - s0.train_limits.get(k, 0) for k, v in s1.train_limits.items()},
            }
        )
    print(
        f"{name} #{rep}: attainment {stats['attainment']:.3f} ({stats['good']}/{stats['submitted']}), "
        f"goodput {stats['goodput_rps']:.2f} req/s, TTFT p50 {stats['ttft_ms_p50']:.0f} ms, "
        f"TPOT p50 {stats['tpot_ms_p50']:.0f} ms, FT {stats['ft_tokens_per_s']:.1f} tok/s "
        f"({100 * stats['ft_frac_of_train_only']:.0f}% of train-only), "
        f"eval loss {stats['eval_loss_after']:.4f}; busy: inference {stats['infer_busy_frac']:.2f}, "
        f"training {stats['train_busy_frac']:.2f}; longest background stretch "
        f"{stats['longest_background_ms']:.0f} ms; training bounded by {stats['train_limits']}",
        flush=True,
    )
    return stats


def _coexec_repeats(
    cx: _Coexec, load: _OfferedLoad, base_eval: float | None
) -> tuple[list[tuple[float, float, float | None]], dict[str, list[dict[str, Any]]]]:
    """Every repetition's train-only reference and its three runs: (a) fine-tuning off, (b) a fixed
    ratio, (c) SLO-aware."""
    args = cx.args
    # The machine is shared, so its speed drifts: each repetition measures the train-only reference and
    # the three runs back to back, and the figures pool the repetitions (drift hits every run alike).
    policies: list[tuple[str, Any, bool]] = [
        ("a_ft_off", NoTraining, False),
        ("b_fixed_ratio", lambda: FixedRatioCoScheduler(args.fixed_every), True),
        ("c_slo_aware", lambda: SloAwareCoScheduler(slack_frac=args.slack_frac), True),
    ]
    refs: list[tuple[float, float, float | None]] = []
    per_rep: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in policies}
    for rep in range(args.repeat):
        refs.append(_train_only(cx))
        for name, make, train in policies:
            per_rep[name].append(_coexec_run(cx, load, base_eval, name, make(), train, rep, refs[-1][0]))
    return refs, per_rep


def bench_coexec(args: argparse.Namespace) -> None:
    cx = _coexec_setup(args)
    if cx is None:
        return
    unloaded = _measure_unloaded(cx)
    load = _offered_load(cx, unloaded)
    base_eval = unloaded.base_eval
    refs, per_rep = _coexec_repeats(cx, load, base_eval)
    train_only_tps = sum(r[0] for r in refs) / len(refs)
    train_only_busy = sum(r[1] for r in refs) / len(refs)
    results: dict[str, Any] = {name: pool(runs, train_only_tps) for name, runs in per_rep.items()}
    for name, st in results.items():
        print(
            f"{name} (pooled over {args.repeat}): attainment {st['attainment']:.3f} "
            f"({st['good']}/{st['submitted']}), FT {st['ft_tokens_per_s']:.1f} tok/s "
            f"({100 * st['ft_frac_of_train_only']:.0f}% of train-only {train_only_tps:.1f})"
        )
    a, c = results["a_ft_off"], results["c_slo_aware"]
    att_ratio = c["attainment"] / a["attainment"] if a["attainment"] else float("nan")
    print(
        f"RATIO (c)/(a) SLO attainment = {att_ratio:.3f} (goal >= 0.95); (c) fine-tuning throughput = "
        f"{100 * c['ft_frac_of_train_only']:.0f}% of train-only (goal >= 40%); base eval loss {base_eval:.4f}"
    )
    save_result(
        args.name,
        {
            "dataset": "medical (MedQuAD subset) from ../shared/data/domains, converted on the fly",
            "unloaded_ttft_ms": unloaded.ttft_s * 1e3,
            "unloaded_tpot_ms": unloaded.tpot_s * 1e3,
            "capacity_rps": unloaded.capacity_rps,
            "offered_rps": load.rate_rps,
            "load": args.load,
            "requests": args.requests,
            "new_tokens": args.new_tokens,
            "ttft_slo_ms": load.ttft_slo_s * 1e3,
            "tpot_slo_ms": load.tpot_slo_s * 1e3,
            "ttft_scale": args.ttft_scale,
            "tpot_scale": args.tpot_scale,
            "micro_tokens": args.micro_tokens,
            "fixed_every": args.fixed_every,
            "learning_rate": args.lr,
            "train_only_tokens_per_s": train_only_tps,
            "train_only_busy_frac": train_only_busy,
            "train_only_step_ms": refs[-1][2],
            "train_only_by_repeat": [r[0] for r in refs],
            "repeat": args.repeat,
            "runs_by_repeat": per_rep,
            "slack_frac": args.slack_frac,
            "unloaded_ttft_ms_each": [1e3 * (t.ttft_s or 0) for t in unloaded.singles],
            "unloaded_tpot_ms_each": [1e3 * (t.tpot_s or 0) for t in unloaded.singles],
            "base_eval_loss": base_eval,
            "runs": results,
            "attainment_ratio_c_over_a": att_ratio,
            "goal_attainment_ratio": 0.95,
            "goal_ft_frac": 0.4,
        },
    )
    _plot_coexec(args.name, results)


def _plot_coexec(name: str, results: dict[str, Any]) -> None:
    """Each run's SLO attainment (bars) and fine-tuning throughput relative to train-only (line)."""
    names = list(results)
    plot(
        ENGINE_RESULTS / f"{name}.png",
        lambda ax: (
            ax.bar(
                [n.replace("_", " ") for n in names],
                [results[n]["attainment"] for n in names],
                label="SLO attainment",
            ),
            ax.plot(
                [n.replace("_", " ") for n in names],
                [results[n]["ft_frac_of_train_only"] for n in names],
                "ro-",
                label="FT throughput / train-only",
            ),
            ax.set_ylim(0, 1.1),
            ax.legend(),
            ax.set_title("Co-execution at 60% load (SmolLM2, CPU)"),
        ),
    )


# ======================================================================================== 5. memory
def bench_memory(args: argparse.Namespace) -> None:
    loaded = load_smollm2()
    examples = domain_examples("medical", 300)
    ds = LocalDataset([], [])
    for e in examples or [
        __import__("collm_common.data").data.Example(f"x{i}", "hello", "world") for i in range(50)
    ]:
        ds.add(e, 0.1)
    cfg = EngineConfig(
        batch=CFG16,
        # the 8 served adapters stay resident beside the versions the training job publishes
        max_resident_adapters=9,
        ft_share_default=1.0,
        job=JobConfig(micro_tokens=64, batch_tokens=256, max_seq_len=128, eval_max_examples=8),
        eval_matmul_dtype=args.eval_dtype,
    )
    prompts = token_prompts(loaded, 16, 128, seed=3)
    with Engine(loaded, cfg, SloAwareCoScheduler(), dataset=ds) as eng:
        for i in range(8):
            eng.install_version(f"a{i}@v1", random_adapter(loaded, i)).result(60)
        start_job(eng, loaded, 1e-3)
        t_end = time.perf_counter() + args.seconds
        n = 0
        while time.perf_counter() < t_end:
            run_batch(eng, [greedy(f"m{n}-{i}", p, 32, adapter=f"a{i % 8}") for i, p in enumerate(prompts)])
            n += 1
        snap = eng.snapshot()
    rss = peak_rss_mb()
    print(
        f"peak RSS with SmolLM2, 8 resident adapters, one training job and 16 concurrent requests: "
        f"{rss:.0f} MB (goal <= 2048 MB); {snap.ft_tokens_total} training tokens, "
        f"{len(snap.adapters)} adapters"
    )
    save_result(
        "memory" if args.eval_dtype == "auto" else f"memory_eval_{args.eval_dtype}",
        {
            "peak_rss_mb": rss,
            "goal_mb": 2048,
            "resident_adapters": len(snap.adapters),
            "ft_tokens": snap.ft_tokens_total,
            "batches": n,
            "seconds": args.seconds,
            "eval_matmul_dtype": args.eval_dtype,
            "eval_precision": eng.executor.eval_precision or "model dtype",
        },
    )


# ======================================================================================== calibration
def bench_calibrate(args: argparse.Namespace) -> None:
    """The simulator's calibration (`collm_bench.calibrate`): step costs, then quality curves per domain."""
    loaded = load_smollm2()
    sizes = CostSizes(reps=args.reps, statistic=args.statistic)
    prompts = token_prompts(loaded, max(32, sizes.prompts_needed), sizes.prompt_tokens_needed, seed=5)
    spec = os.environ.get("COLLM_BENCH_MODEL", "smollm2")
    cache_dir = ReplicaSettings().model_cache_dir
    costs = measure_costs_together(loaded, spec, prompts, sizes, args.processes, cache_dir)
    print(
        f"prefill ms {costs.prefill_ms}; decode ms {costs.decode_ms}; "
        f"lora ms by #adapters {costs.lora_ms_by_adapters}; train ms {costs.train_ms}; "
        f"eval ms {costs.eval_ms}; "
        f"decode ms of {sizes.context_batch} by context {costs.decode_ms_by_context}; "
        f"a {sizes.chunk_tokens}-token prefill chunk's ms by earlier tokens {costs.chunk_ms_by_start}"
    )
    curves = []
    for domain in args.domains:
        exs = domain_examples(domain, 400)
        if not exs:
            print(f"(no data for {domain}: skipped)")
            continue
        ds = LocalDataset([], [])
        for e in exs:
            ds.add(e, 0.1)
        curves.append(
            measure_quality(
                loaded,
                domain,
                ds.train,
                ds.eval,
                args.quality_tokens,
                eval_examples=16,
                learning_rate=1e-3,
                on_point=lambda n, loss, d=domain: print(f"{d}: {n} training tokens -> eval loss {loss:.4f}"),
            )
        )
    cal = calibration(loaded.name, costs.cost, curves, engine_command_line(), loaded.matmul_precision)
    stem = spec if spec == "smollm2" else served_name(spec)
    if loaded.matmul_precision != "float32":  # beside the fp32 calibration, not over it
        stem = f"{stem}_{loaded.matmul_precision}"
    out = REPO / "bench" / "calibration" / f"{stem}.json"
    cal.save(out)
    print(f"wrote {out.relative_to(REPO)}")
    save_result("calibration", {**costs.as_dict(), "calibration": cal.model_dump(mode="json")})


def build_parser() -> argparse.ArgumentParser:
    """The suite's parser: one sub-command per benchmark, and `all`."""
    ap = argparse.ArgumentParser(
        prog="python -m collm_bench engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("batching")
    b.add_argument("--baseline-requests", type=int, default=16)
    sub.add_parser("multilora")
    sub.add_parser("swap")
    c = sub.add_parser("coexec")
    c.add_argument("--requests", type=int, default=48)
    c.add_argument("--new-tokens", type=int, default=32)
    c.add_argument("--load", type=float, default=0.6)
    c.add_argument("--ttft-scale", type=float, default=5.0)
    c.add_argument("--tpot-scale", type=float, default=3.0)
    c.add_argument("--micro-tokens", type=int, default=128)
    c.add_argument("--slack-frac", type=float, default=EngineConfig().train_slack_frac)
    c.add_argument("--fixed-every", type=int, default=8)
    add_lr(c)
    c.add_argument("--train-only-s", type=float, default=20.0)
    c.add_argument("--repeat", type=int, default=1, help="repetitions of train-only, (a), (b), (c), pooled")
    add_result_name(c, "coexec")
    m = sub.add_parser("memory")
    m.add_argument("--seconds", type=float, default=20.0)
    add_eval_dtype(m)
    k = sub.add_parser("calibrate")
    k.add_argument("--domains", nargs="*", default=["medical", "math"])
    k.add_argument("--quality-tokens", nargs="*", type=int, default=[1024, 2048, 4096])
    k.add_argument("--reps", type=int, default=7, help="timings of each size")
    k.add_argument(
        "--statistic",
        choices=("min", "median"),
        default="min",
        help="the figure kept of each size's timings: the fastest (least disturbed) or the median (typical)",
    )
    k.add_argument(
        "--processes",
        type=int,
        default=1,
        help="engines timed at once, one process each (the replicas a live stack runs on this machine)",
    )
    sub.add_parser("all")
    return ap


def main(argv: Sequence[str]) -> int:
    """Run the benchmark `argv` names (`all`: each in its own `python -m collm_bench engine NAME`)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd == "all":
        for name in BENCHMARKS:
            print(f"\n=== {name} ===", flush=True)
            subprocess.run([sys.executable, "-m", "collm_bench", "engine", name], check=False)
        return 0
    if args.cmd in ("batching", "multilora") and matmul_dtype() != "float32":
        # their baselines run Hugging Face's forward and merge into the base weights, which need the
        # model's own fp32 projections; a bf16-held model has none
        ap.error(
            f"{args.cmd} compares with Hugging Face's fp32 forward: run it with COLLM_MATMUL_DTYPE=float32"
        )
    threading.current_thread().name = "bench"
    {
        "batching": bench_batching,
        "multilora": bench_multilora,
        "swap": bench_swap,
        "coexec": bench_coexec,
        "memory": bench_memory,
        "calibrate": bench_calibrate,
    }[args.cmd](args)
    return 0
