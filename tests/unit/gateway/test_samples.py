"""Routing uploaded training samples to replicas, and refusing a batch before anything is published."""

from __future__ import annotations

import pytest

from collm_common.clock import VirtualClock
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_gateway.cluster import ClusterView
from collm_gateway.errors import APIError
from collm_gateway.routing import RoutingConfig
from collm_gateway.samples import ReplicaData, SampleIntake, SamplesIn, choose_replica
from collm_gateway.settings import GatewaySettings

pytestmark = pytest.mark.unit


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
