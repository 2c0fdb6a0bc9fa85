"""Routing uploaded training samples to replicas, and refusing a batch before anything is published."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import PubAck
from nats.js.errors import BadRequestError, ServiceUnavailableError

from collm_common.clock import VirtualClock
from collm_common.wire.adapters import TrainingSample
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_gateway.cluster import ClusterView
from collm_gateway.errors import APIError
from collm_gateway.routing import RoutingConfig
from collm_gateway.samples import ReplicaData, SampleIntake, SamplesIn, choose_replica, transient
from collm_gateway.settings import GatewaySettings

pytestmark = pytest.mark.unit

T = TypeVar("T")


def test_choose_replica_prefers_fresh_replicas_with_the_domain_and_fewest_samples() -> None:
    replicas = [
        ReplicaData("r0", True, ("medical",), 100),
        ReplicaData("r1", True, ("medical", "math"), 10),
        ReplicaData("r2", False, ("math",), 0),  # stale: never chosen
    ]
    assert choose_replica("medical", replicas, {}) == "r1"
    assert choose_replica("medical", replicas, {"r1": 89}) == "r1"  # 99 vs 100
    assert choose_replica("medical", replicas, {"r1": 91}) == "r0"
    assert choose_replica("math", replicas, {}) == "r1"
    assert choose_replica("legal", replicas, {}) is None
    assert (
        choose_replica("x", [ReplicaData("b", True, ("x",), 0), ReplicaData("a", True, ("x",), 0)], {}) == "a"
    )


class _Bus:
    connected = True


def intake(**kw: object) -> tuple[SampleIntake, ClusterView]:
    clock = VirtualClock()
    cluster = ClusterView(clock, RoutingConfig())
    s = GatewaySettings(**kw)  # type: ignore[arg-type]
    return SampleIntake(s, _Bus(), cluster, clock), cluster  # type: ignore[arg-type]


def telemetry(rid: str, domains: list[str], samples: int) -> ReplicaTelemetry:
    return ReplicaTelemetry(
        replica_id=rid, ts_unix_s=0.0, interval_s=1.0, model="m", domains=domains, local_samples=samples
    )


def batch(*items: dict[str, object]) -> SamplesIn:
    return SamplesIn.model_validate({"samples": list(items)})


def test_plan_spreads_a_batch_and_keeps_named_replicas() -> None:
    si, cluster = intake()
    cluster.on_telemetry(telemetry("r0", ["medical"], 3))
    cluster.on_telemetry(telemetry("r1", ["medical"], 0))
    planned = si.plan(
        batch(
            *[{"domain": "medical", "prompt": f"p{i}", "response": "r"} for i in range(6)],
            {"replica_id": "r9", "prompt": "p", "response": "r", "sample_id": "mine"},
        )
    )
    targets = [p.replica_id for p in planned]
    assert targets[:6].count("r1") == 4 and targets[:6].count("r0") == 2  # 3+2 vs 0+4: balanced
    assert targets[6] == "r9" and planned[6].sample_id == "mine"
    assert len({p.sample_id for p in planned}) == 7
    assert all(p.received_unix_s == pytest.approx(VirtualClock().now()) for p in planned)


def test_plan_refuses_unroutable_oversized_and_too_many_samples() -> None:
    si, cluster = intake(max_samples_per_request=2)
    cluster.on_telemetry(telemetry("r0", ["medical"], 0))
    with pytest.raises(APIError) as err:
        si.plan(batch({"prompt": "p", "response": "r"}))
    assert err.value.status == 422 and err.value.param == "samples.0.replica_id"
    with pytest.raises(APIError) as err:
        si.plan(
            batch(
                {"domain": "medical", "prompt": "p", "response": "r"},
                {"domain": "law", "prompt": "p", "response": "r"},
            )
        )
    assert err.value.status == 422 and "'law'" in err.value.message and "medical" in err.value.message
    with pytest.raises(APIError) as err:
        si.plan(batch(*[{"replica_id": "r0", "prompt": "p", "response": "r"}] * 3))
    assert err.value.status == 413
    with pytest.raises(APIError) as err:
        si.plan(batch({"replica_id": "r0", "prompt": "x" * 300_000, "response": "r"}))
    assert err.value.status == 413 and err.value.code == "sample_too_large"


# --- publishing: transient failures are retried within samples_ack_timeout_s ---------------------------
class ScriptedJetStream:
    """Test double of a JetStream context: `publish` raises the scripted failures in order, then acks."""

    def __init__(self, failures: list[Exception]) -> None:
        self.failures = list(failures)
        self.attempts = 0

    async def publish(self, subject: str, payload: bytes, **kw: object) -> PubAck:
        self.attempts += 1
        if self.failures:
            raise self.failures.pop(0)
        return PubAck(stream="COLLM_SAMPLES", seq=self.attempts, duplicate=self.attempts > 1)


class _JsBus:
    """The bus as the intake sees it: its JetStream context, connected from `connected_after_s` on."""

    def __init__(self, js: ScriptedJetStream, clock: VirtualClock, connected_after_s: float = 0.0) -> None:
        self.js = js
        self.clock = clock
        self._up_at = clock.monotonic() + connected_after_s

    @property
    def connected(self) -> bool:
        return self.clock.monotonic() >= self._up_at


def publishing_intake(
    js: ScriptedJetStream, ack_timeout_s: float, clock: VirtualClock, connected_after_s: float = 0.0
) -> SampleIntake:
    si = SampleIntake(
        GatewaySettings(samples_ack_timeout_s=ack_timeout_s),
        _JsBus(js, clock, connected_after_s),  # type: ignore[arg-type]
        ClusterView(clock, RoutingConfig()),
        clock,
    )
    si._streams_ready = True  # the streams exist (ensure_streams is the bus's, tested in integration)
    return si


async def on_clock(clock: VirtualClock, work: Awaitable[T]) -> T:
    """`work`'s result (or its exception), the clock moved 10 ms at a time while it waits."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await clock.run_for(0.01)
    return task.result()


def one_sample() -> list[TrainingSample]:
    return [TrainingSample(sample_id="s1", replica_id="r0", prompt="p", response="r")]


def test_transient_failures_are_those_a_retry_may_get_past() -> None:
    assert transient(NoRespondersError())
    assert transient(NatsTimeoutError())
    assert transient(
        ServiceUnavailableError(code=503, description="JetStream system temporarily unavailable")
    )
    assert not transient(BadRequestError(code=400, description="duplicate message id is in process"))


async def test_a_publish_is_retried_past_a_leader_election() -> None:
    js, clock = ScriptedJetStream([NoRespondersError(), NatsTimeoutError()]), VirtualClock()
    acked = await on_clock(clock, publishing_intake(js, 5.0, clock).publish(one_sample()))
    assert js.attempts == 3
    assert acked == [
        {"sample_id": "s1", "replica_id": "r0", "stream": "COLLM_SAMPLES", "seq": 3, "duplicate": True}
    ]


async def test_retries_stop_at_the_ack_timeout_and_a_refusal_is_final() -> None:
    js, clock = ScriptedJetStream([NoRespondersError()] * 1000), VirtualClock()
    t0 = clock.monotonic()
    with pytest.raises(APIError) as err:
        await on_clock(clock, publishing_intake(js, 0.5, clock).publish(one_sample()))
    assert err.value.status == 503 and err.value.code == "samples_not_stored"
    assert 0.3 < clock.monotonic() - t0 < 1.5 and 3 <= js.attempts <= 6
    js = ScriptedJetStream([BadRequestError(code=400, description="refused")])
    with pytest.raises(APIError) as err:
        await on_clock(clock, publishing_intake(js, 5.0, clock).publish(one_sample()))
    assert err.value.status == 503 and js.attempts == 1


async def test_an_upload_waits_for_a_reconnect_then_gives_up() -> None:
    js, clock = ScriptedJetStream([]), VirtualClock()
    acked = await on_clock(
        clock, publishing_intake(js, 5.0, clock, connected_after_s=0.3).publish(one_sample())
    )
    assert [a["seq"] for a in acked] == [1]
    js = ScriptedJetStream([])
    t0 = clock.monotonic()
    with pytest.raises(APIError) as err:
        await on_clock(clock, publishing_intake(js, 0.4, clock, connected_after_s=60).publish(one_sample()))
    assert err.value.status == 503 and "NATS is unreachable" in err.value.message
    assert 0.3 < clock.monotonic() - t0 < 1.0 and js.attempts == 0
