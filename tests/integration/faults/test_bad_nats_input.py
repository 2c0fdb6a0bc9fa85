"""Bad input on NATS: every subject the services listen on gets payloads they must refuse.

Payloads: malformed msgpack, msgpack that is not a map, wrong schema versions, unknown fields, an
oversized (just under NATS's 1 MiB) payload, schema-valid messages with hostile values (a replica id
that is not a subject token), and arbitrary bytes and msgpack structures drawn by hypothesis.

Checks:
* request/reply endpoints (replica generate, cancel, control, status, evaluate; coordinator status,
  policy; aggregator open_round, status, rounds, round, rollback, import; gateway status) answer every
  payload, quickly, with an error reply carrying a 4xx code (or a normal reply when the payload happens
  to be valid; a message with unknown fields is valid within v1, and is counted);
* pub/sub subjects (telemetry, routing weights, round events, adapter publications) and the JetStream
  consumers (samples, updates) drop what they cannot decode and count it
  (`collm_wire_rejected_messages_total` on each subscriber's /metrics);
* no process crashes, and afterwards every service answers a valid request, a completion succeeds, and
  both JetStream consumers still consume (a valid sample and a valid update get through).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collm_common import subjects
from collm_common.bus import ERROR_CODE_HEADER, Bus
from collm_common.settings import CommonSettings
from collm_common.wire import encode
from collm_common.wire.adapters import TrainingSample
from collm_common.wire.admin import StatusRequest
from collm_common.wire.control import CoordinatorStatusRequest, RoutingWeights, SetFineTuneShare
from collm_common.wire.gateway import GatewayStatusRequest
from collm_common.wire.rounds import LocalUpdate

from .harness import FaultStack, metric, replica_status, wait_for
from .probe import one_request

pytestmark = pytest.mark.integration
T = TypeVar("T")
REPLY_TIMEOUT_S = 5.0
REJECTED = "collm_wire_rejected_messages_total"
UNKNOWN = "collm_wire_unknown_fields_total"
NEAR_MAX_BYTES = 1_000_000  # NATS's default max_payload is 1 MiB (1048576)


def request_subjects(fs: FaultStack) -> dict[str, str]:
    rid = fs.replicas[0]
    out = {f"replica.{verb}": subjects.replica(rid, verb) for verb in subjects.REPLICA_VERBS}
    out.update({f"coordinator.{v}": subjects.coordinator(v) for v in ("status", "policy")})
    out.update(
        {
            f"aggregator.{v}": subjects.aggregator(v)
            for v in ("open_round", "status", "rounds", "round", "rollback", "import")
        }
    )
    out["gateway.status"] = subjects.gateway("status")
    return out


def fixed_bad_payloads() -> dict[str, bytes]:
    """Payloads no endpoint may accept, whatever its schema."""
    return {
        "malformed msgpack": b"\xc1\xff\x00garbage",
        "truncated msgpack": msgpack.packb({"request_id": "x" * 40})[:-5],
        "not a map": msgpack.packb([1, 2, 3]),
        "a bare string": msgpack.packb("hello"),
        "wrong schema version": msgpack.packb({"v": 2, "request_id": "r", "prompt": "p", "adapter": "a"}),
        "version of the wrong type": msgpack.packb({"v": "one"}),
        "integer map keys": b"\x81\x01\x02",
        "oversized": msgpack.packb(b"\x00" * NEAR_MAX_BYTES),
    }


# Just under NATS's limit and a map: valid for a schema whose fields all have defaults (status requests:
# the unknown field is ignored and counted), refused by the others. Either way: answered, nothing breaks.
OVERSIZED_MAP = msgpack.packb({"v": 1, "padding": b"\x00" * NEAR_MAX_BYTES})


class LoopThread:
    """An event loop in a thread with one NATS connection, so sync hypothesis tests can drive NATS."""

    def __init__(self, nats_url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.bus: Bus = self.run(Bus.connect(CommonSettings(nats_url=nats_url), "fault-fuzzer"))

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.run(self.bus.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def client(fault_stack: FaultStack) -> Iterator[LoopThread]:
    assert fault_stack.nats is not None
    lt = LoopThread(fault_stack.nats.url)
    try:
        yield lt
    finally:
        lt.close()


async def ask(bus: Bus, subject: str, payload: bytes) -> tuple[int | None, float]:
    """Send `payload` as a request; (the error code of the reply or None for a normal reply, seconds)."""
    t0 = time.monotonic()
    msg = await bus.nc.request(subject, payload, timeout=REPLY_TIMEOUT_S)
    code = (msg.headers or {}).get(ERROR_CODE_HEADER)
    return (int(code) if code is not None else None), time.monotonic() - t0


async def rejected_counts(fs: FaultStack) -> dict[str, float]:
    urls = {name: fs.metrics_url(name) for name in fs.s.metrics_urls()}
    return {name: await metric(url, REJECTED) for name, url in urls.items()}


async def valid_requests_still_work(fs: FaultStack) -> None:
    async with fs.bus("fault-after-fuzz") as bus:
        await wait_for(lambda: fs.services_answering(bus), 10, "every service to answer")
        async with httpx.AsyncClient() as http:
            o = await one_request(http, fs.gateway_url, fs.base_model, stream=True, max_tokens=4)
            assert o.kind == "ok", o
        # JetStream consumers are not stuck behind what they refused.
        rid = fs.replicas[0]
        st0 = await replica_status(bus, rid)
        assert st0 is not None
        sample = TrainingSample(
            sample_id=f"valid-{uuid.uuid4().hex[:8]}", replica_id=rid, prompt="a valid prompt",
            response="a valid response", domain="med",
        )  # fmt: skip
        await bus.js.publish(subjects.samples(rid), encode(sample), timeout=5)

        async def consumed() -> bool:
            st = await replica_status(bus, rid)
            return st is not None and st.local_samples > st0.local_samples

        await wait_for(consumed, 15, "the valid sample to be consumed")
        before = await metric(
            fs.metrics_url("aggregator"), "collm_aggregator_rejected_updates_total", reason="unknown_round"
        )
        upd = LocalUpdate(
            round_id=123456789, adapter="fuzz", replica_id=rid, base_version=1, blob_key="k",
            sha256="0" * 64, num_samples=1, num_tokens=1,
        )  # fmt: skip
        await bus.js.publish(subjects.update(123456789, rid), encode(upd), timeout=5)

        async def recorded() -> bool:
            now = await metric(
                fs.metrics_url("aggregator"),
                "collm_aggregator_rejected_updates_total",
                reason="unknown_round",
            )
            return now > before

        await wait_for(recorded, 15, "the valid update to be consumed")
    assert not fs.dead_children(), (fs.dead_children(), fs.log_tail())


def test_fixed_bad_payloads_on_every_endpoint_and_subject(
    fault_stack: FaultStack, client: LoopThread
) -> None:
    fs = fault_stack
    asyncio.run(fs.ensure_healthy())
    bus = client.bus
    rejected0 = client.run(rejected_counts(fs))
    answers: dict[tuple[str, str], tuple[int | None, float]] = {}
    for what, payload in fixed_bad_payloads().items():
        for name, subject in request_subjects(fs).items():
            answers[(name, what)] = client.run(ask(bus, subject, payload))
    # Every answer is an error reply with a 4xx code; `replica.status` may also answer with the current
    # telemetry (a body that its request schema, all defaults, accepts).
    wrong = {
        k: v
        for k, v in answers.items()
        if not (k[0] == "replica.status" and v[0] is None) and not (v[0] is not None and 400 <= v[0] < 500)
    }
    assert not wrong, wrong
    assert max(t for _, t in answers.values()) < REPLY_TIMEOUT_S
    for name, subject in request_subjects(fs).items():
        code, took_s = client.run(ask(bus, subject, OVERSIZED_MAP))
        assert (code is None or 400 <= code < 500) and took_s < REPLY_TIMEOUT_S, (name, code)

    # Pub/sub and JetStream: each subscriber drops and counts what it cannot decode.
    rid = fs.replicas[0]
    pubsub = {
        "telemetry": subjects.telemetry("evil"),
        "routing": subjects.routing_weights(),
        "round events": subjects.round_event(424242, "published"),
        "adapter published": subjects.adapter_published("evil"),
    }

    async def publish_all() -> None:
        for what, payload in fixed_bad_payloads().items():
            if what == "oversized":
                continue  # JetStream refuses it itself (max_msg_size); core subscribers get the rest
            for subject in pubsub.values():
                await bus.nc.publish(subject, payload)
            for subject in (subjects.samples(rid), subjects.update(424242, rid)):
                await bus.js.publish(subject, payload, timeout=5)
        await bus.nc.flush()

    client.run(publish_all())

    def counted() -> dict[str, float]:
        now = client.run(rejected_counts(fs))
        return {name: now[name] - rejected0.get(name, 0.0) for name in now}

    async def all_counted() -> bool:
        d = counted()
        # gateway: telemetry, routing, adapter published; coordinator: telemetry, round events;
        # aggregator: telemetry, updates; every replica: adapter published (+ samples for rid).
        return all(v >= 7 for v in d.values())

    try:
        asyncio.run(wait_for(all_counted, 15, "every subscriber to count the bad messages"))
    except AssertionError:
        raise AssertionError(f"rejected messages counted per service: {counted()}") from None
    asyncio.run(valid_requests_still_work(fs))


def test_unknown_fields_are_accepted_within_v1_and_counted(
    fault_stack: FaultStack, client: LoopThread
) -> None:
    """Additive changes within a version: a reader ignores fields it does not know, and counts them."""
    fs = fault_stack
    extra = {"added_in_a_later_v1": {"nested": [1, 2]}, "zz": b"\x00"}
    valid = {
        "coordinator": (subjects.coordinator("status"), CoordinatorStatusRequest()),
        "aggregator": (subjects.aggregator("status"), StatusRequest()),
        "gateway": (subjects.gateway("status"), GatewayStatusRequest()),
        f"replica-{fs.replicas[0]}": (
            subjects.replica(fs.replicas[0], "control"),
            SetFineTuneShare(share=0.3, ttl_s=1.0),
        ),
    }
    before = {name: client.run(metric(fs.metrics_url(name), UNKNOWN)) for name in valid}
    for _name, (subject, msg) in valid.items():
        payload = msgpack.packb({**msg.model_dump(mode="python"), **extra}, use_bin_type=True)
        code, _ = client.run(ask(client.bus, subject, payload))
        assert code is None, (subject, code)
    after = {name: client.run(metric(fs.metrics_url(name), UNKNOWN)) for name in valid}
    assert all(after[n] > before[n] for n in valid), (before, after)


def test_schema_valid_hostile_values_do_not_break_routing(
    fault_stack: FaultStack, client: LoopThread
) -> None:
    """Telemetry naming replicas that cannot exist (ids that are not subject tokens: refused by the
    schema, counted) or that do not answer ("ghost"), with an empty queue so that the router would rank
    them first, and routing weights that favour them. Completions must still succeed on the real
    replicas (a ghost that is tried answers "no responders", and the request moves on)."""
    fs = fault_stack
    bus = client.bus
    fakes = ["x.y", "*", ">", "", "ghost", "a" * 200]

    async def flood(stop: asyncio.Event) -> None:
        while not stop.is_set():
            for rid in fakes:
                # Built as a raw map: the schema itself refuses ids that are not subject tokens.
                t = {"v": 1, "replica_id": rid, "ts_unix_s": time.time(), "interval_s": 0.25,
                     "model": fs.base_model, "max_batch": 64}  # fmt: skip
                # On the ghost's own subject (readers drop telemetry that names another replica than
                # its subject); an id that is no subject token can only arrive on another's.
                subject = subjects.telemetry(rid) if rid == "ghost" else subjects.telemetry("evil")
                await bus.nc.publish(subject, msgpack.packb(t))
            w = RoutingWeights(
                ts_unix_s=time.time(), ttl_s=5.0, weights=dict.fromkeys(fakes, 100.0), policy="evil"
            )
            await bus.nc.publish(subjects.routing_weights(), encode(w))
            await asyncio.sleep(0.1)

    async def scenario() -> list[Any]:
        stop = asyncio.Event()
        task = asyncio.run_coroutine_threadsafe(flood(stop), client.loop)
        try:
            await asyncio.sleep(0.5)
            async with httpx.AsyncClient() as http:
                return [
                    await one_request(
                        http, fs.gateway_url, fs.base_model, stream=i % 2 == 0, max_tokens=4, index=i
                    )
                    for i in range(12)
                ]
        finally:
            client.loop.call_soon_threadsafe(stop.set)
            task.result(5)

    outcomes = asyncio.run(scenario())
    bad = [o for o in outcomes if o.kind != "ok"]
    assert not bad, bad
    asyncio.run(valid_requests_still_work(fs))


def _structures() -> st.SearchStrategy[Any]:
    leaves = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack can encode
        | st.floats()
        | st.text(max_size=20)
        | st.binary(max_size=20)
    )
    return st.recursive(
        leaves,
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=5),
        max_leaves=12,
    )


PAYLOADS = st.one_of(
    st.binary(max_size=256),
    _structures().map(lambda o: msgpack.packb(o, use_bin_type=True)),
    st.dictionaries(
        st.sampled_from(
            [
                "v",
                "request_id",
                "prompt",
                "messages",
                "adapter",
                "op",
                "share",
                "ttl_s",
                "round_id",
                "replica_id",
                "policy",
                "adapter_version",
                "sampling",
                "candidate_key",
                "to_version",
                "path",
            ]
        ),  # fmt: skip
        _structures(),
        max_size=6,
    ).map(lambda o: msgpack.packb(o, use_bin_type=True)),
)


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(payload=PAYLOADS)
def test_fuzzed_payloads_never_crash_a_service(
    fault_stack: FaultStack, client: LoopThread, payload: bytes
) -> None:
    fs = fault_stack
    bus = client.bus
    for name, subject in request_subjects(fs).items():
        code, took_s = client.run(ask(bus, subject, payload))
        # A payload may happen to be valid (then a normal reply); a refusal is never a 5xx.
        assert code is None or 400 <= code < 500, (name, code, payload[:80])
        assert took_s < REPLY_TIMEOUT_S
    for subject in (
        subjects.telemetry("fuzz"),
        subjects.routing_weights(),
        subjects.round_event(7, "opened"),
        subjects.adapter_published("fuzz"),
    ):
        client.run(bus.nc.publish(subject, payload))
    for subject in (subjects.samples(fs.replicas[0]), subjects.update(7, fs.replicas[0])):
        client.run(bus.js.publish(subject, payload, timeout=5))
    assert not fs.dead_children(), fs.dead_children()


def test_after_the_fuzzing_every_service_still_serves(fault_stack: FaultStack) -> None:
    asyncio.run(valid_requests_still_work(fault_stack))
