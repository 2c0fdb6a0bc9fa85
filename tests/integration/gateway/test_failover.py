"""A replica lost after accepting a request but before its first token: the gateway moves the request to
another replica and the client gets a normal answer; with no other replica, a clear 503 `replica_lost`.
A replica that answers 503 after accepting (shutting down) is treated the same way. (A replica lost
after its first token: tests/integration/gateway/test_failures.py; with real processes:
tests/integration/faults.)"""

import asyncio
import json

import httpx
import pytest
from doubles.replica import ReplicaBehaviour

from .conftest import BASE_MODEL, eventually

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "hi"}]
CHAT = {"model": BASE_MODEL, "messages": MSGS}
FAST_LOSS = {"telemetry_stale_s": 0.4, "telemetry_stale_intervals": 1.0, "inter_token_timeout_s": 30}
# Accepts, then keeps the first token for 30 s: the replica dies in between.
STUCK = ReplicaBehaviour(token_delay_s=30.0)


def sse_events(raw: str) -> list[str]:
    return [e[len("data: ") :] for e in raw.split("\n\n") if e.startswith("data: ")]


async def retries(gw, reason: str) -> float:
    """`collm_gateway_retries_total{reason}` (the counter is process-wide: compare before and after)."""
    text = (await gw.http.get("/metrics")).text
    line = f'collm_gateway_retries_total{{reason="{reason}"}} '
    return sum(float(x[len(line) :]) for x in text.splitlines() if x.startswith(line))


async def _dies_after_accepting(gw, replica, stream: bool) -> httpx.Response:
    """Send one chat request, stop `replica` once it has accepted it, return the whole response."""
    task = asyncio.create_task(gw.http.post("/v1/chat/completions", json={**CHAT, "stream": stream}))
    await eventually(lambda: len(replica.requests) == 1, what="the request to reach the replica")
    await asyncio.sleep(0.1)  # Accepted is on its way to the gateway
    await replica.stop()
    return await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
async def test_request_moves_to_another_replica_when_its_replica_dies_before_the_first_token(
    make_gateway, replicas, stream: bool
) -> None:
    async with make_gateway(**FAST_LOSS) as gw:
        r0 = await replicas("r0", STUCK, telemetry_interval_s=0.1)
        r1 = await replicas("r1", running=4, telemetry_interval_s=0.1)  # busier: r0 is ranked first
        await gw.wait_replicas("r0", "r1")
        before = await retries(gw, "lost_before_first_token")
        r = await _dies_after_accepting(gw, r0, stream)
        assert r.status_code == 200
        assert [q.request_id for q in r1.requests] == [r0.requests[0].request_id]
        if stream:
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert not any("error" in c for c in chunks), chunks
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            assert text == "Hello, world!"
            # Every chunk names the replica that generated it; the headers left with the first one.
            assert {c["system_fingerprint"] for c in chunks} == {"r1/base"}
            assert r.headers["x-collm-replica"] == "r0"
        else:
            body = r.json()
            assert body["choices"][0]["message"]["content"] == "Hello, world!"
            assert body["system_fingerprint"] == "r1/base" and r.headers["x-collm-replica"] == "r1"
        assert await retries(gw, "lost_before_first_token") == before + 1


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
async def test_no_other_replica_is_a_clear_503(make_gateway, replicas, stream: bool) -> None:
    async with make_gateway(**FAST_LOSS) as gw:
        r0 = await replicas("r0", STUCK, telemetry_interval_s=0.1)
        await gw.wait_replicas("r0")
        r = await _dies_after_accepting(gw, r0, stream)
        if stream:
            assert r.status_code == 200
            events = sse_events(r.text)
            assert events[-1] == "[DONE]" and len(events) == 2, events
            err = json.loads(events[0])["error"]
        else:
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            err = r.json()["error"]
        assert err["code"] == "replica_lost" and err["type"] == "service_unavailable_error"
        assert "r0 was lost before the first token" in err["message"]
        assert "no other replica could take the request" in err["message"]


async def test_503_after_accepting_moves_the_request_too(make_gateway, replicas) -> None:
    async with make_gateway() as gw:
        shutting = ReplicaBehaviour(
            fail_after_chunks=0, fail_code=503, fail_message="the replica is shutting down"
        )
        r0 = await replicas("r0", shutting)
        r1 = await replicas("r1", running=4)
        await gw.wait_replicas("r0", "r1")
        before = await retries(gw, "refused_503_after_accept")
        r = await gw.http.post("/v1/chat/completions", json={**CHAT, "stream": True})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
        assert len(r0.requests) == 1 and len(r1.requests) == 1
        assert json.loads(events[0])["system_fingerprint"] == "r1/base"
        assert await retries(gw, "refused_503_after_accept") == before + 1


async def test_an_error_after_accepting_that_is_not_a_refusal_is_not_retried(make_gateway, replicas) -> None:
    async with make_gateway() as gw:
        r0 = await replicas("r0", ReplicaBehaviour(fail_after_chunks=0))  # 500: the replica broke
        r1 = await replicas("r1", running=4)
        await gw.wait_replicas("r0", "r1")
        r = await gw.http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 502 and "mid-stream" in r.json()["error"]["message"]
        assert len(r0.requests) == 1 and r1.requests == []
