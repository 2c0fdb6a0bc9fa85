"""Tables of the engine benchmarks (collm_bench.engine, results in bench/results/engine/) and of the
calibration (bench/calibration/*.json)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

# Goals of the concurrency benchmark: paged / before and paged / generate output tok/s, and requests
# running at once, paged / reserve.
CONCURRENCY_GOALS = {"paged_over_before": 1.5, "paged_over_generate": 8.0, "running_paged_over_reserve": 2.0}
CONCURRENCY_LABELS = {
    "paged": "paged KV, batched attention",
    "reserve": "same engine, reserve at admission",
}


def _met(value: float, goal: float, at_most: bool = False) -> str:
    return "met" if (value <= goal if at_most else value >= goal) else "missed"


def concurrency_table(doc: Mapping[str, Any]) -> str:
    """Every engine variant of one concurrency run (medians of its rounds), then the ratios."""
    by = {r["variant"]: r for r in doc["runs"]}
    labels = {
        **CONCURRENCY_LABELS,
        "before": f"engine at {doc['before']}",
        "generate": f"HF `generate`, one at a time ({by.get('generate', {}).get('requests', '?')} requests)",
    }
    lines = [
        "| variant | output tok/s | wall (s) | requests running at once (mean / peak) | preemptions |",
        "|---|---|---|---|---|",
    ]
    for v in ("paged", "reserve", "before", "generate"):
        r = by.get(v)
        if r is None:
            continue
        running = f"{r['running_mean']} / {r['running_peak']}" if "running_mean" in r else ""
        rounds = r.get("rounds_output_tok_s", [])
        tok_s = f"{r['output_tok_s']}" + (f" ({', '.join(map(str, rounds))})" if len(rounds) > 1 else "")
        lines.append(f"| {labels[v]} | {tok_s} | {r['wall_s']} | {running} | {r.get('preemptions', '')} |")
    rt = doc["ratios"]
    g = CONCURRENCY_GOALS
    lines += [
        "",
        f"KV budget {doc['config']['kv_budget_tokens']} tokens, {doc['config']['repeat']} round(s). "
        f"paged / before: **{rt['paged_over_before']}x** output tok/s (goal >= {g['paged_over_before']:g}); "
        f"paged / generate: **{rt['paged_over_generate']}x** (goal >= {g['paged_over_generate']:g}); "
        f"requests running at once, paged / reserve: **{rt['running_paged_over_reserve']}x** "
        f"(goal >= {g['running_paged_over_reserve']:g})",
    ]
    return "\n".join(lines)


def _concurrency_rows(doc: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    rt, kv = doc["ratios"], doc["config"]["kv_budget_tokens"]
    by = {r["variant"]: r for r in doc["runs"]}
    g = CONCURRENCY_GOALS
    where = f"64 requests, Azure conv lengths, KV budget {kv}"
    return [
        (
            where,
            f"the engine at `{doc['before']}` (before the paged KV cache)",
            f"{by['paged']['output_tok_s']} against {by['before']['output_tok_s']} output tok/s: "
            f"**{rt['paged_over_before']}x**",
            f"{_met(rt['paged_over_before'], g['paged_over_before'])} (>= {g['paged_over_before']:g}x)",
        ),
        (
            where,
            f"HF `generate`, one at a time: {by['generate']['output_tok_s']} tok/s",
            f"**{rt['paged_over_generate']}x**",
            f"{_met(rt['paged_over_generate'], g['paged_over_generate'])} (>= {g['paged_over_generate']:g}x)",
        ),
        (
            where,
            "reserve prompt + `max_tokens` at admission",
            f"requests running at once {by['paged']['running_mean']} against "
            f"{by['reserve']['running_mean']}: **{rt['running_paged_over_reserve']}x**",
            f"{_met(rt['running_paged_over_reserve'], g['running_paged_over_reserve'])} "
            f"(>= {g['running_paged_over_reserve']:g}x)",
        ),
    ]


def _multilora_rows(doc: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    where = f"{doc['requests']} requests over {doc['adapters']} distinct adapters in one batch, unmerged"
    return [
        (
            where,
            f"{doc['requests']} base-model requests in one batch",
            f"**{doc['ratio_vs_base']:.2f}** of its tok/s",
            f"{_met(doc['ratio_vs_base'], doc['goal_vs_base'])} (>= {doc['goal_vs_base']:g})",
        ),
        (
            where,
            "adapter by adapter: merge, run its requests, unmerge",
            f"**{doc['ratio_vs_merged']:.2f}x**",
            f"{_met(doc['ratio_vs_merged'], doc['goal_vs_merged'])} (>= {doc['goal_vs_merged']:g}x)",
        ),
    ]


def _swap_rows(doc: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    ok = doc["ratio"] <= doc["goal"] and doc["failures"] == 0
    return [
        (
            f"publish a new version while {doc['requests']} LoRA requests stream {doc['new_tokens']} tokens",
            "p99 inter-token gap of the same streams without a swap",
            f"largest gap during the swap {doc['max_gap_ms_during_swap']:.1f} ms against "
            f"{doc['p99_gap_ms_no_swap']:.1f} ms: **{doc['ratio']:.2f}x**; {doc['failures']} failed requests "
            f"(the swap took {doc['swap_wall_ms']:.0f} ms)",
            f"{'met' if ok else 'missed'} (<= {doc['goal']:g}x, 0 failures)",
        )
    ]


def _coexec_rows(doc: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    c = doc["runs"]["c_slo_aware"]
    ratio = doc["attainment_ratio_c_over_a"]
    return [
        (
            f"co-execution at {doc['load']:.0%} load, SLO-aware co-scheduler",
            "fine-tuning off; a replica that only trains",
            f"SLO attainment **{ratio:.3f}x**; fine-tunes at **{c['ft_frac_of_train_only']:.0%}** "
            "of train-only",
            f"{_met(ratio, doc['goal_attainment_ratio'])} (>= {doc['goal_attainment_ratio']:g}x); "
            f"{_met(c['ft_frac_of_train_only'], doc['goal_ft_frac'])} (>= {doc['goal_ft_frac']:.0%})",
        )
    ]


def _memory_rows(doc: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    return [
        (
            f"peak RSS: {doc['resident_adapters']} resident adapters, a training job and concurrent LoRA "
            f"requests for {doc['seconds']:g} s",
            "",
            f"**{doc['peak_rss_mb']:.0f} MB**",
            f"{_met(doc['peak_rss_mb'], doc['goal_mb'], at_most=True)} (<= {doc['goal_mb']} MB)",
        )
    ]


SUMMARY_ROWS: dict[str, Callable[[Mapping[str, Any]], list[tuple[str, str, str, str]]]] = {
    "engine concurrency": _concurrency_rows,
    "multilora": _multilora_rows,
    "swap": _swap_rows,
    "coexec": _coexec_rows,
    "memory": _memory_rows,
}


def summary_table(docs: Sequence[Mapping[str, Any]]) -> str:
    """One row per figure of each engine result (its `benchmark` picks the rows), with its goal."""
    lines = ["| benchmark | baseline (same run) | result | goal |", "|---|---|---|---|"]
    for doc in docs:
        rows = SUMMARY_ROWS.get(str(doc.get("benchmark")))
        if rows is None:
            raise ValueError(f"no engine summary rows for benchmark {doc.get('benchmark')!r}")
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows(doc)]
    return "\n".join(lines)


COEXEC_RUNS = {
    "a_ft_off": "(a) fine-tuning off",
    "b_fixed_ratio": "(b) naive fixed ratio",
    "c_slo_aware": "(c) SLO-aware",
}


def coexec_table(doc: Mapping[str, Any]) -> str:
    """The co-execution benchmark's setup figures and its three runs, repetitions pooled."""
    lines = [
        f"Unloaded TTFT {doc['unloaded_ttft_ms']:.0f} ms, TPOT {doc['unloaded_tpot_ms']:.0f} ms; capacity "
        f"{doc['capacity_rps']:.2f} req/s; offered {doc['offered_rps']:.2f} req/s; SLOs TTFT "
        f"{doc['ttft_slo_ms']:.0f} ms, TPOT {doc['tpot_slo_ms']:.0f} ms; train only "
        f"{doc['train_only_tokens_per_s']:.1f} training tokens/s.",
        "",
        f"| run ({doc['repeat']} repetitions pooled) | SLO attainment | fine-tuning tok/s (of train-only) "
        "| eval loss after (each repetition) |",
        "|---|---|---|---|",
    ]
    for key, label in COEXEC_RUNS.items():
        r = doc["runs"][key]
        losses = ", ".join(f"{x['eval_loss_after']:.3f}" for x in doc["runs_by_repeat"][key])
        ft = "0" if not r["ft_tokens"] else f"{r['ft_tokens_per_s']:.1f} ({r['ft_frac_of_train_only']:.0%})"
        lines.append(f"| {label} | {r['attainment']:.3f} ({r['good']}/{r['submitted']}) | {ft} | {losses} |")
    return "\n".join(lines)


def _per_token(fixed_ms: float, per_token_ms: float) -> str:
    return f"{fixed_ms:.0f} ms + {per_token_ms:.2f} ms/token"


def calibration_table(docs: Sequence[Mapping[str, Any]]) -> str:
    """The step costs and quality points of calibration files (collm_common.calibration's format)."""
    context = docs[0]["cost"]["decode_context_tokens"]
    lines = [
        f"| matmul dtype | prefill | decode step at batch 1 / 8 / 16 (context {context}) | training "
        "| evaluation | held-out loss at tokens trained |",
        "|---|---|---|---|---|---|",
    ]
    for doc in docs:
        c = doc["cost"]
        decode = " / ".join(f"{c['decode_step_ms'][b]:.0f}" for b in ("1", "8", "16"))
        quality = "; ".join(
            q["domain"] + " " + ", ".join(f"{loss:.3f} at {t}" for t, loss in q["points"])
            for q in doc["quality"]
        )
        lines.append(
            f"| {doc['matmul_dtype']} | {_per_token(c['prefill_fixed_ms'], c['prefill_ms_per_token'])} "
            f"| {decode} ms | {_per_token(c['train_fixed_ms'], c['train_ms_per_token'])} "
            f"| {_per_token(c['eval_fixed_ms'], c['eval_ms_per_token'])} | {quality} |"
        )
    return "\n".join(lines)


def structured_table(docs: Sequence[Mapping[str, Any]]) -> str:
    """The grammar libraries side by side (grammar_libs.json), then constrained decoding's cost in the
    engine (constrained_decode.json)."""
    libs, decode = docs
    lines = [
        "| library | schemas compiled | random walks valid / invalid | compile ms (median / max) "
        f"| mask µs per token at batch {libs['batch']} (median) |",
        "|---|---|---|---|---|",
    ]
    for name, r in libs["results"].items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | |")
            continue
        w = r["walks"]
        lines.append(
            f"| {name} {libs['versions'].get(name.replace('-', '_')) or ''} | {r['compiled']}/{r['schemas']} "
            f"| {w['valid']} / {w['invalid']} | {r['compile_ms_median']} / {r['compile_ms_max']} "
            f"| {r['mask_us_per_token_batch16_median']} |"
        )
    med = decode["tokens_per_s_median"]
    lines += [
        "",
        f"Decode, {decode['batch']} requests x {decode['max_tokens']} tokens: {med['none']:.1f} tok/s "
        f"unconstrained, {med['half']:.1f} with {decode['constrained']} constrained: "
        f"**{decode['half_vs_none']:.2f}x**.",
    ]
    return "\n".join(lines)


def _profile_case(case: Mapping[str, Any]) -> str:
    if case["case"] == "decode":
        return f"decode, batch {case['batch']}"
    return f"prefill {case['tokens_per_step']} tokens"


def profile_table(doc: Mapping[str, Any]) -> str:
    """Where one engine step's milliseconds go (collm_bench.engine.step_profile): per case, the plain step
    (ms, tokens/s), then each category's share of the profiled step (categories under 2% in every case
    together as "the rest"), and the torch op calls per decoder layer."""
    cases = doc["cases"]
    cfg = doc["config"]
    prof = [c["profiled"] for c in cases]

    def row(label: str, cells: Sequence[str]) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    def share(p: Mapping[str, Any], keys: Sequence[str]) -> str:
        ms = sum(p["ms"].get(k, 0.0) for k in keys)
        return f"{100 * ms / p['ms_per_step']:.0f}%" if p["ms_per_step"] else "-"

    lines = [
        row("", [_profile_case(c) for c in cases]),
        "|---" * (len(cases) + 1) + "|",
        row(
            "ms per step / tokens per s", [f"{c['ms_per_step']:.1f} / {c['tokens_per_s']:.0f}" for c in cases]
        ),
    ]
    rest = []
    for cat in doc["categories"]:
        key = cat["key"]
        if all(p["ms"].get(key, 0.0) < 0.02 * p["ms_per_step"] for p in prof):
            rest.append(key)
            continue
        lines.append(row(cat["label"], [share(p, [key]) for p in prof]))
    if rest:
        lines.append(row("the rest", [share(p, rest) for p in prof]))
    lines.append(row("torch op calls per decoder layer", [f"{p['op_calls_per_layer']:.0f}" for p in prof]))
    changed = ", ".join(f"{k} {v}" for k, v in cfg["changed_from_defaults"].items())
    adapters = f"{cfg['adapters']} LoRA adapter(s)" if cfg["adapters"] else "no adapter"
    threads = doc.get("machine", {}).get("torch_threads", "?")
    lines += [
        "",
        f"{doc['model']}, {threads} torch thread(s), {cfg['matmul_dtype']}, {adapters}, "
        f"{cfg['prompt_tokens']}-token prompts; {changed or 'engine defaults'}. Shares: of a step under "
        f"torch.profiler (mean of {cfg['profile_steps']}); ms: median of {cfg['steps']} plain steps.",
    ]
    return "\n".join(lines)


def threads_table(doc: Mapping[str, Any]) -> str:
    """One replica with two torch threads against two replicas with one each (collm_bench.engine.threads):
    per concurrency and batch bound, each layout's output tokens/s, TTFT p50 and TPOT p50, and (b) / (a)
    output tokens/s."""
    lines = [
        "| streams (max_batch) | (a) 1 process x 2 threads: tok/s, TTFT, TPOT | (b) 2 x 1 thread "
        "| (b) / (a) |",
        "|---|---|---|---:|",
    ]

    def cell(r: Mapping[str, Any]) -> str:
        return f"{r['output_tok_s']:.1f}, {r['ttft_ms_p50'] / 1e3:.1f} s, {r['tpot_ms_p50']:.0f} ms"

    cfg = doc["config"]
    default_mb = cfg.get("engine_batch_defaults", {}).get("max_batch", 16)
    for case in doc["cases"]:
        a, b = case["a"], case["b"]
        if case["default_max_batch"]:
            mb = f"default {default_mb}"
        else:
            mb = "raised" if max(a["max_batch"]) > default_mb else str(default_mb)
        lines.append(
            f"| {case['concurrency']} ({mb}) | {cell(a)} | {cell(b)} "
            f"| **{case['ratio_b_over_a']['output_tok_s']:.2f}x** |"
        )
    lines += [
        "",
        f"{doc['model']}, {cfg['matmul_dtype']}, {doc['machine']['cpus']} CPUs; {cfg['prompt_tokens']}-token "
        f"prompts, {cfg['output_tokens']} tokens out, all at once; (b) splits the streams, each process with "
        f"max_batch raised to its share where over {default_mb}.",
    ]
    return "\n".join(lines)
