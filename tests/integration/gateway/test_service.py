"""The gateway as a service: NATS micro (`collm-gateway`), its status endpoint, metrics, and the process."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from collm_common import subjects
from collm_common.wire.gateway import GatewayStatus, GatewayStatusRequest
from collm_ops.servers import free_port

from .conftest import BASE_MODEL, eventually

pytestmark = pytest.mark.integration


async def test_micro_ping_info_stats_and_status(gateway, replicas, replica_bus) -> None:
    await replicas("r0", adapters={"medical": 2}, running=3, max_batch=8)
    await gateway.wait_replicas("r0")
    nc = replica_bus.nc
    ping = json.loads((await nc.request("$SRV.PING.collm-gateway", b"", timeout=2)).data)
    assert ping["name"] == subjects.SERVICE_GATEWAY and ping["metadata"]["gateway_id"] == "gw-test"
    info = json.loads((await nc.request("$SRV.INFO.collm-gateway", b"", timeout=2)).data)
    assert [e["subject"] for e in info["endpoints"]] == [subjects.gateway("status")]
    status = await replica_bus.request(subjects.gateway("status"), GatewayStatusRequest(), GatewayStatus)
    assert status.base_model == BASE_MODEL and status.gateway_id == "gw-test"
    (r0,) = status.replicas
    assert (r0.replica_id, r0.fresh, r0.running, r0.max_batch) == ("r0", True, 3, 8)
    assert r0.adapters == {"medical": "medical@v2"} and r0.model == "double"
    stats = json.loads((await nc.request("$SRV.STATS.collm-gateway", b"", timeout=2)).data)
    assert stats["endpoints"][0]["num_requests"] == 1


async def test_metrics_record_requests_latencies_and_replica_choice(gateway, replicas) -> None:
    await replicas("r0")
    await gateway.wait_replicas("r0")
    await gateway.openai.chat.completions.create(
        model=BASE_MODEL, messages=[{"role": "user", "content": "x"}]
    )
    await gateway.http.post(
        "/v1/chat/completions", json={"model": "ghost", "messages": [{"role": "user", "content": "x"}]}
    )
    text = (await gateway.http.get("/metrics")).text
    assert 'collm_gateway_requests_total{adapter_version="base",model="collm-test-base",status="200"}' in text
    assert 'collm_gateway_requests_total{adapter_version="none",model="unknown",status="404"}' in text
    for name in (
        "collm_gateway_ttft_seconds_bucket",
        "collm_gateway_tpot_seconds_bucket",
        "collm_gateway_e2e_seconds_bucket",
    ):
        assert f'{name}{{adapter_version="base",le="+Inf",model="collm-test-base"}}' in text
    assert 'collm_gateway_replica_choice_total{replica="r0",source="least_loaded"}' in text
    assert "collm_gateway_in_flight_requests 0.0" in text


def _wait_http(url: str, timeout_s: float = 30.0) -> httpx.Response:
    end = time.monotonic() + timeout_s
    while True:
        try:
            return httpx.get(url, timeout=1.0)
        except httpx.HTTPError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def test_python_m_collm_gateway_serves_and_stops_cleanly(
    nats_server, redis_server, redis_prefix, tmp_path
) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLM_")}
    env.update(
        {
            "COLLM_NATS_URL": nats_server.url,
            "COLLM_REDIS_URL": redis_server.url,
            "COLLM_REDIS_PREFIX": redis_prefix,
            "COLLM_HOST": "127.0.0.1",
            "COLLM_PORT": str(port),
            "COLLM_BASE_MODEL": BASE_MODEL,
            "COLLM_GATEWAY_ID": "gw-proc",
            "OTEL_SDK_DISABLED": "true",
        }
    )
    log_path = tmp_path / "gateway.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "collm_gateway"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        assert _wait_http(f"http://127.0.0.1:{port}/healthz").status_code == 200
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": BASE_MODEL, "messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 503 and r.headers["retry-after"]
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["id"] == BASE_MODEL
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    request_lines = [d for d in lines if d.get("logger") == "collm_gateway.requests"]
    assert (
        request_lines and request_lines[0]["status"] == 503 and request_lines[0]["service"] == "collm-gateway"
    )


def test_invalid_settings_exit_2(nats_server) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLM_")}
    env.update({"COLLM_NATS_URL": nats_server.url, "COLLM_PORT": "not-a-port"})
    proc = subprocess.run([sys.executable, "-m", "collm_gateway"], env=env, capture_output=True, timeout=60)
    assert proc.returncode == 2 and b"port" in proc.stderr


async def test_eventually_helper_times_out() -> None:
    with pytest.raises(AssertionError, match="never"):
        await eventually(lambda: False, timeout_s=0.05, what="never")
