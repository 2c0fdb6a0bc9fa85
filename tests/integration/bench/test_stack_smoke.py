"""Smoke run of the load generator against the real stack: NATS, Redis, one tiny-model replica, the gateway.

A 10-second trace replay through `python -m collm_bench loadgen`, exactly as a user runs it. It checks
that every request completes through the real request path, that token counts come from the server's
usage and the served adapter version from its header, and that the summary agrees with the records.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from collm_ops.launcher import ReplicaSpec, Stack, StackConfig
from collm_ops.servers import ServerProcess, free_port
from collm_workload.records import read_records

pytestmark = pytest.mark.integration

SYNTHETIC_TRACE = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(
    f"2023-11-16 18:17:{i:02d}.5000000,{200 + 40 * i},{5 + i % 7}" for i in range(30)
)


@pytest.fixture(scope="module")
def module_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    from collm_ops.servers import start_nats, start_redis

    tmp = tmp_path_factory.mktemp("servers")
    nats, redis = start_nats(workdir=tmp / "nats"), start_redis(workdir=tmp / "redis")
    try:
        yield nats, redis
    finally:
        nats.stop()
        redis.stop()


@pytest.fixture(scope="module")
def stack(
    module_servers: tuple[ServerProcess, ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    nats, redis = module_servers
    logs = io.StringIO()
    cfg = StackConfig(
        nats_url=nats.url,
        redis_url=redis.url,
        redis_prefix="benchsmoke",
        model="tiny",
        gateway_port=free_port(),
        replicas=[ReplicaSpec("r0")],
        with_coordinator=False,
        with_aggregator=False,
        start_servers=False,
        run_dir=tmp_path_factory.mktemp("stack"),
        ready_timeout_s=180,
    )
    s = Stack(cfg, log_sink=logs)
    try:
        s.start()
    except Exception:
        print(logs.getvalue()[-5000:])
        raise
    try:
        yield s
    finally:
        s.stop()


def test_ten_second_replay_against_the_stack(stack: Stack, tmp_path: Path) -> None:
    base = httpx.get(f"{stack.gateway_url}/v1/models", timeout=10).json()["data"][0]["id"]
    trace = tmp_path / "trace.csv"
    trace.write_text(SYNTHETIC_TRACE)
    data = tmp_path / "domains"
    for domain in ("medical", "math"):
        (data / domain).mkdir(parents=True)
        rows = [
            {"prompt": f"A {domain} question, number {i}?", "response": f"Answer {i}."} for i in range(10)
        ]
        (data / domain / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable, "-m", "collm_bench", "loadgen", "--url", stack.gateway_url, "--trace", str(trace),
            "--rate", "1", "--duration", "10", "--domains-dir", str(data), "--mix", "medical=0.5,math=0.5",
            "--model-template", "", "--base-model", base, "--input-scale", "0.1", "--max-input-tokens", "48",
            "--max-output-tokens", "8", "--max-context-tokens", "512", "--slo-ttft-ms", "5000",
            "--slo-tpot-ms", "1000", "--send-slo", "--request-timeout-s", "60", "--out", str(out),
            "--progress-interval-s", "2",
        ],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)  # the summary table, shown with -s
    records = read_records(out / "requests.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    assert len(records) == 10 == summary["counts"]["submitted"]
    assert [r.status for r in records] == ["ok"] * 10, [r.error for r in records]
    for r in records:
        assert r.usage_reported and r.prompt_tokens and r.prompt_tokens > 0
        assert r.completion_tokens == r.max_tokens  # ignore_eos: exactly the trace's (clipped) length
        assert r.adapter_version and r.replica == "r0"
        assert r.ttft_ms is not None and 0 < r.ttft_ms <= r.e2e_ms
    assert summary["counts"]["completed"] == 10
    assert summary["duration_s"] >= 9.0
    assert summary["goodput_rps"] == pytest.approx(summary["counts"]["good"] / summary["duration_s"])
    assert summary["latency_ms"]["ttft"]["count"] == 10
