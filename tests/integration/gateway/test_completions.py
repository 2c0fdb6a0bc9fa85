"""Completions through the gateway with the official `openai` client, a real NATS, and replica doubles."""

import json
import time

import openai
import pytest

from collm_common import subjects
from collm_common.wire.control import RoutingWeights
from collm_common.wire.inference import GenerateRequest

from .conftest import BASE_MODEL, eventually

pytestmark = pytest.mark.integration

HELLO = "Hello, world!"


async def test_streaming_chat_completion_with_usage(gateway, replicas) -> None:
    r0 = await replicas("r0")
    await gateway.wait_replicas("r0")
    stream = await gateway.openai.chat.completions.create(
        model=BASE_MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=10,
        temperature=0.2,
        top_p=0.9,
        seed=3,
        stop=["\n\n"],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == HELLO
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (7, 4)
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert {c.system_fingerprint for c in chunks} == {"r0/base"}
    # what reached the replica
    (req,) = r0.requests
    assert isinstance(req, GenerateRequest)
    assert [(m.role, m.content) for m in req.messages] == [("system", "be brief"), ("user", "hi")]
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop) == (10, 0.2, 0.9, 3, ["\n\n"])
    assert req.adapter is None and req.request_id == chunks[0].id
    assert req.slo.ttft_ms == gateway.state.settings.slo_ttft_ms
    assert req.deadline_unix_s and req.deadline_unix_s > req.arrival_unix_s


async def test_stream_wire_format_ends_with_done(gateway, replicas) -> None:
    await replicas("r0")
    await gateway.wait_replicas("r0")
    body = {
        "model": BASE_MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "max_tokens": 2,
    }
    async with gateway.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-collm-replica"] == "r0"
        assert resp.headers["x-collm-adapter-version"] == "base"
        raw = (await resp.aread()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length"  # max_tokens=2 cut the 4 scripted tokens
    assert "usage" not in last  # no include_usage asked


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_stream_with_include_usage_sends_null_usage_until_the_last_chunk(
    gateway, replicas, path: str
) -> None:
    await replicas("r0")
    await gateway.wait_replicas("r0")
    body: dict = {"model": BASE_MODEL, "stream": True, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
    resp = await gateway.http.post(path, json=body)
    assert resp.status_code == 200
    events = [e[len("data: ") :] for e in resp.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 3
    for chunk in chunks[:-1]:
        assert "usage" in chunk and chunk["usage"] is None, chunk
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


async def test_non_streaming_chat_records_replica_and_version(gateway, replicas) -> None:
    await replicas("r0", adapters={"medical": 3})
    await gateway.state.store.publish(
        "medical", b"blob", expected_current=None, base_model=BASE_MODEL, source="create"
    )
    await gateway.state.store.publish(
        "medical", b"blob2", expected_current=1, base_model=BASE_MODEL, source="round"
    )
    await gateway.wait_replicas("r0")
    raw = await gateway.openai.chat.completions.with_raw_response.create(
        model="medical", messages=[{"role": "user", "content": "x"}], max_tokens=3
    )
    resp = raw.parse()
    assert resp.choices[0].message.content == "Hello, world"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 3 and resp.usage.total_tokens == 10
    assert raw.headers["x-collm-replica"] == "r0"
    assert raw.headers["x-collm-adapter-version"] == "medical@v3"
    assert resp.system_fingerprint == "r0/medical@v3"
    assert resp.model == "medical"


async def test_text_completions_stream_and_non_stream(gateway, replicas) -> None:
    r0 = await replicas("r0")
    await gateway.wait_replicas("r0")
    done = await gateway.openai.completions.create(model=BASE_MODEL, prompt="Once upon", max_tokens=16)
    assert done.object == "text_completion" and done.choices[0].text == HELLO
    assert done.choices[0].finish_reason == "stop" and done.id.startswith("cmpl-")
    stream = await gateway.openai.completions.create(
        model=BASE_MODEL,
        prompt=["Once upon"],
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == HELLO
    assert chunks[-1].usage.completion_tokens == 4
    ids = await gateway.openai.completions.create(model=BASE_MODEL, prompt=[1, 2, 3], max_tokens=1)
    assert ids.choices[0].text == "Hello"
    assert [r.prompt for r in r0.requests] == ["Once upon", "Once upon", None]
    assert r0.requests[2].prompt_token_ids == [1, 2, 3]


async def test_models_list_and_adapter_addressing(gateway, replicas, store) -> None:
    await store.publish("medical", b"v1", expected_current=None, base_model=BASE_MODEL, source="create")
    await store.publish("medical", b"v2", expected_current=1, base_model=BASE_MODEL, source="round")
    await store.create_version("draft", b"x", base_model=BASE_MODEL, source="create")  # never published
    r0 = await replicas("r0", adapters={"medical": 2})
    await gateway.wait_replicas("r0")
    models = [m async for m in gateway.openai.models.list()]
    assert [m.id for m in models] == [BASE_MODEL, "medical"]
    med = models[1].model_dump()
    assert med["parent"] == BASE_MODEL and med["root"] == "medical@v2" and med["version"] == 2
    assert models[0].model_dump()["parent"] is None
    assert (await gateway.openai.models.retrieve("medical@v1")).model_dump()["root"] == "medical@v1"
    # pinned version travels to the replica
    await gateway.openai.chat.completions.create(
        model="medical@v1", messages=[{"role": "user", "content": "x"}]
    )
    assert (r0.requests[-1].adapter, r0.requests[-1].adapter_version) == ("medical", 1)
    await gateway.openai.chat.completions.create(model="medical", messages=[{"role": "user", "content": "x"}])
    assert (r0.requests[-1].adapter, r0.requests[-1].adapter_version) == ("medical", None)
    for unknown in ("nope", "medical@v9", "draft", "bad model!"):
        with pytest.raises(openai.NotFoundError) as err:
            await gateway.openai.chat.completions.create(
                model=unknown, messages=[{"role": "user", "content": "x"}]
            )
        assert err.value.status_code == 404
        assert err.value.body["code"] == "model_not_found"
    assert len(r0.requests) == 2  # refused models never reach a replica


async def test_slo_targets_from_body_and_headers_reach_the_replica(make_gateway, replicas) -> None:
    async with make_gateway(slo_defaults={"collm-test-base": {"ttft_ms": 321}}) as gw:
        r0 = await replicas("r0")
        await gw.wait_replicas("r0")
        msgs = [{"role": "user", "content": "x"}]
        await gw.openai.chat.completions.create(model=BASE_MODEL, messages=msgs)
        await gw.openai.chat.completions.create(
            model=BASE_MODEL, messages=msgs, extra_headers={"x-collm-slo-tpot-ms": "42"}
        )
        await gw.openai.chat.completions.create(
            model=BASE_MODEL, messages=msgs, extra_body={"slo": {"ttft_ms": 99}}
        )
        got = [(r.slo.ttft_ms, r.slo.tpot_ms) for r in r0.requests]
        default_tpot = gw.state.settings.slo_tpot_ms
        assert got == [(321.0, default_tpot), (321.0, 42.0), (99.0, default_tpot)]


async def test_trace_context_reaches_the_replica(gateway, replicas, span_exporter) -> None:
    r0 = await replicas("r0")
    await gateway.wait_replicas("r0")
    await gateway.openai.chat.completions.create(
        model=BASE_MODEL, messages=[{"role": "user", "content": "x"}]
    )
    traceparent = r0.headers[0].get("traceparent")
    assert traceparent, "the generate request carried no trace context"
    trace_id = int(traceparent.split("-")[1], 16)
    spans = [s for s in span_exporter.get_finished_spans() if s.context.trace_id == trace_id]
    names = {s.name for s in spans}
    assert "POST /v1/chat/completions" in names and "generate r0" in names
    server = next(s for s in spans if s.name == "POST /v1/chat/completions")
    assert server.attributes["collm.replica"] == "r0"
    assert server.attributes["collm.adapter_version"] == "base"
    assert server.attributes["collm.model"] == BASE_MODEL
    client = next(s for s in spans if s.name == "generate r0")
    assert traceparent.split("-")[2] == format(client.context.span_id, "016x")  # the replica's parent span
    # no per-chunk send/receive spans
    assert not any("http send" in n or "http receive" in n for n in names)


async def test_routing_weights_from_the_coordinator_steer_requests(gateway, replicas, replica_bus) -> None:
    r0 = await replicas("r0")
    r1 = await replicas("r1")
    await gateway.wait_replicas("r0", "r1")
    await replica_bus.publish(
        subjects.routing_weights(),
        RoutingWeights(ts_unix_s=time.time(), ttl_s=30.0, weights={"r0": 0.0, "r1": 1.0}),
    )
    await eventually(lambda: gateway.state.cluster.weights() is not None, what="routing weights")
    for _ in range(8):
        await gateway.openai.chat.completions.create(
            model=BASE_MODEL, messages=[{"role": "user", "content": "x"}]
        )
    assert (len(r0.requests), len(r1.requests)) == (0, 8)
