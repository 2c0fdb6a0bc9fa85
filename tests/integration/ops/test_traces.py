"""Span trees, asserted with the in-memory exporter (`span_exporter` in tests/conftest.py).

A streamed request: the real gateway app and a real replica (tiny model) in this process, on real NATS
and Redis: one trace from the gateway's HTTP span through the NATS hop to the replica's generation.
A round: the real coordinator and aggregator in this process with participant doubles
(tests/doubles/participant.py): the coordinator's plan span and request, the aggregator's round trace and
its phases.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from collm_aggregator.service import Aggregator
from collm_aggregator.settings import AggregatorSettings
from collm_common import subjects
from collm_common.bus import Bus
from collm_common.clock import WallClock
from collm_common.lora import encode_adapter
from collm_common.service import serve_until_stopped
from collm_common.store import AdapterStore
from collm_coordinator.service import Coordinator
from collm_coordinator.settings import CoordinatorSettings
from collm_gateway.app import build_app
from collm_gateway.settings import GatewaySettings
from collm_replica.settings import ReplicaSettings
from collm_replica.worker import serve as serve_replica
from tests.doubles.participant import BASE_MODEL, ParticipantBehaviour, ParticipantDouble, tiny_adapter

pytestmark = pytest.mark.integration


async def eventually(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def by_id(spans: list[ReadableSpan]) -> dict[int, ReadableSpan]:
    return {s.context.span_id: s for s in spans}


def parent_of(span: ReadableSpan, index: dict[int, ReadableSpan]) -> ReadableSpan | None:
    return index.get(span.parent.span_id) if span.parent is not None else None


# --- a streamed request -----------------------------------------------------------------------------------
@dataclass
class Served:
    openai: AsyncOpenAI
    spans: InMemorySpanExporter


@pytest.fixture
async def served(nats_server, redis_server, redis_prefix, span_exporter) -> AsyncIterator[Served]:
    rs = ReplicaSettings(
        nats_url=nats_server.url,
        redis_url=redis_server.url,
        redis_prefix=redis_prefix,
        nats_connect_timeout_s=5,
        replica_id="r0",
        model="tiny",
        telemetry_interval_s=0.2,
    )
    stopping = asyncio.Event()
    replica = asyncio.create_task(serve_until_stopped("collm-replica", rs, serve_replica, stopping))
    gs = GatewaySettings(
        nats_url=nats_server.url,
        redis_url=redis_server.url,
        redis_prefix=redis_prefix,
        nats_connect_timeout_s=5,
        gateway_id="gw-trace",
        base_model="tiny",
    )
    bus = await Bus.connect(gs, "collm-gateway")
    store = AdapterStore.from_url(redis_server.url, redis_prefix)
    app = build_app(gs, bus, store)
    try:
        async with app.router.lifespan_context(app):
            await eventually(lambda: app.state.gateway.cluster.fresh_replicas() or replica.done(), 90, "r0")
            if replica.done():
                replica.result()
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
                client = AsyncOpenAI(base_url="http://gw/v1", api_key="k", http_client=http, max_retries=0)
                span_exporter.clear()
                yield Served(client, span_exporter)
    finally:
        stopping.set()
        await asyncio.wait_for(replica, 30)
        await bus.close()
        await store.close()


async def stream_one(served: Served) -> tuple[str, list[ReadableSpan]]:
    """One streamed chat completion; returns its request id and the spans of its trace."""
    stream = await served.openai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    request_id = ""
    async for chunk in stream:
        request_id = chunk.id
    gen = await eventually(
        lambda: next((s for s in served.spans.get_finished_spans() if s.name == "generate"), None),
        10,
        "replica span",
    )
    await eventually(
        lambda: any(s.name == "generate r0" for s in served.spans.get_finished_spans()), 10, "dispatch span"
    )
    return request_id, [
        s for s in served.spans.get_finished_spans() if s.context.trace_id == gen.context.trace_id
    ]


async def test_a_streamed_request_is_one_trace_from_http_to_the_replica_generation(served: Served) -> None:
    request_id, spans = await stream_one(served)
    index = by_id(spans)
    gen = next(s for s in spans if s.name == "generate" and s.kind is SpanKind.SERVER)
    client = parent_of(gen, index)
    assert client is not None and client.name == "generate r0" and client.kind is SpanKind.CLIENT
    assert client.attributes["messaging.system"] == "nats"
    assert client.attributes["messaging.destination.name"] == subjects.replica("r0", "generate")
    http = parent_of(client, index)
    assert http is not None and http.name == "POST /v1/chat/completions" and http.kind is SpanKind.SERVER
    assert http.parent is None, "the HTTP span is the root of the request's trace"
    assert {s.name for s in spans} >= {"POST /v1/chat/completions", "generate r0", "generate"}
    assert not any("http send" in s.name for s in spans), "no span per streamed chunk"

    # The replica's generation: queue wait, prefill and decode as events, the adapter version as attribute.
    events = [e.name for e in gen.events]
    assert events == ["queued", "prefill_start", "first_token", "finished"]
    assert gen.events[1].attributes["queue_ms"] >= 0 and gen.events[2].attributes["ttft_ms"] > 0
    assert gen.attributes["collm.adapter.version"] == "base"
    assert gen.attributes["collm.request_id"] == request_id

    # The gateway's spans follow the GenAI semantic conventions.
    assert http.attributes["gen_ai.operation.name"] == "chat"
    assert http.attributes["gen_ai.request.model"] == "tiny"
    assert (
        http.attributes["gen_ai.request.max_tokens"] == 6 and http.attributes["gen_ai.request.stream"] is True
    )
    assert http.attributes["gen_ai.response.id"] == request_id
    assert http.attributes["gen_ai.response.model"] == "tiny"
    out_tokens = http.attributes["gen_ai.usage.output_tokens"]
    assert 1 <= out_tokens <= 6 and http.attributes["gen_ai.usage.input_tokens"] > 0
    assert http.attributes["collm.adapter_version"] == "base" and http.attributes["collm.replica"] == "r0"
    assert http.attributes["collm.ttft_ms"] > 0 and http.attributes["collm.status"] == 200
    assert client.attributes["gen_ai.usage.output_tokens"] == out_tokens
    assert client.attributes["gen_ai.response.finish_reasons"] == (gen.attributes["collm.finish_reason"],)


async def test_the_replica_generation_span_follows_the_genai_conventions(served: Served) -> None:
    _request_id, spans = await stream_one(served)
    gen = next(s for s in spans if s.name == "generate")
    for key in (
        "gen_ai.operation.name",
        "gen_ai.request.model",
        "gen_ai.request.max_tokens",
        "gen_ai.usage.input_tokens",
        "gen_ai.usage.output_tokens",
        "gen_ai.response.finish_reasons",
    ):
        assert key in gen.attributes, key
    assert gen.attributes["gen_ai.operation.name"] == "chat"
    assert (
        gen.attributes["gen_ai.request.model"] == "tiny" and gen.attributes["gen_ai.request.max_tokens"] == 6
    )
    client = next(s for s in spans if s.name == "generate r0")
    assert gen.attributes["gen_ai.usage.output_tokens"] == client.attributes["gen_ai.usage.output_tokens"]
    assert gen.attributes["gen_ai.usage.input_tokens"] > 0
    assert gen.attributes["gen_ai.response.finish_reasons"] == (gen.attributes["collm.finish_reason"],)


# --- a round ----------------------------------------------------------------------------------------------
ADAPTER = "fed"
DOMAIN = "general"


@dataclass
class RoundCluster:
    store: AdapterStore
    spans: InMemorySpanExporter
    coordinator: Coordinator
    aggregator: Aggregator


@pytest.fixture
async def round_cluster(
    nats_server, redis_server, redis_prefix, span_exporter, tmp_path: Path
) -> AsyncIterator[RoundCluster]:
    common = {
        "nats_url": nats_server.url,
        "redis_url": redis_server.url,
        "redis_prefix": redis_prefix,
        "nats_connect_timeout_s": 5,
    }
    store = AdapterStore.from_url(redis_server.url, redis_prefix)
    await store.publish(
        ADAPTER, encode_adapter(tiny_adapter()), expected_current=None, base_model=BASE_MODEL, source="create"
    )
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(store.close)
        peers = await Bus.connect(CoordinatorSettings(**common), "participants")
        stack.push_async_callback(peers.close)
        for rid in ("p0", "p1"):
            double = ParticipantDouble(peers, store, rid, ParticipantBehaviour(domain=DOMAIN))
            await double.start()
            stack.push_async_callback(double.stop)
        agg_settings = AggregatorSettings(
            **common, default_plan=False, eval_timeout_s=5, control_timeout_s=2, consumer_name="agg-trace"
        )
        agg_bus = await Bus.connect(agg_settings, "collm-aggregator")
        stack.push_async_callback(agg_bus.close)
        agg_store = AdapterStore.from_url(redis_server.url, redis_prefix)
        stack.push_async_callback(agg_store.close)
        aggregator = Aggregator(agg_settings, agg_bus, agg_store, WallClock())
        await aggregator.start()
        stack.push_async_callback(aggregator.stop)
        coord_settings = CoordinatorSettings(
            **common,
            coordinator_fast_interval_s=0.25,
            coordinator_slow_interval_s=30.0,
            coordinator_round_deadline_s=10.0,
            coordinator_warmup_s=1.0,
            coordinator_store_refresh_s=0.5,
            coordinator_adapters={ADAPTER: [DOMAIN]},
            coordinator_probe_budget_tokens=128,
        )
        coord_bus = await Bus.connect(coord_settings, "collm-coordinator")
        stack.push_async_callback(coord_bus.close)
        coordinator = Coordinator(
            coord_settings, coord_bus, WallClock(), AdapterStore.from_url(redis_server.url, redis_prefix)
        )
        assert coordinator.store is not None
        stack.push_async_callback(coordinator.store.close)
        span_exporter.clear()
        await coordinator.start()
        stack.push_async_callback(coordinator.stop)
        yield RoundCluster(store, span_exporter, coordinator, aggregator)


async def finished_round(c: RoundCluster) -> list[ReadableSpan]:
    root = await eventually(
        lambda: next((s for s in c.spans.get_finished_spans() if s.name == "round"), None),
        45,
        "a finished round",
    )
    return [s for s in c.spans.get_finished_spans() if s.context.trace_id == root.context.trace_id]


async def test_a_round_planned_by_the_coordinator_is_one_trace_with_a_span_per_phase(
    round_cluster: RoundCluster,
) -> None:
    in_round = await finished_round(round_cluster)
    spans = round_cluster.spans.get_finished_spans()
    root = next(s for s in in_round if s.name == "round")
    assert root.parent is None and root.attributes["collm.adapter"] == ADAPTER
    assert root.attributes["collm.round_state"] == "published", root.status
    round_id = root.attributes["collm.round_id"]
    phases = {s.name for s in in_round if s.parent is not None and s.parent.span_id == root.context.span_id}
    assert phases == {"round.collect", "round.aggregate", "round.evaluate", "round.publish"}
    # The participants were started and asked to evaluate inside the round's trace.
    names = [s.name for s in in_round]
    assert any(n.endswith(".control request") for n in names) and any(
        n.endswith(".evaluate request") for n in names
    )
    assert any(n == "control process" for n in names) and any(n == "evaluate process" for n in names)

    # The plan: the coordinator's request to the aggregator, answered in the same trace, and the round's
    # own trace links back to it.
    plan_req = next(
        s
        for s in spans
        if s.name == f"{subjects.aggregator('open_round')} request" and s.kind is SpanKind.CLIENT
    )
    served_plan = next(
        s for s in spans if s.name == "open_round process" and s.context.trace_id == plan_req.context.trace_id
    )
    assert served_plan.parent is not None and served_plan.parent.span_id == plan_req.context.span_id
    assert served_plan.kind is SpanKind.SERVER
    assert [ln.context.span_id for ln in root.links] == [served_plan.context.span_id]
    assert round_id >= 1


async def test_the_coordinator_has_a_span_for_each_round_it_plans(round_cluster: RoundCluster) -> None:
    await finished_round(round_cluster)
    spans = round_cluster.spans.get_finished_spans()
    index = by_id(list(spans))
    plan_req = next(s for s in spans if s.name == f"{subjects.aggregator('open_round')} request")
    parent = parent_of(plan_req, index)
    assert parent is not None, "the open_round request has no parent span in the coordinator"
    assert parent.attributes.get("collm.adapter") == ADAPTER
    assert parent.name == "round.plan" and parent.parent is None, "the plan is the root of its trace"
    assert set(parent.attributes["collm.participants"]) == {"p0", "p1"}
    assert parent.attributes["collm.expected_gain_nats"] >= 0
    assert parent.attributes["collm.token_budget_tokens"] > 0
    assert parent.attributes["collm.round_state"] == "opened" and parent.attributes["collm.round_id"] >= 1
