"""Soak: the whole stack (tiny model) at about 80% of its capacity for a long time; errors and memory.

Starts its own nats-server and redis-server and the stack through the launcher (aggregator with its
built-in rounds, coordinator, two replicas with local data, gateway; every service with its default
settings), then:

1. capacity ramp: closed-loop requests through the gateway at 1, 2, 4, ... concurrent clients for
   `--ramp-step-s` each, until throughput stops growing (< 5% more); capacity = the best completed
   requests per second (this also warms the stack up: batches, allocator, first rounds);
2. soak: open-loop Poisson arrivals at `--load` x capacity for `--duration-s`, alternating streamed and
   plain chat completions of `--max-tokens` tokens (greedy, ignore_eos), each classified as a full
   answer, a clear error or lost (tests/integration/faults/probe.py);
3. every `--sample-s` the RSS of every process (each service, nats-server, redis-server) from /proc.

Reports errors (goal 0) and, per process, RSS growth from the soak's first minute to its last (mean of
the samples in each; goal < 5%), per-minute throughput and latency. Writes bench/results/soak.json.

    flock /tmp/collm-heavy.lock .venv/bin/python bench/faults/soak.py                    # 10 minutes
    .venv/bin/python bench/faults/soak.py --duration-s 120 --ramp-step-s 5              # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.integration.faults.harness import FaultStack  # noqa: E402
from tests.integration.faults.probe import Outcome, one_request, run_load, tally  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PAGE_KB = 1024


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / PAGE_KB
    except OSError:
        return None
    return None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def ramp(fs: FaultStack, step_s: float, max_tokens: int, max_concurrency: int) -> dict[str, Any]:
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
        steps.append({"concurrency": c, "completed_rps": round(rps, 3), **t,
                      "e2e_p50_s": pct([o.latency_s for o in out if o.kind == "ok"], 0.5)})  # fmt: skip
        print(f"ramp: concurrency {c:3d}: {rps:7.2f} req/s ({t})", flush=True)
        if rps < best * 1.05:
            best = max(best, rps)
            break
        best = max(best, rps)
        c *= 2
    return {"steps": steps, "capacity_rps": round(best, 3)}


async def soak(
    fs: FaultStack,
    rate_rps: float,
    duration_s: float,
    max_tokens: int,
    sample_s: float,
    seed: int,
    timeout_s: float,
) -> dict[str, Any]:
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    rss: list[dict[str, Any]] = []
    t_start = time.monotonic()
    t_end = t_start + duration_s
    servers = {"nats-server": fs.nats.proc.pid, "redis-server": fs.redis.proc.pid}  # type: ignore[union-attr]
    tasks: set[asyncio.Task[None]] = set()

    async def sampler() -> None:
        while time.monotonic() < t_end:
            point: dict[str, Any] = {"t_s": round(time.monotonic() - t_start, 2), "in_flight": len(tasks)}
            for name, pid in {**fs.s.pids(), **servers}.items():
                point[name] = rss_mb(pid)
            rss.append(point)
            await asyncio.sleep(sample_s)

    async def progress() -> None:
        while time.monotonic() < t_end:
            await asyncio.sleep(60)
            t = tally(outcomes)
            print(f"soak: {time.monotonic() - t_start:6.0f}s {t}", flush=True)

    limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as http:
        bg = [asyncio.create_task(sampler()), asyncio.create_task(progress())]
        i = 0
        next_s = t_start
        while True:
            next_s += rng.expovariate(rate_rps)
            if next_s >= t_end:
                break
            await asyncio.sleep(max(0.0, next_s - time.monotonic()))

            async def one(i: int = i) -> None:
                o = await one_request(http, fs.gateway_url, fs.base_model, stream=i % 2 == 0,
                                      max_tokens=max_tokens, index=i, timeout_s=timeout_s)  # fmt: skip
                o.sent_s -= t_start
                o.end_s -= t_start
                outcomes.append(o)

            task = asyncio.create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        await asyncio.gather(*tasks)
        for b in bg:
            b.cancel()
    return {"outcomes": outcomes, "rss": rss, "wall_s": time.monotonic() - t_start}


def rss_growth(rss: list[dict[str, Any]], duration_s: float) -> dict[str, dict[str, float | None]]:
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
    rows = []
    for m in range(int(duration_s // 60) + (1 if duration_s % 60 else 0)):
        sel = [o for o in outcomes if m * 60 <= o.sent_s < (m + 1) * 60]
        ok = [o.latency_s for o in sel if o.kind == "ok"]
        rows.append({"minute": m + 1, **tally(sel), "e2e_p50_s": pct(ok, 0.5), "e2e_p99_s": pct(ok, 0.99)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--load", type=float, default=0.8, help="fraction of the measured capacity")
    ap.add_argument("--ramp-step-s", type=float, default=10.0)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--request-timeout-s", type=float, default=120.0, help="a request unanswered by then counts as lost"
    )
    ap.add_argument("--keep-dir", type=Path, default=None, help="run directory kept afterwards (logs)")
    ap.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = ap.parse_args()

    with contextlib.ExitStack() as cleanup:
        tmp = args.keep_dir or Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="collm-soak-")))
        fs = FaultStack(Path(tmp), fault_settings=False)
        t0 = time.monotonic()
        fs.start()
        print(f"stack ready in {time.monotonic() - t0:.1f}s: {fs.gateway_url}", flush=True)
        try:
            cap = asyncio.run(ramp(fs, args.ramp_step_s, args.max_tokens, args.max_concurrency))
            rate = args.load * cap["capacity_rps"]
            print(f"capacity {cap['capacity_rps']:.2f} req/s; soak at {rate:.2f} req/s", flush=True)
            res = asyncio.run(
                soak(
                    fs,
                    rate,
                    args.duration_s,
                    args.max_tokens,
                    args.sample_s,
                    args.seed,
                    args.request_timeout_s,
                )
            )
            dead = fs.dead_children()
        finally:
            fs.stop()
    outcomes: list[Outcome] = res["outcomes"]
    t = tally(outcomes)
    growth = rss_growth(res["rss"], args.duration_s)
    errors = [o for o in outcomes if o.kind != "ok"]
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count()},
        "model": "tiny",
        "duration_s": args.duration_s,
        "load_fraction": args.load,
        "max_tokens": args.max_tokens,
        "request_timeout_s": args.request_timeout_s,
        "capacity": cap,
        "offered_rps": round(rate, 3),
        "completed_rps": round(t["succeeded"] / res["wall_s"], 3),
        "counts": t,
        "errors": len(errors),
        "errors_by_kind": dict(
            collections.Counter(
                f"{o.kind} {o.status} {o.code}: {o.message.split(':')[0][:80]}" for o in errors
            )
        ),
        "error_examples": sorted({f"{o.status} {o.code}: {o.message[:120]}" for o in errors})[:10],
        "e2e_s": {
            "p50": pct([o.latency_s for o in outcomes if o.kind == "ok"], 0.5),
            "p99": pct([o.latency_s for o in outcomes if o.kind == "ok"], 0.99),
        },  # fmt: skip
        "per_minute": per_minute(outcomes, args.duration_s),
        "rss_growth": growth,
        "rss_samples": res["rss"],
        "dead_processes": dead,
        "goals": {
            "errors == 0": len(errors) == 0,
            "rss growth < 5% for every process": all(
                g["growth_pct"] is not None and g["growth_pct"] < 5.0 for g in growth.values()
            ),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\nrequests {t['sent']}: ok {t['succeeded']}, clear errors {t['failed_clear']}, lost {t['lost']}")
    print(f"offered {rate:.2f} req/s, completed {result['completed_rps']} req/s; e2e {result['e2e_s']}")
    print("| process | RSS first minute (MB) | RSS last minute (MB) | growth |")
    print("|---|---|---|---|")
    for name, g in growth.items():
        print(f"| {name} | {g['first_min_mb']} | {g['last_min_mb']} | {g['growth_pct']}% |")
    print(f"goals: {result['goals']}; wrote {args.out}")
    return 0 if all(result["goals"].values()) and not dead else 1


if __name__ == "__main__":
    sys.exit(main())
