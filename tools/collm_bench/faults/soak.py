"""Soak: the whole stack (tiny model) at about 80% of its capacity for a long time; errors and memory.

Starts its own nats-server and redis-server and the stack through the launcher (aggregator with its
built-in rounds, coordinator, two replicas with local data, gateway; every service with its default
settings), then:

1. capacity: a closed-loop ramp (1, 2, 4, ... concurrent clients, `--ramp-step-s` each, until completed
   requests per second stop growing by 5%) gives the peak throughput; an open-loop ramp (Poisson
   arrivals at 40%, 50%, ... 100% of that peak, `--capacity-step-s` each) then finds the capacity: the
   highest arrival rate whose requests all succeed with a p99 end-to-end latency under `--p99-limit-s`
   (past it the queues only grow). Both ramps also warm the stack up (batches, allocator);
2. soak: Poisson arrivals at `--load` x capacity for `--duration-s`, alternating streamed and plain chat
   completions of `--max-tokens` tokens (greedy, ignore_eos), each classified as a full answer, a clear
   error, or lost (tests/integration/faults/probe.py; unanswered after `--request-timeout-s`: lost);
3. every `--sample-s` the RSS of every process (each service, nats-server, redis-server) from /proc, and
   the client's requests in flight.

Reports errors (goal 0) and, per process, RSS growth from the soak's first minute to its last (mean of
the samples in each; goal < 5%), per-minute throughput and latency. Writes bench/results/faults/soak.json.

Runs from the repository root (it imports `tests`).

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench faults soak            # 10 minutes
    .venv/bin/python -m collm_bench faults soak --duration-s 120 --ramp-step-s 5 --capacity-step-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from collm_bench.groups import RESULTS, add_max_tokens, add_out, add_seed, command_line, prog
from collm_common.stats import percentile, percentiles

if TYPE_CHECKING:
    from tests.integration.faults.harness import FaultStack
    from tests.integration.faults.probe import Outcome


def rss_mb(pid: int) -> float | None:
    """A process's resident set size (MB) from /proc; None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def closed_loop_peak(
    fs: FaultStack, step_s: float, max_tokens: int, max_concurrency: int
) -> dict[str, Any]:
    """Completed requests per second at 1, 2, 4, ... concurrent clients, until it stops growing (< 5%)."""
    from tests.integration.faults.probe import run_load, tally

    steps = []
    best = 0.0
    c = 1
    while c <= max_concurrency:
        t0 = time.monotonic()
        out = await run_load(
            fs.gateway_url, fs.base_model, concurrency=c, duration_s=step_s, max_tokens=max_tokens
        )
        wall = time.monotonic() - t0
        t = tally(out)
        rps = t["succeeded"] / wall
        p50 = percentile([o.latency_s for o in out if o.kind == "ok"], 50)
        steps.append({"concurrency": c, "completed_rps": round(rps, 3), **t, "e2e_p50_s": p50})
        print(f"closed loop: concurrency {c:3d}: {rps:7.2f} req/s {t}", flush=True)
        grew = rps >= best * 1.05
        best = max(best, rps)
        if not grew:
            break
        c *= 2
    return {"steps": steps, "peak_rps": round(best, 3)}


async def open_loop_capacity(
    fs: FaultStack, peak_rps: float, step_s: float, max_tokens: int, timeout_s: float, p99_limit_s: float
) -> dict[str, Any]:
    """The highest Poisson arrival rate, among 40%, 50%, ... 100% of the closed-loop peak, whose requests
    all succeed with a p99 end-to-end latency under `p99_limit_s`."""
    from tests.integration.faults.probe import tally

    steps = []
    best = None
    for frac in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        rate = frac * peak_rps
        res = await open_loop(fs, rate, step_s, max_tokens, timeout_s, seed=int(frac * 100))
        out: list[Outcome] = res["outcomes"]
        t = tally(out)
        p99 = percentile([o.latency_s for o in out if o.kind == "ok"], 99)
        ok = t["succeeded"] == t["sent"] and p99 is not None and p99 <= p99_limit_s
        steps.append({"offered_rps": round(rate, 3), **t, "e2e_p99_s": p99, "sustained": ok})
        print(
            f"open loop: {rate:7.2f} req/s: p99 {p99 or 0:.2f}s {t} -> {'ok' if ok else 'over'}", flush=True
        )
        if not ok:
            break
        best = rate
    capacity = best if best is not None else 0.4 * peak_rps
    return {"steps": steps, "capacity_rps": round(capacity, 3), "p99_limit_s": p99_limit_s}


async def open_loop(
    fs: FaultStack,
    rate_rps: float,
    duration_s: float,
    max_tokens: int,
    timeout_s: float,
    seed: int = 0,
    sample_s: float | None = None,
    progress_s: float | None = None,
) -> dict[str, Any]:
    """Poisson arrivals at `rate_rps` for `duration_s` (then the last requests drain), alternating streamed
    and plain requests; with `sample_s`, the RSS of every process and the client's requests in flight."""
    from tests.integration.faults.probe import one_request, tally

    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    rss: list[dict[str, Any]] = []
    t_start = time.monotonic()
    t_end = t_start + duration_s
    assert fs.nats is not None and fs.redis is not None
    servers = {"nats-server": fs.nats.proc.pid, "redis-server": fs.redis.proc.pid}
    tasks: set[asyncio.Task[None]] = set()

    async def sampler(every_s: float) -> None:
        while time.monotonic() < t_end:
            point: dict[str, Any] = {"t_s": round(time.monotonic() - t_start, 2), "in_flight": len(tasks)}
            for name, pid in {**fs.s.pids(), **servers}.items():
                point[name] = rss_mb(pid)
            rss.append(point)
            await asyncio.sleep(every_s)

    async def progress(every_s: float) -> None:
        while time.monotonic() < t_end:
            await asyncio.sleep(every_s)
            print(
                f"soak: {time.monotonic() - t_start:6.0f}s in flight {len(tasks)} {tally(outcomes)}",
                flush=True,
            )

    limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as http:
        bg = []
        if sample_s:
            bg.append(asyncio.create_task(sampler(sample_s)))
        if progress_s:
            bg.append(asyncio.create_task(progress(progress_s)))

        async def one(i: int) -> None:
            o = await one_request(
                http, fs.gateway_url, fs.base_model, stream=i % 2 == 0, max_tokens=max_tokens, index=i,
                timeout_s=timeout_s,
            )  # fmt: skip
            o.sent_s -= t_start
            o.end_s -= t_start
            outcomes.append(o)

        i = 0
        next_s = t_start
        while True:
            next_s += rng.expovariate(rate_rps)
            if next_s >= t_end:
                break
            await asyncio.sleep(max(0.0, next_s - time.monotonic()))
            task = asyncio.create_task(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        await asyncio.gather(*tasks)
        for b in bg:
            b.cancel()
    return {"outcomes": outcomes, "rss": rss, "wall_s": time.monotonic() - t_start}


def rss_growth(rss: list[dict[str, Any]], duration_s: float) -> dict[str, dict[str, float | None]]:
    """Per process: mean RSS of the first and of the last minute, and the growth between them (%)."""
    names = sorted({k for p in rss for k in p if k not in ("t_s", "in_flight")})
    out: dict[str, dict[str, float | None]] = {}
    for n in names:
        first = [p[n] for p in rss if p["t_s"] < 60 and p.get(n)]
        last = [p[n] for p in rss if p["t_s"] >= duration_s - 60 and p.get(n)]
        if not first or not last:
            out[n] = {"first_min_mb": None, "last_min_mb": None, "growth_pct": None}
            continue
        a, b = statistics.fmean(first), statistics.fmean(last)
        out[n] = {
            "first_min_mb": round(a, 1),
            "last_min_mb": round(b, 1),
            "growth_pct": round(100 * (b - a) / a, 2),
        }
    return out


def per_minute(outcomes: list[Outcome], duration_s: float) -> list[dict[str, Any]]:
    """Per minute of the soak (by send time): the outcomes' tally and the answered requests' p50 / p99."""
    from tests.integration.faults.probe import tally

    rows = []
    for m in range(int(duration_s // 60) + (1 if duration_s % 60 else 0)):
        sel = [o for o in outcomes if m * 60 <= o.sent_s < (m + 1) * 60]
        ok = [o.latency_s for o in sel if o.kind == "ok"]
        p50, p99 = percentiles(ok, (50, 99))
        rows.append({"minute": m + 1, **tally(sel), "e2e_p50_s": p50, "e2e_p99_s": p99})
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The flags of `faults soak`."""
    ap = argparse.ArgumentParser(
        prog=prog("faults", "soak"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--load", type=float, default=0.8, help="fraction of the measured capacity")
    ap.add_argument("--ramp-step-s", type=float, default=10.0, help="seconds per closed-loop step")
    ap.add_argument(
        "--capacity-step-s", type=float, default=30.0, help="seconds per open-loop step (a backlog shows)"
    )
    ap.add_argument(
        "--p99-limit-s", type=float, default=2.0, help="capacity: the highest rate with p99 under"
    )
    ap.add_argument("--max-concurrency", type=int, default=64)
    add_max_tokens(ap, 32)
    ap.add_argument("--sample-s", type=float, default=5.0)
    add_seed(ap)
    ap.add_argument("--request-timeout-s", type=float, default=120.0, help="unanswered by then: lost")
    ap.add_argument("--keep-dir", type=Path, default=None, help="run directory kept afterwards (logs)")
    add_out(ap, RESULTS / "faults" / "soak.json")
    return ap


@dataclass(frozen=True)
class SoakRun:
    """What one run measured: the closed-loop ramp, the capacity search, the soak's rate and its
    `open_loop` result, and the stack's processes that died."""

    peak: dict[str, Any]
    capacity: dict[str, Any]
    rate_rps: float
    soak: dict[str, Any]
    dead: dict[str, int]  # name -> exit code


def run_soak(args: argparse.Namespace) -> SoakRun:
    """Start the stack, find its capacity, soak it at `--load` of it, and stop it."""
    from tests.integration.faults.harness import FaultStack

    with contextlib.ExitStack() as cleanup:
        tmp = args.keep_dir or Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="collm-soak-")))
        fs = FaultStack(Path(tmp), fault_settings=False)
        t0 = time.monotonic()
        fs.start()
        print(f"stack ready in {time.monotonic() - t0:.1f}s: {fs.gateway_url}", flush=True)
        try:
            peak = asyncio.run(closed_loop_peak(fs, args.ramp_step_s, args.max_tokens, args.max_concurrency))
            cap = asyncio.run(
                open_loop_capacity(
                    fs, peak["peak_rps"], args.capacity_step_s, args.max_tokens, args.request_timeout_s,
                    args.p99_limit_s,
                )
            )  # fmt: skip
            rate = args.load * cap["capacity_rps"]
            print(f"capacity {cap['capacity_rps']:.2f} req/s; soak at {rate:.2f} req/s", flush=True)
            res = asyncio.run(
                open_loop(
                    fs, rate, args.duration_s, args.max_tokens, args.request_timeout_s, args.seed,
                    sample_s=args.sample_s, progress_s=60.0,
                )
            )  # fmt: skip
            dead = fs.dead_children()
        finally:
            fs.stop()
    return SoakRun(peak, cap, rate, res, dead)


def soak_result(args: argparse.Namespace, run: SoakRun) -> dict[str, Any]:
    """The result file's content: the run's settings, capacity, counts, errors, latency, per-minute
    figures, RSS growth and samples, and the goals met."""
    from tests.integration.faults.probe import tally

    outcomes: list[Outcome] = run.soak["outcomes"]
    t = tally(outcomes)
    growth = rss_growth(run.soak["rss"], args.duration_s)
    errors = [o for o in outcomes if o.kind != "ok"]
    ok_latency = [o.latency_s for o in outcomes if o.kind == "ok"]
    return {
        "command": command_line(),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "model": "tiny",
        "duration_s": args.duration_s,
        "load_fraction": args.load,
        "max_tokens": args.max_tokens,
        "request_timeout_s": args.request_timeout_s,
        "closed_loop": run.peak,
        "capacity": run.capacity,
        "offered_rps": round(run.rate_rps, 3),
        "completed_rps": round(t["succeeded"] / run.soak["wall_s"], 3),
        "counts": t,
        "errors": len(errors),
        "errors_by_kind": dict(
            collections.Counter(
                f"{o.kind} {o.status} {o.code}: {o.message.split(':')[0][:80]}" for o in errors
            )
        ),
        "error_examples": sorted({f"{o.status} {o.code}: {o.message[:120]}" for o in errors})[:10],
        "e2e_s": {"p50": percentile(ok_latency, 50), "p99": percentile(ok_latency, 99)},
        "per_minute": per_minute(outcomes, args.duration_s),
        "rss_growth": growth,
        "rss_samples": run.soak["rss"],
        "dead_processes": run.dead,
        "goals": {
            "errors == 0": len(errors) == 0,
            "rss growth < 5% for every process": all(
                g["growth_pct"] is not None and g["growth_pct"] < 5.0 for g in growth.values()
            ),
        },
    }


def print_report(result: dict[str, Any], rate_rps: float, out: Path) -> None:
    """The counts, errors, rates (`rate_rps` offered) and latency, the RSS growth table and the goals of
    `result`."""
    t = result["counts"]
    print(f"\nrequests {t['sent']}: ok {t['succeeded']}, clear errors {t['failed_clear']}, lost {t['lost']}")
    print(f"errors by kind: {result['errors_by_kind']}")
    print(f"offered {rate_rps:.2f} req/s, completed {result['completed_rps']} req/s; e2e {result['e2e_s']}")
    print("| process | RSS first minute (MB) | RSS last minute (MB) | growth |")
    print("|---|---|---|---|")
    for name, g in result["rss_growth"].items():
        print(f"| {name} | {g['first_min_mb']} | {g['last_min_mb']} | {g['growth_pct']}% |")
    print(f"goals: {result['goals']}; wrote {out}")


def main(argv: Sequence[str]) -> int:
    """Measure the capacity, soak at `--load` of it, write the result; 1 when a goal is missed."""
    args = build_parser().parse_args(argv)
    run = run_soak(args)
    result = soak_result(args, run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_report(result, run.rate_rps, args.out)
    return 0 if all(result["goals"].values()) and not run.dead else 1
