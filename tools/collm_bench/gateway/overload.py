"""Overload: the default stack driven past its capacity, then back.

Starts the stack in-process with the launcher (`collm_ops.launcher.Stack`: own nats-server and
redis-server on free ports, two replicas of the model, no local data so nothing trains, the services'
default settings; each child logs to a file), then sends chat completions (non-streaming, `max_tokens`
32, short prompts, one kept-alive HTTP client) in four phases:

1. capacity: a closed loop of `--concurrency` requests for `--capacity-s`; completed requests per second
   is the capacity C;
2. calm: open-loop Poisson arrivals at 0.5 C for `--calm-s`;
3. overload: Poisson arrivals at `--factor` x C (4 by default) for `--overload-s`;
4. recovery: 0.5 C again for `--recovery-s`, from the moment the overload's arrivals stop (its queued
   requests still ahead of them).

Every request's phase, send time, status, `Retry-After`, error code and latency is kept in memory; the
stack's processes' resident memory (psutil's RSS) is sampled every second. The result (bench/results/gateway/
overload_<model>.json) holds per phase: sent, answered 200, refused 429 (and how many carried
`Retry-After`), 503, other 5xx, client errors and transport failures, the 200s' latency median / p99,
the 429s' latency median; the queue bound (replicas x (max_queue + max_batch)); the largest RSS per
process before and during the overload; and the recovery time: from the end of the overload to the
first second whose requests all answered 200 within the calm phase's p99 latency.

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench gateway overload      # SmolLM2-135M
    COLLM_ADMIT_WAIT_SLO_FACTOR=1 ... gateway overload --label admit-wait  # its own result file
    .venv/bin/python -m collm_bench gateway overload --report   # the table from the result file
"""

from __future__ import annotations

import argparse
import asyncio
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
from typing import Any

import httpx
import psutil

from collm_bench.groups import RESULTS, add_model, add_report, add_seed, command_line, prog
from collm_bench.readme.gateway import overload_table
from collm_common.stats import percentile
from collm_gateway.settings import GatewaySettings
from collm_ops.launcher import ReplicaSpec, Stack, StackConfig
from collm_ops.servers import free_port
from collm_replica.settings import ReplicaSettings

GATEWAY_RESULTS = RESULTS / "gateway"
PROMPTS = ["Hi", "Name a fruit.", "Say something kind.", "What is 2 + 2?", "Tell me a colour."]


@dataclass
class Outcome:
    phase: str
    sent_s: float
    latency_s: float
    status: int  # HTTP status; 0: no response (transport failure)
    retry_after: str | None = None
    code: str | None = None


async def one(client: httpx.AsyncClient, model: str, phase: str, t0: float, out: list[Outcome]) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
        "max_tokens": 32,
    }
    start = time.monotonic()
    try:
        r = await client.post("/v1/chat/completions", json=body)
        code = None
        if r.status_code != 200:
            try:
                code = r.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = "no_envelope"
        out.append(
            Outcome(
                phase, start - t0, time.monotonic() - start, r.status_code, r.headers.get("retry-after"), code
            )
        )
    except httpx.HTTPError as exc:
        out.append(Outcome(phase, start - t0, time.monotonic() - start, 0, None, type(exc).__name__))


async def closed_loop(
    client: httpx.AsyncClient, model: str, concurrency: int, duration_s: float, t0: float, out: list[Outcome]
) -> float:
    end = time.monotonic() + duration_s

    async def worker() -> None:
        while time.monotonic() < end:
            await one(client, model, "capacity", t0, out)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    done = [o for o in out if o.phase == "capacity" and o.status == 200]
    return len(done) / duration_s


async def open_loop(
    client: httpx.AsyncClient,
    model: str,
    phase: str,
    rate: float,
    duration_s: float,
    t0: float,
    out: list[Outcome],
    tasks: list[asyncio.Task[None]],
) -> None:
    """Poisson arrivals for `duration_s`; returns when the arrivals stop (the requests go on in `tasks`)."""
    end = time.monotonic() + duration_s
    while True:
        await asyncio.sleep(random.expovariate(rate))
        if time.monotonic() >= end:
            return
        tasks.append(asyncio.create_task(one(client, model, phase, t0, out)))


def rss_mb(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.Error:
        return None


async def sample_rss(
    stack: Stack, phase: list[str], peaks: dict[str, dict[str, float]], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        pids = {**stack.pids(), **{s.name: s.proc.pid for s in stack.servers}}
        for name, pid in pids.items():
            mb = rss_mb(pid)
            if mb is not None:
                d = peaks.setdefault(phase[0], {})
                d[name] = max(d.get(name, 0.0), mb)
        with_timeout = asyncio.wait_for(stop.wait(), 1.0)
        try:
            await with_timeout
        except TimeoutError:
            pass


def summarize(outs: list[Outcome], phase: str) -> dict[str, Any]:
    xs = [o for o in outs if o.phase == phase]
    ok = [o.latency_s for o in xs if o.status == 200]
    refused = [o for o in xs if o.status == 429]
    return {
        "sent": len(xs),
        "ok_200": len(ok),
        "refused_429": len(refused),
        "refused_429_with_retry_after": sum(1 for o in refused if o.retry_after),
        "unavailable_503": sum(1 for o in xs if o.status == 503),
        "other_5xx": sum(1 for o in xs if o.status >= 500 and o.status != 503),
        "other_4xx": sum(1 for o in xs if 400 <= o.status < 500 and o.status != 429),
        "no_response": sum(1 for o in xs if o.status == 0),
        "codes": sorted({o.code for o in xs if o.code}),
        "ok_latency_s": (
            {"median": round(statistics.median(ok), 3), "p99": round(percentile(ok, 99), 3)} if ok else None
        ),
        "refused_latency_median_s": round(statistics.median([o.latency_s for o in refused]), 4)
        if refused
        else None,
    }


def recovery_s(outs: list[Outcome], overload_end_s: float, calm_p99_s: float) -> float | None:
    """Seconds from the end of the overload to the first one-second bin of the recovery phase whose
    requests (sent then) all answered 200 within the calm phase's p99 latency."""
    rec = sorted((o for o in outs if o.phase == "recovery"), key=lambda o: o.sent_s)
    bins: dict[int, list[Outcome]] = {}
    for o in rec:
        bins.setdefault(int(o.sent_s - overload_end_s), []).append(o)
    for second in sorted(bins):
        if all(o.status == 200 and o.latency_s <= calm_p99_s for o in bins[second]):
            return float(second)
    return None


async def drive(args: argparse.Namespace, stack: Stack, model: str, command: str) -> dict[str, Any]:
    """The four phases against `stack`; the result."""
    outs: list[Outcome] = []
    phase = ["start"]
    peaks: dict[str, dict[str, float]] = {}
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=300.0, limits=limits) as client:
        sampler = asyncio.create_task(sample_rss(stack, phase, peaks, stop))
        t0 = time.monotonic()
        phase[0] = "capacity"
        capacity = await closed_loop(client, model, args.concurrency, args.capacity_s, t0, outs)
        if capacity <= 0:
            raise RuntimeError("no request completed in the capacity phase")
        tasks: list[asyncio.Task[None]] = []
        phase[0] = "calm"
        await open_loop(client, model, "calm", 0.5 * capacity, args.calm_s, t0, outs, tasks)
        phase[0] = "overload"
        await open_loop(client, model, "overload", args.factor * capacity, args.overload_s, t0, outs, tasks)
        overload_end_s = time.monotonic() - t0  # arrivals drop back while the queues still hold requests
        phase[0] = "recovery"
        await open_loop(client, model, "recovery", 0.5 * capacity, args.recovery_s, t0, outs, tasks)
        await asyncio.gather(*tasks)
        stop.set()
        await sampler
    calm = summarize(outs, "calm")
    calm_p99 = (calm["ok_latency_s"] or {}).get("p99") or 1.0
    rs, gs = ReplicaSettings(), GatewaySettings()
    return {
        "model": model,
        "replicas": len(stack.config.replicas),
        "capacity_rps": round(capacity, 3),
        "factor": args.factor,
        "phases_s": {
            "capacity": args.capacity_s,
            "calm": args.calm_s,
            "overload": args.overload_s,
            "recovery": args.recovery_s,
        },  # fmt: skip
        "queue_bound": {
            "max_queue_per_replica": rs.max_queue,
            "max_batch_per_replica": rs.max_batch,
            "requests_held": len(stack.config.replicas) * (rs.max_queue + rs.max_batch),
            "gateway_max_retries": gs.max_retries,
            "retry_after_s": gs.retry_after_s,
        },
        "phases": {p: summarize(outs, p) for p in ("capacity", "calm", "overload", "recovery")},
        # COLLM_* settings the stack inherited from this process (the launcher passes them on).
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("COLLM_")},
        "recovery_s": recovery_s(outs, overload_end_s, calm_p99),
        "rss_mb_peak": {p: {k: round(v, 1) for k, v in sorted(d.items())} for p, d in peaks.items()},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "command": command,
    }


def main(argv: Sequence[str]) -> int:
    """Run the phases on a fresh stack, write the result file, print its table (or only print it)."""
    ap = argparse.ArgumentParser(prog=prog("gateway", "overload"), description=__doc__.split("\n\n")[0])
    add_model(ap, "smollm2")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--factor", type=float, default=4.0)
    ap.add_argument("--capacity-s", type=float, default=40.0)
    ap.add_argument("--calm-s", type=float, default=40.0)
    ap.add_argument("--overload-s", type=float, default=60.0)
    ap.add_argument("--recovery-s", type=float, default=40.0)
    add_seed(ap)
    ap.add_argument("--label", default="", help="result file overload_<model>[_<label>].json")
    add_report(ap)
    args = ap.parse_args(argv)
    path = GATEWAY_RESULTS / f"overload_{args.model}{'_' + args.label if args.label else ''}.json"
    if args.report:
        print(overload_table(json.loads(path.read_text())))
        return 0
    random.seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="collm-overload-") as tmp:
        cfg = StackConfig(
            nats_url=f"nats://127.0.0.1:{free_port()}",
            redis_url=f"redis://127.0.0.1:{free_port()}/0",
            model=args.model,
            gateway_port=free_port(),
            replicas=[ReplicaSpec("r0"), ReplicaSpec("r1")],
            run_dir=Path(tmp) / "run",
            log_dir=Path(tmp) / "logs",
        )
        with Stack(cfg) as stack:
            model = asyncio.run(_base_model(stack.gateway_url))
            command = command_line(["gateway", "overload", *argv], lock=True)
            doc = asyncio.run(drive(args, stack, model, command))
    GATEWAY_RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(overload_table(doc))
    print(f"capacity {doc['capacity_rps']} req/s; recovery {doc['recovery_s']} s; result: {path}")
    return 0


async def _base_model(url: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        models = (await c.get("/v1/models")).json()["data"]
    return str(models[0]["id"])
