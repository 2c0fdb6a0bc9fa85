"""The gateway's added latency per request, over a direct NATS request to the same replica.

Starts its own nats-server and redis-server on free ports, one real replica process
(`python -m collm_replica`, the tiny model by default) and one real gateway process
(`python -m collm_gateway`), then sends N requests with max_tokens=1 both ways, alternating so that
drift in the replica hits both sides equally:

* direct: `Bus.stream` of a `GenerateRequest` to `collm.v1.replica.<id>.generate`, timed from the publish
  to the `Finished` event (exactly the gateway's own protocol);
* gateway: `POST /v1/chat/completions` (non-streaming) over a kept-alive HTTP connection, timed from
  the send to the complete JSON body.

Both carry the same chat messages, greedy sampling and max_tokens=1. Prints median and p99 of each,
their difference and ratio, and the median and p99 of the per-pair difference, and writes the same
as JSON under bench/results/gateway/overhead_<model>.json.

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench gateway overhead [--model tiny] \
        [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from collm_bench.groups import RESULTS, add_model, command_line, prog
from collm_common import subjects
from collm_common.bus import Bus
from collm_common.settings import CommonSettings
from collm_common.stats import percentile
from collm_common.wire import decode
from collm_common.wire.inference import (
    GENERATE_EVENT,
    ChatMessage,
    Finished,
    GenerateError,
    GenerateRequest,
    SamplingParams,
)
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_ops.servers import free_port, start_nats, start_redis

GATEWAY_RESULTS = RESULTS / "gateway"
REPLICA_ID = "bench0"
BASE_MODEL = "bench-base"
MESSAGES = [{"role": "user", "content": "Hi"}]


def summary_ms(xs: list[float]) -> dict[str, float]:
    """Median, p99 (`collm_common.stats`), mean, min and max of `xs`, in ms to 3 decimals."""
    return {
        "median_ms": round(statistics.median(xs), 3),
        "p99_ms": round(percentile(xs, 99), 3),
        "mean_ms": round(statistics.fmean(xs), 3),
        "min_ms": round(min(xs), 3),
        "max_ms": round(max(xs), 3),
    }


@contextlib.contextmanager
def process(cmd: list[str], env: dict[str, str], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def service_env(nats_url: str, redis_url: str, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLM_")}
    env.update(
        {
            "COLLM_NATS_URL": nats_url,
            "COLLM_REDIS_URL": redis_url,
            "COLLM_REDIS_PREFIX": "bench",
            "COLLM_LOG_LEVEL": "WARNING",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "OTEL_SDK_DISABLED": "true",
        }
    )
    env.update(extra)
    return env


async def wait_replica(bus: Bus, timeout_s: float) -> ReplicaTelemetry:
    got: asyncio.Future[ReplicaTelemetry] = asyncio.get_running_loop().create_future()

    async def on_telemetry(msg: ReplicaTelemetry, _raw: object) -> None:
        if not got.done():
            got.set_result(msg)

    sub = await bus.subscribe(subjects.telemetry(REPLICA_ID), ReplicaTelemetry, on_telemetry)
    try:
        return await asyncio.wait_for(got, timeout_s)
    finally:
        await sub.unsubscribe()


async def wait_gateway(http: httpx.AsyncClient, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if (await http.get("/readyz")).status_code == 200:
                return
        if time.monotonic() > end:
            raise TimeoutError("the gateway did not become ready")
        await asyncio.sleep(0.1)


async def direct_once(bus: Bus) -> float:
    req = GenerateRequest(
        request_id=f"direct-{uuid.uuid4().hex}",
        messages=[ChatMessage(**m) for m in MESSAGES],  # type: ignore[arg-type]
        sampling=SamplingParams(max_tokens=1, temperature=0.0),
        arrival_unix_s=time.time(),
        deadline_unix_s=time.time() + 60,
    )
    t0 = time.perf_counter()
    async with bus.stream(subjects.replica(REPLICA_ID, "generate"), req) as replies:
        while True:
            event = decode(GENERATE_EVENT, (await replies.next(60.0)).data)
            if isinstance(event, GenerateError):
                raise RuntimeError(f"replica refused: {event.code} {event.message}")
            if isinstance(event, Finished):
                if event.completion_tokens != 1:
                    raise RuntimeError(f"expected 1 token, got {event.completion_tokens}")
                return (time.perf_counter() - t0) * 1000.0


async def gateway_once(http: httpx.AsyncClient) -> float:
    body = {"model": BASE_MODEL, "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = await http.post("/v1/chat/completions", json=body)
    elapsed_ms = (time.perf_counter() - t0) * 1000.0
    if r.status_code != 200:
        raise RuntimeError(f"gateway answered {r.status_code}: {r.text}")
    if r.json()["usage"]["completion_tokens"] != 1:
        raise RuntimeError("expected 1 completion token")
    return elapsed_ms


async def measure(args: argparse.Namespace, work: Path, command: str) -> dict[str, object]:
    """Start NATS, Redis, the replica and the gateway; time the requests both ways; the result."""
    nats = start_nats(workdir=work / "nats")
    redis = start_redis(workdir=work / "redis")
    port = free_port()
    replica_env = service_env(
        nats.url,
        redis.url,
        {"COLLM_REPLICA_ID": REPLICA_ID, "COLLM_MODEL": args.model, "COLLM_TORCH_THREADS": "1"},
    )
    gateway_env = service_env(
        nats.url,
        redis.url,
        {"COLLM_HOST": "127.0.0.1", "COLLM_PORT": str(port), "COLLM_BASE_MODEL": BASE_MODEL},
    )
    try:
        with (
            process([sys.executable, "-m", "collm_replica"], replica_env, work / "replica.log"),
            process([sys.executable, "-m", "collm_gateway"], gateway_env, work / "gateway.log"),
        ):
            bus = await Bus.connect(CommonSettings(nats_url=nats.url), "bench-direct")
            try:
                telemetry = await wait_replica(bus, args.start_timeout_s)
                limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
                async with httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{port}", timeout=60.0, limits=limits
                ) as http:
                    await wait_gateway(http, args.start_timeout_s)
                    for _ in range(args.warmup):
                        await direct_once(bus)
                        await gateway_once(http)
                    direct: list[float] = []
                    via_gateway: list[float] = []
                    for i in range(args.requests):
                        # Alternate which goes first so neither side always follows the other.
                        if i % 2 == 0:
                            direct.append(await direct_once(bus))
                            via_gateway.append(await gateway_once(http))
                        else:
                            via_gateway.append(await gateway_once(http))
                            direct.append(await direct_once(bus))
            finally:
                await bus.close()
    finally:
        nats.stop()
        redis.stop()
    d, g = summary_ms(direct), summary_ms(via_gateway)
    # Each gateway request is paired with the direct one sent next to it: the difference of a pair
    # cancels most of the replica's own drift, so its median is the steadier estimate of the overhead.
    paired = [gw - dr for gw, dr in zip(via_gateway, direct, strict=True)]
    return {
        "bench": "gateway_overhead",
        "model": args.model,
        "replica_model": telemetry.model,
        "requests": args.requests,
        "warmup": args.warmup,
        "max_tokens": 1,
        "direct_nats": d,
        "via_gateway": g,
        "added_ms": {
            "median": round(g["median_ms"] - d["median_ms"], 3),
            "p99": round(g["p99_ms"] - d["p99_ms"], 3),
        },
        "paired_added_ms": {
            "median": round(statistics.median(paired), 3),
            "p99": round(percentile(paired, 99), 3),
        },
        "ratio": {
            "median": round(g["median_ms"] / d["median_ms"], 3),
            "p99": round(g["p99_ms"] / d["p99_ms"], 3),
        },
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "unix_s": int(time.time()),
        "command": command,
    }


def main(argv: Sequence[str]) -> int:
    """Measure, write the result file and print the comparison."""
    p = argparse.ArgumentParser(prog=prog("gateway", "overhead"), description=__doc__.split("\n\n")[0])
    add_model(p, "tiny")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=None, help="JSON output (default bench/results/...)")
    args = p.parse_args(argv)
    logging.getLogger("collm_common.bus").setLevel(logging.ERROR)  # "disconnected" on our own close
    with tempfile.TemporaryDirectory(prefix="collm-bench-") as tmp:
        try:
            command = command_line(["gateway", "overhead", *argv], lock=True)
            result = asyncio.run(measure(args, Path(tmp), command))
        except Exception:
            for name in ("replica.log", "gateway.log"):
                log = Path(tmp) / name
                if log.exists():
                    sys.stderr.write(f"--- {name}\n{log.read_text()[-3000:]}\n")
            raise
    model_tag = Path(args.model).name.replace(".", "_")
    out = args.out or GATEWAY_RESULTS / f"overhead_{model_tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    d, g = result["direct_nats"], result["via_gateway"]
    print(f"gateway overhead, model={args.model}, {args.requests} requests each, max_tokens=1")
    print(f"  direct NATS : median {d['median_ms']:8.2f} ms   p99 {d['p99_ms']:8.2f} ms")  # type: ignore[index]
    print(f"  via gateway : median {g['median_ms']:8.2f} ms   p99 {g['p99_ms']:8.2f} ms")  # type: ignore[index]
    added, ratio = result["added_ms"], result["ratio"]
    print(f"  added       : median {added['median']:8.2f} ms   p99 {added['p99']:8.2f} ms")  # type: ignore[index]
    pa = result["paired_added_ms"]
    print(f"  paired diff : median {pa['median']:8.2f} ms   p99 {pa['p99']:8.2f} ms")  # type: ignore[index]
    print(f"  ratio       : median {ratio['median']:8.3f}      p99 {ratio['p99']:8.3f}")  # type: ignore[index]
    print(f"  written to {out}")
    return 0
