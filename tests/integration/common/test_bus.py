"""The bus against a real nats-server: micro services, errors, streams, trace context."""

import asyncio
import json

import pytest
from opentelemetry import trace
from prometheus_client import REGISTRY

from collm_common import subjects
from collm_common.bus import Bus, BusError, NoResponders, PayloadTooLarge, ServiceFailure, message_size
from collm_common.settings import CommonSettings
from collm_common.wire import decode, encode
from collm_common.wire.control import CONTROL_COMMAND, ControlReply, ErrorReply, SetFineTuneShare
from collm_common.wire.inference import CancelRequest
from collm_common.wire.telemetry import ReplicaTelemetry

pytestmark = pytest.mark.integration


def settings(url: str) -> CommonSettings:
    return CommonSettings(nats_url=url, nats_connect_timeout_s=5)


async def test_micro_service_ping_info_stats_and_errors(nats_server) -> None:
    bus = await Bus.connect(settings(nats_server.url), "t")
    try:
        svc = await bus.service(subjects.SERVICE_REPLICA, "0.1.0", "test", {"replica_id": "r9"})

        async def control(cmd, _headers):
            if cmd.share > 0.9:
                raise ServiceFailure(409, "share too high\nfor test")
            return ControlReply(ok=True, message=f"share={cmd.share}")

        await svc.endpoint("control", subjects.replica("r9", "control"), CONTROL_COMMAND, control)
        reply = await bus.request(
            subjects.replica("r9", "control"), SetFineTuneShare(share=0.5), ControlReply
        )
        assert reply.ok and reply.message == "share=0.5"
        with pytest.raises(BusError) as err:
            await bus.request(subjects.replica("r9", "control"), SetFineTuneShare(share=0.95), ControlReply)
        assert err.value.code == 409 and "share too high" in err.value.message
        # malformed request -> 400 error reply, service keeps running
        raw = await bus.nc.request(subjects.replica("r9", "control"), b"\xc1", timeout=2)
        assert raw.headers["Nats-Service-Error-Code"] == "400"
        ping = json.loads((await bus.nc.request("$SRV.PING.collm-replica", b"", timeout=2)).data)
        assert ping["name"] == "collm-replica" and ping["metadata"]["replica_id"] == "r9"
        info = json.loads((await bus.nc.request("$SRV.INFO.collm-replica", b"", timeout=2)).data)
        assert info["endpoints"][0]["subject"] == "collm.v1.replica.r9.control"
        stats = json.loads((await bus.nc.request("$SRV.STATS.collm-replica", b"", timeout=2)).data)
        assert stats["endpoints"][0]["num_requests"] == 3
        assert stats["endpoints"][0]["num_errors"] == 2
    finally:
        await bus.close()


async def test_no_responders_is_503(nats_server) -> None:
    bus = await Bus.connect(settings(nats_server.url), "t")
    try:
        with pytest.raises(NoResponders) as err:
            await bus.request(
                subjects.replica("nobody", "control"), SetFineTuneShare(share=0.1), ControlReply
            )
        assert err.value.code == 503
        async with bus.stream(
            subjects.replica("nobody", "generate"), CancelRequest(request_id="x")
        ) as replies:
            with pytest.raises(NoResponders):
                await replies.next(2.0)
    finally:
        await bus.close()


async def test_stream_many_replies_and_timeout(nats_server) -> None:
    bus = await Bus.connect(settings(nats_server.url), "t")
    try:

        async def on_req(msg):
            for i in range(5):
                await bus.nc.publish(msg.reply, str(i).encode())

        await bus.nc.subscribe("collm.v1.test.stream", cb=on_req)
        async with bus.stream("collm.v1.test.stream", CancelRequest(request_id="x")) as replies:
            got = [(await replies.next(2.0)).data for _ in range(5)]
            assert got == [b"0", b"1", b"2", b"3", b"4"]
            with pytest.raises(BusError) as err:
                await replies.next(0.2)
            assert err.value.code == 504
    finally:
        await bus.close()


async def test_trace_context_crosses_nats(nats_server, span_exporter) -> None:
    exporter = span_exporter
    tracer = trace.get_tracer("test")
    bus = await Bus.connect(settings(nats_server.url), "t")
    seen: list[str | None] = []
    try:
        svc = await bus.service(subjects.SERVICE_REPLICA, "0.1.0", "test")

        async def control(_cmd, headers):
            seen.append(headers.get("traceparent"))
            return ControlReply(ok=True)

        await svc.endpoint("control", subjects.replica("r1", "control"), CONTROL_COMMAND, control)
        with tracer.start_as_current_span("client-root") as root:
            await bus.request(subjects.replica("r1", "control"), SetFineTuneShare(share=0.1), ControlReply)
            trace_id = format(root.get_span_context().trace_id, "032x")
        assert seen and seen[0] and trace_id in seen[0]
        spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == int(trace_id, 16)]
        names = {s.name for s in spans}
        assert "control process" in names and "client-root" in names
    finally:
        await bus.close()


async def test_subscribe_drops_malformed_and_keeps_going(nats_server) -> None:
    bus = await Bus.connect(settings(nats_server.url), "t")
    got: list[str] = []
    try:

        async def handler(msg, _raw):
            got.append(msg.request_id)

        await bus.subscribe("collm.v1.test.events", CancelRequest, handler)
        await bus.nc.publish("collm.v1.test.events", b"garbage")
        await bus.nc.publish("collm.v1.test.events", encode(CancelRequest(request_id="ok")))
        for _ in range(50):
            if got:
                break
            await asyncio.sleep(0.02)
        assert got == ["ok"]
    finally:
        await bus.close()


async def test_connect_gives_up_with_a_clear_error() -> None:
    with pytest.raises(ConnectionError, match="cannot reach NATS"):
        await Bus.connect(CommonSettings(nats_url="nats://127.0.0.1:1", nats_connect_timeout_s=0.5), "t")


async def test_close_with_a_drain_bound_does_not_wait_for_a_stuck_handler(nats_server) -> None:
    """A subscription whose handler never finishes (cancelled mid-message by Ctrl-C, in the CLI) would keep
    a drain waiting for nats-py's 30 s drain timeout; a bounded close gives way to closing at once."""
    bus = await Bus.connect(settings(nats_server.url), "t")
    started = asyncio.Event()

    async def stuck(_msg) -> None:  # noqa: ANN001
        started.set()
        await asyncio.Event().wait()

    await bus.nc.subscribe("collm.test.stuck", cb=stuck)
    await bus.nc.publish("collm.test.stuck", b"1")
    await bus.nc.publish("collm.test.stuck", b"2")
    await bus.nc.flush()
    await asyncio.wait_for(started.wait(), 5)
    t0 = asyncio.get_running_loop().time()
    await bus.close(drain_timeout_s=0.5)
    assert asyncio.get_running_loop().time() - t0 < 3.0
    assert bus.nc.is_closed


async def test_an_endpoint_serves_other_connections_as_soon_as_it_is_added(nats_server) -> None:
    """Once `endpoint` returns and the other connection has synced, a request from it finds the endpoint
    (without `endpoint`'s own round trip, or without the sync, some of these met no responders)."""
    server = await Bus.connect(settings(nats_server.url), "server")
    client = await Bus.connect(settings(nats_server.url), "client")
    try:
        svc = await server.service(subjects.SERVICE_REPLICA, "0.1.0", "test", {"replica_id": "race"})

        async def control(cmd, _headers):
            return ControlReply(ok=True, message=f"share={cmd.share}")

        for i in range(50):
            subject = subjects.replica(f"race{i}", "control")
            await svc.endpoint(f"control{i}", subject, CONTROL_COMMAND, control)
            await client.sync()
            reply = await client.request(subject, SetFineTuneShare(share=0.5), ControlReply)
            assert reply.ok, i
    finally:
        await client.close()
        await server.close()


async def test_a_message_of_exactly_max_payload_is_sent_and_one_byte_more_is_refused(nats_server) -> None:
    """`message_size` counts what the server counts: a message of exactly `max_payload` bytes (payload
    and headers) arrives; one byte more raises PayloadTooLarge, nothing is sent, the connection stays."""
    bus = await Bus.connect(settings(nats_server.url), "t")
    try:
        limit = bus.nc.max_payload
        got: list[CancelRequest] = []

        async def on_cancel(msg: CancelRequest, _raw: object) -> None:
            got.append(msg)

        await bus.subscribe("size.test", CancelRequest, on_cancel)
        await bus.sync()
        headers = {"x-test": "h" * 100}
        base = CancelRequest(request_id="r", reason="x" * 70_000)  # a str32 from here on: 1 byte per char
        fill = limit - message_size(encode(base), headers)
        exact = CancelRequest(request_id="r", reason="x" * (70_000 + fill))
        assert message_size(encode(exact), headers) == limit
        await bus.publish("size.test", exact, headers=headers)
        over = CancelRequest(request_id="r", reason="x" * (70_000 + fill + 1))
        with pytest.raises(PayloadTooLarge) as err:
            await bus.publish("size.test", over, headers=headers)
        assert (err.value.code, err.value.size, err.value.max_payload) == (413, limit + 1, limit)
        with pytest.raises(PayloadTooLarge):
            async with bus.stream("size.test", over, headers=headers):
                pass
        with pytest.raises(PayloadTooLarge):
            await bus.request("size.test", over, ControlReply, headers=headers)
        await bus.sync()
        await asyncio.sleep(0.1)
        assert bus.connected and [len(m.reason) for m in got] == [len(exact.reason)]
    finally:
        await bus.close()


async def test_a_stream_endpoint_streams_in_order_and_refuses_with_its_error_body(nats_server) -> None:
    """Each request's replies come in order from a task of the caller's; a refusal (raised by the handler,
    or a request that does not decode) is an error reply: micro's headers plus the endpoint's own body."""
    bus = await Bus.connect(settings(nats_server.url), "t")
    tasks: set[asyncio.Task[None]] = set()
    try:
        svc = await bus.service(subjects.SERVICE_REPLICA, "0.1.0", "test", {"replica_id": "s1"})

        async def count(req, _headers):
            if req.request_id == "refuse":
                raise ServiceFailure(429, "queue\nfull", "rate_limit_exceeded")
            for i in range(3):
                yield ControlReply(ok=True, message=f"{req.request_id}:{i}")

        def error_body(req, failure):
            return ErrorReply(code=failure.code, type=failure.type, message=f"{req and req.request_id}")

        def spawn(coro):
            task = asyncio.create_task(coro)
            tasks.add(task)
            return task

        subject = subjects.replica("s1", "generate")
        await svc.stream_endpoint("generate", subject, CancelRequest, count, spawn, error_body)
        async with bus.stream(subject, CancelRequest(request_id="a")) as replies:
            got = [decode(ControlReply, (await replies.next(5)).data).message for _ in range(3)]
        assert got == ["a:0", "a:1", "a:2"]
        raw = await bus.nc.request(subject, encode(CancelRequest(request_id="refuse")), timeout=5)
        assert raw.headers["Nats-Service-Error-Code"] == "429"
        assert raw.headers["Nats-Service-Error"] == "queue full"
        refusal = ErrorReply(code=429, type="rate_limit_exceeded", message="refuse")
        assert decode(ErrorReply, raw.data) == refusal
        raw = await bus.nc.request(subject, b"\xc1", timeout=5)
        assert raw.headers["Nats-Service-Error-Code"] == "400"
        assert decode(ErrorReply, raw.data).message == "None"
        await bus.nc.publish(subject, b"\xc1")  # no reply subject: nothing to answer, nothing breaks
        async with bus.stream(subject, CancelRequest(request_id="b")) as replies:
            assert decode(ControlReply, (await replies.next(5)).data).message == "b:0"
    finally:
        await bus.close()
        for task in tasks:
            task.cancel()


async def test_handlers_of_one_subject_share_a_subscription_and_a_refusal_counts_once(nats_server) -> None:
    """Two readers of every replica's telemetry in one process (the gateway's routing and its dashboard):
    a good message reaches both, a forged one (another replica's telemetry on r2's subject) is refused
    and counted once, and each reader leaves on its own."""
    bus = await Bus.connect(settings(nats_server.url), "t")
    first: list[str] = []
    second: list[str] = []

    async def one(msg, _raw):
        first.append(msg.replica_id)

    async def two(msg, _raw):
        second.append(msg.replica_id)

    def refused() -> float:
        labels = {"schema": ReplicaTelemetry.schema_name, "reason": "subject"}
        return REGISTRY.get_sample_value("collm_wire_rejected_messages_total", labels) or 0.0

    async def until(cond) -> None:
        for _ in range(250):
            if cond():
                return
            await asyncio.sleep(0.02)
        raise AssertionError("condition not met")

    try:
        sub_one = await bus.subscribe(subjects.telemetry_all(), ReplicaTelemetry, one)
        await bus.subscribe(subjects.telemetry_all(), ReplicaTelemetry, two)
        before = refused()
        forged = ReplicaTelemetry(replica_id="r1", ts_unix_s=1.0, interval_s=1.0, model="m")
        await bus.nc.publish(subjects.telemetry("r2"), encode(forged))
        await bus.nc.publish(subjects.telemetry("r1"), encode(forged))
        await until(lambda: first == ["r1"] and second == ["r1"])
        assert refused() == before + 1
        await sub_one.unsubscribe()
        own = ReplicaTelemetry(replica_id="r3", ts_unix_s=2.0, interval_s=1.0, model="m")
        await bus.nc.publish(subjects.telemetry("r3"), encode(own))
        await until(lambda: second == ["r1", "r3"])
        assert first == ["r1"]
    finally:
        await bus.close()
