"""The load generator's client and open-loop runner against a scripted OpenAI-compatible server.

The server (tests/doubles/scripted_openai_server.py) paces tokens by a script per model name, so the
measured TTFT, TPOT and ITL can be checked against known delays, and each failure mode against the
status it must produce.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from doubles.scripted_openai_server import Behaviour, ScriptedOpenAIServer

from collm_bench.client import ClientOptions, endpoint_url, new_record, send_request
from collm_bench.runner import run_plan
from collm_workload.goodput import summarize
from collm_workload.records import RequestRecord, read_records
from collm_workload.workload import PlannedRequest

pytestmark = pytest.mark.integration

BEHAVIOURS = {
    "paced": Behaviour(ttft_s=0.2, itl_s=0.03, adapter_version="medical@v3", replica="r7"),
    "fingerprint": Behaviour(fingerprint="r1/math@v2+r1.4"),
    "http500": Behaviour(http_status=500),
    "http429": Behaviour(http_status=429),
    "http503": Behaviour(http_status=503),
    "midstream": Behaviour(error_after_tokens=2),
    "stall": Behaviour(stall_after_tokens=1),
    "truncated": Behaviour(truncate_after_tokens=2),
    "nousage": Behaviour(usage=False),
    "json": Behaviour(json_answer=True, ttft_s=0.05),
    "slow": Behaviour(ttft_s=0.5),
}


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedOpenAIServer]:
    srv = ScriptedOpenAIServer(behaviours=BEHAVIOURS).start()
    try:
        yield srv
    finally:
        srv.stop()


def planned(model: str, index: int = 0, scheduled_s: float = 0.0, max_tokens: int = 6) -> PlannedRequest:
    return PlannedRequest(
        request_id=f"r{index:06d}",
        index=index,
        scheduled_s=scheduled_s,
        domain="medical",
        model=model,
        prompt="What are the symptoms of anemia?",
        target_input_tokens=10,
        estimated_input_tokens=10,
        max_tokens=max_tokens,
        slo_ttft_ms=1000.0,
        slo_tpot_ms=100.0,
    )


async def one(server: ScriptedOpenAIServer, p: PlannedRequest, **opts: object) -> RequestRecord:
    endpoint = opts.pop("endpoint", "chat")
    o = ClientOptions(url=endpoint_url(server.url, endpoint), endpoint=endpoint, **opts)  # type: ignore[arg-type]
    rec = new_record(p)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with httpx.AsyncClient(trust_env=False, timeout=None) as http:
        await send_request(http, p, o, rec, lambda: loop.time() - t0)
    return rec


async def test_streamed_request_measures_ttft_tpot_itl_and_usage(server: ScriptedOpenAIServer) -> None:
    rec = await one(server, planned("paced"), send_slo=True)
    assert rec.status == "ok", rec.error
    # 0.2 s before the first token; 5 gaps of 0.03 s after it.
    assert 195 <= rec.ttft_ms <= 700
    assert len(rec.itl_ms) == 5 and all(x >= 25 for x in rec.itl_ms)
    assert rec.completion_tokens == 6 and rec.prompt_tokens == 17 and rec.usage_reported
    tpot = (rec.e2e_ms - rec.ttft_ms) / 5
    assert 28 <= tpot <= 150
    assert rec.e2e_ms >= rec.ttft_ms + 140
    assert rec.adapter_version == "medical@v3" and rec.replica == "r7"
    assert rec.finish_reason == "length" and rec.text_chunks == 6
    body = server.received[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["slo"] == {"ttft_ms": 1000.0, "tpot_ms": 100.0}
    assert body["ignore_eos"] is True and body["max_tokens"] == 6
    assert body["messages"] == [{"role": "user", "content": "What are the symptoms of anemia?"}]


async def test_slo_is_not_sent_unless_enabled(server: ScriptedOpenAIServer) -> None:
    rec = await one(server, planned("fingerprint"), ignore_eos=False, extra_body={"top_p": 0.9})
    assert rec.status == "ok"
    body = server.received[-1]
    assert "slo" not in body and "ignore_eos" not in body and body["top_p"] == 0.9
    # No header: the served version comes from system_fingerprint.
    assert rec.adapter_version == "math@v2+r1.4"


async def test_completions_endpoint(server: ScriptedOpenAIServer) -> None:
    rec = await one(server, planned("paced", max_tokens=3), endpoint="completions")
    assert rec.status == "ok" and rec.completion_tokens == 3 and len(rec.itl_ms) == 2
    assert server.received[-1]["prompt"] == "What are the symptoms of anemia?"


@pytest.mark.parametrize(
    ("model", "status", "fragment"),
    [
        ("http500", "error", "HTTP 500: scripted 500"),
        ("http429", "rejected", "HTTP 429"),
        ("http503", "rejected", "HTTP 503"),
        ("midstream", "error", "scripted failure mid-stream"),
        ("truncated", "error", "stream ended before"),
    ],
)
async def test_failures_become_statuses(
    server: ScriptedOpenAIServer, model: str, status: str, fragment: str
) -> None:
    rec = await one(server, planned(model))
    assert rec.status == status
    assert fragment in (rec.error or "")
    assert rec.end_s is not None


async def test_stalled_stream_times_out(server: ScriptedOpenAIServer) -> None:
    rec = await one(server, planned("stall"), request_timeout_s=0.5)
    assert rec.status == "timeout"
    assert rec.first_token_s is not None and rec.text_chunks == 1
    assert 0.45 <= rec.end_s - rec.sent_s <= 3.0


async def test_missing_usage_falls_back_to_chunk_count(server: ScriptedOpenAIServer) -> None:
    rec = await one(server, planned("nousage", max_tokens=4))
    assert rec.status == "ok" and not rec.usage_reported
    assert rec.completion_tokens == 4 and rec.prompt_tokens is None


async def test_plain_json_answer_is_measured(server: ScriptedOpenAIServer) -> None:
    rec = await one(server, planned("json", max_tokens=5))
    assert rec.status == "ok" and rec.completion_tokens == 5 and rec.usage_reported
    assert rec.ttft_ms == rec.e2e_ms and rec.ttft_ms >= 45


async def test_connection_refused_is_an_error() -> None:
    from collm_ops.servers import free_port

    p = planned("paced")
    o = ClientOptions(url=endpoint_url(f"http://127.0.0.1:{free_port()}", "chat"))
    rec = new_record(p)
    async with httpx.AsyncClient(trust_env=False) as http:
        await send_request(http, p, o, rec, lambda: 0.0)
    assert rec.status == "error" and "ConnectError" in (rec.error or "")


async def test_open_loop_sends_on_schedule_while_server_is_slow(server: ScriptedOpenAIServer) -> None:
    # Each answer takes >= 0.5 s but arrivals every 0.1 s: open loop never waits for completions.
    plan = [planned("slow", i, 0.1 * i, max_tokens=2) for i in range(5)]
    opts = ClientOptions(url=endpoint_url(server.url, "chat"))
    got: list[RequestRecord] = []
    res = await run_plan(plan, opts, on_record=got.append, progress_interval_s=None)
    assert [r.status for r in res.records] == ["ok"] * 5 and len(got) == 5
    for r in res.records:
        assert r.sent_s is not None and abs(r.sent_s - r.scheduled_s) < 0.3
        assert r.ttft_ms >= 480
    # Later requests were sent before earlier ones finished.
    assert res.records[4].sent_s < res.records[0].end_s


async def test_max_concurrency_queues_locally_and_records_the_wait(server: ScriptedOpenAIServer) -> None:
    plan = [planned("slow", i, 0.0, max_tokens=1) for i in range(3)]
    opts = ClientOptions(url=endpoint_url(server.url, "chat"))
    res = await run_plan(plan, opts, max_concurrency=1, progress_interval_s=None)
    by_wait = sorted(res.records, key=lambda r: r.client_wait_ms)
    assert all(r.status == "ok" for r in by_wait)
    assert by_wait[0].client_wait_ms < 300
    assert by_wait[1].client_wait_ms >= 450 and by_wait[2].client_wait_ms >= 950
    # TTFT is measured from the send, not from the schedule: the last one's (~0.5 s) is below its wait.
    assert by_wait[2].ttft_ms < by_wait[2].client_wait_ms


async def test_drain_timeout_ends_stalled_and_queued_requests(server: ScriptedOpenAIServer) -> None:
    plan = [planned("stall", 0, 0.0), planned("paced", 1, 0.0)]
    opts = ClientOptions(url=endpoint_url(server.url, "chat"), request_timeout_s=60)
    res = await run_plan(plan, opts, max_concurrency=1, drain_timeout_s=0.5, progress_interval_s=None)
    statuses = {r.model: r.status for r in res.records}
    assert statuses == {"stall": "timeout", "paced": "dropped"}
    assert res.wall_s < 5
    s = summarize(res.records)
    assert s["counts"]["good"] == 0 and s["attainment"] == 0.0
    assert s["duration_s"] >= 0.5


async def test_stop_event_interrupts_the_run(server: ScriptedOpenAIServer) -> None:
    plan = [planned("paced", i, 0.2 * i) for i in range(20)]
    opts = ClientOptions(url=endpoint_url(server.url, "chat"))
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.5, stop.set)
    res = await run_plan(plan, opts, stop=stop, progress_interval_s=None)
    assert res.interrupted and 2 <= len(res.records) <= 5
    assert all(r.status in ("ok", "timeout", "dropped") for r in res.records)


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "collm_bench", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_cli_loadgen_and_summarize(server: ScriptedOpenAIServer, tmp_path: Path) -> None:
    data = tmp_path / "data"
    for domain in ("medical", "math"):
        (data / domain).mkdir(parents=True)
        rows = [{"prompt": f"{domain} question {i}?", "response": f"answer {i}"} for i in range(20)]
        (data / domain / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "run"
    proc = _run_cli(
        "loadgen", "--url", server.url, "--arrivals", "poisson", "--rate", "8", "--duration", "1.5",
        "--input-tokens", "40", "--output-tokens", "4", "--domains-dir", str(data),
        "--mix", "medical=0.5,math=0.5", "--model-map", "medical=paced,math=http500",
        "--slo-ttft-ms", "1000", "--slo-tpot-ms", "200", "--send-slo", "--out", str(out),
        "--progress-interval-s", "0.5", "--seed", "3",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "[collm-bench]" in proc.stderr  # progress lines
    summary = json.loads((out / "summary.json").read_text())
    records = read_records(out / "requests.jsonl")
    assert summary["schema"] == "collm-bench-summary/1"
    assert summary["counts"]["submitted"] == len(records) >= 4
    by_model = {r.model for r in records}
    assert by_model == {"paced", "http500"}
    for r in records:
        assert r.status == ("ok" if r.model == "paced" else "error")
    good = sum(1 for r in records if r.status == "ok")
    assert summary["counts"]["good"] == good
    assert summary["attainment"] == pytest.approx(good / len(records))
    assert summary["goodput_rps"] == pytest.approx(good / summary["duration_s"])
    assert summary["run"]["models"] == {"medical": "paced", "math": "http500"}
    assert summary["by_version"] == {"medical@v3": {"completed": good, "good": good}}
    assert summary["by_replica"] == {"r7": {"completed": good, "good": good}}
    # Re-score with a TTFT SLO below the scripted 0.2 s: nothing is good any more.
    proc = _run_cli(
        "summarize", str(out / "requests.jsonl"), "--slo-ttft-ms", "100", "--out", str(tmp_path / "s.json")
    )
    assert proc.returncode == 0, proc.stderr
    rescored = json.loads((tmp_path / "s.json").read_text())
    assert rescored["counts"]["good"] == 0
    assert rescored["counts"]["not_good_by_reason"]["ttft"] == good


def test_cli_rejects_bad_input(tmp_path: Path) -> None:
    proc = _run_cli(
        "loadgen", "--mix", "medical=abc", "--out", str(tmp_path), "--arrivals", "poisson", "--rate", "1"
    )
    assert proc.returncode == 2 and "weight must be a number" in proc.stderr
    proc = _run_cli("loadgen", "--trace", "nope", "--out", str(tmp_path))
    assert proc.returncode == 2 and "neither a file nor one of" in proc.stderr
