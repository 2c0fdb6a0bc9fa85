"""Refusals, retries, timeouts, broken streams, disconnects and bad input: always a clear answer."""

import asyncio
import json

import httpx
import openai
import pytest
from doubles.replica import ReplicaBehaviour

from collm_gateway import __version__

from .conftest import BASE_MODEL, eventually

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "hi"}]
CHAT = {"model": BASE_MODEL, "messages": MSGS}


def sse_events(raw: str) -> list[str]:
    return [e[len("data: ") :] for e in raw.split("\n\n") if e.startswith("data: ")]


async def test_no_replica_is_503_with_retry_after(gateway) -> None:
    r = await gateway.http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == "no_replica_available" and err["type"] == "service_unavailable_error"
    ready = await gateway.http.get("/readyz")
    assert ready.status_code == 503 and "retry-after" in ready.headers
    assert (await gateway.http.get("/healthz")).status_code == 200
    health = await gateway.http.get("/health")  # vLLM's: serving, or not
    assert health.status_code == 503 and health.json()["error"]["code"] == "no_replica_available"
    assert (await gateway.http.get("/version")).json() == {"version": __version__}


async def test_readyz_follows_telemetry_freshness(make_gateway, replicas) -> None:
    async with make_gateway(telemetry_stale_s=0.4, telemetry_stale_intervals=1.0) as gw:
        r0 = await replicas("r0", telemetry_interval_s=0.1)
        await gw.wait_replicas("r0")
        ready = await gw.http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["replicas"] == ["r0"]
        health = await gw.http.get("/health")
        assert health.status_code == 200 and health.content == b""
        await r0.stop_telemetry()
        await eventually(lambda: not gw.state.cluster.fresh_replicas(), what="r0 to go stale")
        assert (await gw.http.get("/readyz")).status_code == 503
        # a stale replica is never routed to, even though it would still answer
        assert (await gw.http.post("/v1/chat/completions", json=CHAT)).status_code == 503
        assert r0.requests == []


@pytest.mark.parametrize(
    "refusal",
    [
        ReplicaBehaviour(refuse_code=429, refuse_message="queue full"),
        ReplicaBehaviour(refuse_code=503, refuse_message="draining"),
        ReplicaBehaviour(error_reply_code=503, refuse_message="overloaded"),
        ReplicaBehaviour(silent=True),
    ],
    ids=["generate_error_429", "generate_error_503", "micro_error_reply_503", "silent"],
)
async def test_refusal_before_acceptance_is_retried_on_another_replica(
    make_gateway, replicas, refusal: ReplicaBehaviour
) -> None:
    async with make_gateway(first_event_timeout_s=0.3) as gw:
        busy = await replicas("r0", refusal, running=0)
        good = await replicas("r1", running=4)  # more loaded, so r0 is ranked first
        await gw.wait_replicas("r0", "r1")
        raw = await gw.openai.chat.completions.with_raw_response.create(model=BASE_MODEL, messages=MSGS)
        assert raw.parse().choices[0].message.content == "Hello, world!"
        assert raw.headers["x-collm-replica"] == "r1"
        assert len(busy.requests) == 1 and len(good.requests) == 1
        assert busy.requests[0].request_id == good.requests[0].request_id
        if refusal.silent:  # the silent replica is told to drop it, in case it wakes up later
            await eventually(lambda: len(busy.cancels) == 1, what="cancel to the silent replica")
            assert busy.cancels[0].reason == "accept_timeout"
        metrics = (await gw.http.get("/metrics")).text
        assert "collm_gateway_retries_total" in metrics


async def test_all_queues_full_is_429_with_retry_after(make_gateway, replicas) -> None:
    async with make_gateway(max_retries=5) as gw:
        for rid in ("r0", "r1", "r2"):
            await replicas(rid, ReplicaBehaviour(refuse_code=429))
        await gw.wait_replicas("r0", "r1", "r2")
        r = await gw.http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full" and "(3)" in r.json()["error"]["message"]


async def test_retries_are_bounded(make_gateway, replicas) -> None:
    async with make_gateway(max_retries=1) as gw:
        doubles = [await replicas(f"r{i}", ReplicaBehaviour(refuse_code=503)) for i in range(4)]
        await gw.wait_replicas(*(d.replica_id for d in doubles))
        r = await gw.http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert sum(len(d.requests) for d in doubles) == 2


async def test_no_retry_for_a_refusal_that_is_the_requests_fault(make_gateway, replicas) -> None:
    async with make_gateway() as gw:
        r0 = await replicas("r0", ReplicaBehaviour(max_prompt_chars=10), running=0)
        r1 = await replicas("r1", ReplicaBehaviour(max_prompt_chars=10), running=4)
        await gw.wait_replicas("r0", "r1")
        with pytest.raises(openai.BadRequestError) as err:
            await gw.openai.chat.completions.create(
                model=BASE_MODEL, messages=[{"role": "user", "content": "x" * 50}]
            )
        assert err.value.status_code == 400
        assert "50" in err.value.message and "10" in err.value.message  # the limits are in the message
        assert len(r0.requests) + len(r1.requests) == 1


async def test_unknown_adapter_at_the_replica_is_404(gateway, replicas, store) -> None:
    await store.publish("legal", b"b", expected_current=None, base_model=BASE_MODEL, source="create")
    await replicas("r0", adapters={})  # the replica does not know it
    await gateway.wait_replicas("r0")
    r = await gateway.http.post("/v1/chat/completions", json={**CHAT, "model": "legal"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


async def test_lost_chunk_fails_the_stream_clearly_and_cancels(gateway, replicas) -> None:
    r0 = await replicas("r0", ReplicaBehaviour(skip_seq=2, token_delay_s=0.02))
    await gateway.wait_replicas("r0")
    async with gateway.http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        assert resp.status_code == 200
        events = sse_events((await resp.aread()).decode())
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_protocol_error" and "expected chunk seq 2, got 3" in error["message"]
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert text == "Hello,"  # what arrived before the hole, nothing after it
    await eventually(lambda: len(r0.cancels) == 1, what="cancel after the broken stream")
    # non-streaming: the same hole is a 502 envelope
    r = await gateway.http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 502 and "seq" in r.json()["error"]["message"]


async def test_mid_stream_replica_error_is_an_error_event(gateway, replicas) -> None:
    await replicas("r0", ReplicaBehaviour(fail_after_chunks=1))
    await gateway.wait_replicas("r0")
    async with gateway.http.stream(
        "POST", "/v1/completions", json={"model": BASE_MODEL, "prompt": "p", "stream": True}
    ) as resp:
        events = sse_events((await resp.aread()).decode())
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and "mid-stream" in err["message"]
    with pytest.raises(openai.APIError):  # the official client raises on the error event
        stream = await gateway.openai.completions.create(model=BASE_MODEL, prompt="p", stream=True)
        async for _ in stream:
            pass


async def test_first_token_timeout_is_504_and_cancels(make_gateway, replicas) -> None:
    async with make_gateway(first_token_timeout_s=0.3) as gw:
        r0 = await replicas("r0", ReplicaBehaviour(token_delay_s=5.0))
        await gw.wait_replicas("r0")
        r = await gw.http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert "no token within" in r.json()["error"]["message"]
        await eventually(lambda: len(r0.cancels) == 1, what="cancel after the timeout")


async def test_inter_token_timeout_mid_stream(make_gateway, replicas) -> None:
    async with make_gateway(inter_token_timeout_s=0.2) as gw:
        await replicas("r0", ReplicaBehaviour(token_delay_s=0.5, tokens=["a", "b"]))
        await gw.wait_replicas("r0")
        # the first token is within first_token_timeout_s; the gap to the second exceeds 0.2 s
        async with gw.http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            events = sse_events((await resp.aread()).decode())
        assert json.loads(events[-2])["error"]["code"] == "timeout"


async def test_client_disconnect_cancels_the_generation(make_served_gateway, replicas) -> None:
    async with make_served_gateway() as gw:
        r0 = await replicas("r0", ReplicaBehaviour(tokens=["t"] * 200, token_delay_s=0.02))
        await gw.wait_replicas("r0")
        async with httpx.AsyncClient(base_url=gw.base_url) as client:
            body = {**CHAT, "stream": True, "max_tokens": 200}
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.aiter_lines()
                while "delta" not in (await anext(lines)):
                    pass
        await eventually(lambda: len(r0.cancels) == 1, timeout_s=5, what="cancel after the disconnect")
        assert r0.cancels[0].request_id == r0.requests[0].request_id
        assert r0.cancels[0].reason == "client_disconnected"
        await eventually(lambda: len(r0.finished) == 1, what="the double to stop")
        assert r0.finished[0].finish_reason == "cancelled" and r0.finished[0].completion_tokens < 200
        metrics = (await gw.http.get("/metrics")).text
        assert (
            'collm_gateway_requests_total{adapter_version="base",model="collm-test-base",status="499"}'
            in metrics
        )


async def test_non_streaming_client_disconnect_cancels_too(make_served_gateway, replicas) -> None:
    async with make_served_gateway() as gw:
        # A generation long enough (20 s) that it cannot finish before the disconnect on a loaded machine.
        r0 = await replicas("r0", ReplicaBehaviour(tokens=["t"] * 1000, token_delay_s=0.02))
        await gw.wait_replicas("r0")
        async with httpx.AsyncClient(base_url=gw.base_url) as client:
            task = asyncio.create_task(client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1000}))
            await eventually(lambda: len(r0.requests) == 1, what="the request to reach the replica")
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await eventually(lambda: len(r0.cancels) == 1, timeout_s=5, what="cancel after the disconnect")
        assert r0.cancels[0].reason == "client_disconnected"


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"model": "m"}', 400, "messages"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
            400,
            "max_tokens",
        ),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}', 400, "n"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}',
            400,
            "tool_choice",
        ),
        (b'{"model": 5, "messages": []}', 400, "model"),
        (b"[]", 400, ""),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "maybe"}', 400, "stream"),
    ],
)
async def test_bad_input_is_400_in_the_envelope(gateway, body: bytes, status: int, needle: str) -> None:
    r = await gateway.http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert needle in err["message"]


async def test_body_too_large_is_413(make_gateway) -> None:
    async with make_gateway(max_body_bytes=2048) as gw:
        big = {"model": BASE_MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
        r = await gw.http.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


async def test_unknown_route_and_method_keep_the_envelope(gateway) -> None:
    r = await gateway.http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = await gateway.http.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


async def test_chunked_body_too_large_is_413(make_gateway) -> None:
    async with make_gateway(max_body_bytes=2048) as gw:

        async def chunks():
            for _ in range(10):
                yield b" " * 1000

        r = await gw.http.post(
            "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


async def test_streaming_request_refused_before_acceptance_is_a_plain_http_error(gateway) -> None:
    r = await gateway.http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 503 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == "no_replica_available"


async def test_silent_stream_gets_keepalive_pings(make_gateway, replicas) -> None:
    async with make_gateway(sse_ping_s=0.05) as gw:
        await replicas("r0", ReplicaBehaviour(tokens=["a", "b"], token_delay_s=0.3))
        await gw.wait_replicas("r0")
        async with gw.http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            raw = (await resp.aread()).decode()
        assert ": ping" in raw
        assert sse_events(raw)[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in sse_events(raw)[1:-1])
        assert text == "ab"


async def test_redis_down_base_model_keeps_serving_adapters_use_the_last_listing(
    make_gateway, replicas, store, redis_server
) -> None:
    await store.publish("medical", b"v1", expected_current=None, base_model=BASE_MODEL, source="create")
    async with make_gateway() as gw:
        await replicas("r0", adapters={"medical": 1})
        await gw.wait_replicas("r0")
        assert (
            await gw.http.post("/v1/chat/completions", json={**CHAT, "model": "medical"})
        ).status_code == 200
        redis_server.stop()
        assert (await gw.http.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (
            await gw.http.post("/v1/chat/completions", json={**CHAT, "model": "medical"})
        ).status_code == 200
        assert (
            await gw.http.post("/v1/chat/completions", json={**CHAT, "model": "other"})
        ).status_code == 404
        assert [m["id"] for m in (await gw.http.get("/v1/models")).json()["data"]] == [BASE_MODEL, "medical"]


async def test_redis_down_from_the_start_is_503_for_adapters_only(
    make_gateway, replicas, redis_server
) -> None:
    redis_server.stop()
    async with make_gateway() as gw:
        await replicas("r0")
        await gw.wait_replicas("r0")
        r = await gw.http.post("/v1/chat/completions", json={**CHAT, "model": "medical"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "store_unavailable"
        assert (await gw.http.post("/v1/chat/completions", json=CHAT)).status_code == 200
        models = await gw.http.get("/v1/models")
        assert models.status_code == 503 and models.json()["error"]["code"] == "store_unavailable"


def _random_json(rng, depth: int = 0):
    kinds = ["null", "bool", "int", "float", "str", "list", "dict"] if depth < 2 else ["null", "int", "str"]
    kind = rng.choice(kinds)
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, -1, 1, 7, 2**31, -(2**70), 10**30])
    if kind == "float":
        return rng.choice([0.0, -0.5, 0.5, 1.5, 3.0, 1e308, -1e-9])
    if kind == "str":
        return rng.choice(["", "x", "user", "assistant", "stop", "medical@v0", "\u0000", "é" * 3, "a" * 300])
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {
        rng.choice(["role", "content", "type", "text", "include_usage", "ttft_ms"]): _random_json(
            rng, depth + 1
        )
    }


async def test_fuzzed_bodies_never_get_a_5xx_for_bad_input(gateway) -> None:
    import random

    rng = random.Random(1234)
    fields = [
        "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
        "stop", "n", "stream", "stream_options", "user", "slo", "echo", "logprobs", "best_of",
        "top_logprobs", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "tools", "tool_choice", "response_format", "functions",
    ]  # fmt: skip
    base = {
        "chat": {"model": BASE_MODEL, "messages": MSGS},
        "completions": {"model": BASE_MODEL, "prompt": "p"},
    }
    seen: set[int] = set()
    for i in range(400):
        endpoint = "chat" if i % 2 == 0 else "completions"
        body = dict(base[endpoint])
        for _ in range(rng.randint(1, 3)):
            field = rng.choice(fields)
            if rng.random() < 0.2:
                body.pop(field, None)
            else:
                body[field] = _random_json(rng)
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        r = await gateway.http.post(path, json=body)
        seen.add(r.status_code)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, body
        # No replica runs here: a valid request gets 503 (capacity); anything else is the body's fault.
        if r.status_code >= 500:
            assert r.status_code == 503 and err["code"] == "no_replica_available", (body, err)
        else:
            assert r.status_code in (400, 404), (body, r.status_code, err)
    assert {400, 503} <= seen


async def test_replica_lost_mid_stream_ends_the_stream_quickly(make_served_gateway, replicas) -> None:
    # A real server: httpx's ASGITransport would hand over the body only once the response is complete.
    async with make_served_gateway(
        telemetry_stale_s=0.5, telemetry_stale_intervals=1.0, inter_token_timeout_s=30
    ) as gw:
        r0 = await replicas(
            "r0", ReplicaBehaviour(tokens=["a", "b", "c"], token_delay_s=0.2), telemetry_interval_s=0.1
        )
        await gw.wait_replicas("r0")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with gw.http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            while '"content":"a"' not in (await anext(lines)):
                pass
            # the "replica dies": no more telemetry, no more tokens
            await r0.stop()
            rest = "\n".join([line async for line in lines])
        elapsed_s = loop.time() - t0
        assert '"code":"replica_lost"' in rest.replace(" ", "") and rest.rstrip().endswith("data: [DONE]")
        assert elapsed_s < 5.0  # not the 30 s inter-token timeout


async def test_replica_with_late_telemetry_keeps_its_stream(make_served_gateway, replicas) -> None:
    # Telemetry stops (a replica starved of CPU publishes it late) but the replica still answers its
    # status endpoint: the gateway does not cut its stream as lost; the stream completes.
    async with make_served_gateway(
        telemetry_stale_s=0.3, telemetry_stale_intervals=1.0, inter_token_timeout_s=30
    ) as gw:
        r0 = await replicas(
            "r0", ReplicaBehaviour(tokens=["a", "b", "c"], token_delay_s=1.0), telemetry_interval_s=0.1
        )
        await gw.wait_replicas("r0")
        async with gw.http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            while '"content":"a"' not in (await anext(lines)):
                pass
            await r0.stop_telemetry()
            rest = "\n".join([line async for line in lines])
        assert '"error"' not in rest and rest.rstrip().endswith("data: [DONE]"), rest
        assert '"content":"b"' in rest and '"content":"c"' in rest, rest
