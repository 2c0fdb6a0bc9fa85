"""The coordinator service against a real nats-server, with test doubles of replicas and the aggregator."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from collm_common import subjects
from collm_common.bus import Bus, BusError
from collm_common.calibration import Calibration, CostModel, QualityCurve
from collm_common.clock import WallClock
from collm_common.wire.control import (
    CoordinatorDecisions,
    CoordinatorStatus,
    CoordinatorStatusRequest,
    PolicyReply,
    RoutingWeights,
    SetPolicy,
)
from collm_coordinator.service import Coordinator
from collm_coordinator.settings import CoordinatorSettings
from tests.doubles.coordinator_peers import AggregatorDouble, Load, TelemetryReplica

pytestmark = pytest.mark.integration

FAST_S = 0.25
IDS = ("r0", "r1", "r2", "r3")


def calibration_file(tmp_path: Path) -> Path:
    """Test data in the calibration format (not a measurement): priors for training speed and quality."""
    cal = Calibration(
        model="test",
        device="cpu",
        torch_threads=1,
        measured_unix_s=0.0,
        command="test data",
        cost=CostModel(
            prefill_fixed_ms=5.0,
            prefill_ms_per_token=0.5,
            decode_step_ms={1: 20.0, 16: 40.0},
            train_fixed_ms=10.0,
            train_ms_per_token=1.5,
            max_batch=16,
        ),
        quality=[QualityCurve(domain="med", base_loss=3.0, points=[(1000, 2.9), (10000, 2.6)])],
    )
    p = tmp_path / "cal.json"
    cal.save(p)
    return p


def settings(url: str, tmp_path: Path, **kw: object) -> CoordinatorSettings:
    base: dict[str, object] = {
        "nats_url": url,
        "nats_connect_timeout_s": 5,
        "coordinator_use_store": False,
        "coordinator_fast_interval_s": FAST_S,
        "coordinator_slow_interval_s": 5.0,
        "coordinator_round_deadline_s": 4.0,
        "coordinator_stale_after_s": 1.0,
        "coordinator_warmup_s": 1.0,
        "coordinator_share_ttl_s": 2.0,
        "coordinator_routing_ttl_s": 2.0,
        "coordinator_control_timeout_s": 0.5,
        "coordinator_calibration_path": calibration_file(tmp_path),
    }
    base.update(kw)
    return CoordinatorSettings(**base)  # type: ignore[arg-type]


async def wait_for(pred, timeout_s: float = 10.0, what: str = "condition") -> Any:
    """`pred()`'s first truthy value, polled every 20 ms; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := pred():
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class Harness:
    def __init__(self, url: str, tmp_path: Path, with_aggregator: bool = True, **kw: object) -> None:
        self.url = url
        self.tmp_path = tmp_path
        self.with_aggregator = with_aggregator
        self.kw = kw
        self.weights: list[tuple[float, RoutingWeights]] = []
        self.decisions: list[CoordinatorDecisions] = []

    async def __aenter__(self) -> Harness:
        self.peers = await Bus.connect(
            CoordinatorSettings(nats_url=self.url, coordinator_use_store=False), "peers"
        )
        self.replicas = {r: TelemetryReplica(self.peers, r) for r in IDS}
        for rep in self.replicas.values():
            await rep.start()
        self.aggregator = AggregatorDouble(self.peers)
        if self.with_aggregator:
            await self.aggregator.start()

        async def on_weights(msg: RoutingWeights, _raw: object) -> None:
            self.weights.append((time.monotonic(), msg))

        async def on_decisions(msg: CoordinatorDecisions, _raw: object) -> None:
            self.decisions.append(msg)

        await self.peers.subscribe(subjects.routing_weights(), RoutingWeights, on_weights)
        await self.peers.subscribe(subjects.coordinator_decisions(), CoordinatorDecisions, on_decisions)
        self.bus = await Bus.connect(settings(self.url, self.tmp_path, **self.kw), "coordinator")
        self.coord = Coordinator(settings(self.url, self.tmp_path, **self.kw), self.bus, WallClock())
        await self.coord.start()
        await self.peers.sync()  # so that its first request finds the coordinator's endpoints
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.coord.stop()
        await self.bus.close()
        for rep in self.replicas.values():
            await rep.stop()
        await self.peers.close()

    def last_share(self, rid: str) -> float | None:
        s = self.replicas[rid].shares
        return s[-1].share if s else None


async def test_weights_shares_and_a_burst_cut_within_one_tick(nats_server, tmp_path: Path) -> None:
    # Shares count whole against capacity (no headroom), so this burst exceeds what the plan leaves; with
    # headroom the burst check counts (1 - h) of each share (tests/unit/coordinator/test_headroom.py).
    async with Harness(
        nats_server.url, tmp_path, coordinator_publish_weights=True, coordinator_headroom_gain=0.0
    ) as h:
        await wait_for(lambda: h.aggregator.plans, what="a round plan")
        plan = h.aggregator.plans[0]
        participants = [p.replica_id for p in plan.participants]
        assert plan.policy == "collm" and plan.adapter == "med" and participants
        # Shares rise toward the plan a step per tick: wait until every participant clearly trains.
        await wait_for(
            lambda: all((h.last_share(r) or 0) >= 0.5 for r in participants), what="participants training"
        )
        await asyncio.sleep(2 * FAST_S)
        await wait_for(lambda: len(h.weights) > 3, what="routing weights")
        before = h.weights[-1][1].weights
        assert set(before) == set(IDS) and math.isclose(sum(before.values()), 1.0, abs_tol=1e-3)
        # The burst: r1 queues deeply and everyone is busier.
        for rid, rep in h.replicas.items():
            rep.load = Load(util=0.95, queue_len=12) if rid == "r1" else Load(util=0.6)
        t_burst = max([await rep.publish_now() for rep in h.replicas.values()])
        pre = {r: [s.share for s in h.replicas[r].shares if s.t_s <= t_burst][-1] for r in participants}

        def cut(r: str) -> bool:
            return any(s.t_s > t_burst and s.share < pre[r] - 0.05 for s in h.replicas[r].shares)

        try:
            await wait_for(lambda: all(cut(r) for r in participants), timeout_s=3.0, what="shares cut")
        except AssertionError:
            raise AssertionError(
                f"pre {pre}; after {[(r, h.replicas[r].shares[-3:]) for r in participants]}; "
                f"t_burst {t_burst}"
            ) from None
        cut_at = max(min(s.t_s for s in h.replicas[r].shares if s.t_s > t_burst) for r in participants)
        # Within one fast tick (plus the command's round trip on a busy test machine).
        assert cut_at - t_burst <= FAST_S + 0.75, cut_at - t_burst
        if "r1" in participants:
            assert h.last_share("r1") == 0.0
        # Weights received after the burst's telemetry may come from a tick that ran before it reached the
        # coordinator: wait for the first that r1's queue has lowered, and for it to be the lowest.

        def lowered() -> dict[str, float] | None:
            fresh = [w.weights for t, w in h.weights if t > t_burst]
            return next((w for w in fresh if w["r1"] < before["r1"]), None)

        after = await wait_for(lowered, what="weights after the burst, r1's lowered")
        assert after["r1"] == min(after.values())
        reasons = {r.replica_id: r.reason_code for d in h.decisions if d.loop == "fast" for r in d.replicas}
        assert reasons["r1"] == "slo_risk"
        # The same reasons as Prometheus metrics.
        sample = REGISTRY.get_sample_value
        assert (sample("collm_coordinator_ticks_total", {"loop": "fast"}) or 0) > 5
        assert (sample("collm_coordinator_decisions_total", {"reason": "slo_risk"}) or 0) >= 1
        labels = {"replica": "r1", "collm_coordinator_share_reason": "slo_risk"}
        await wait_for(
            lambda: sample("collm_coordinator_share_reason", labels) == 1.0, what="r1's reason metric"
        )


async def test_above_the_target_share_commands_carry_a_spend_that_goes_when_attainment_falls(
    nats_server, tmp_path: Path
) -> None:
    """Replicas at attainment 1.0 against a target of 0.9: the headroom grows, and the share commands
    of the training replicas carry a spend (status says it too); once they report 0.5 the next
    commands carry none."""
    async with Harness(
        nats_server.url, tmp_path, coordinator_attainment_target=0.9, coordinator_spend_rise_per_s=10.0
    ) as h:
        await wait_for(lambda: h.aggregator.plans, what="a round plan")
        participants = [p.replica_id for p in h.aggregator.plans[0].participants]

        def spends() -> list[float]:
            return [h.replicas[r].shares[-1].spend for r in participants if h.replicas[r].shares]

        await wait_for(lambda: spends() and min(spends()) > 0, what="a spend on the training replicas")
        status = await h.peers.request(
            subjects.coordinator("status"), CoordinatorStatusRequest(), CoordinatorStatus, timeout_s=5
        )
        assert status.headroom > 0 and status.spend > 0
        for rep in h.replicas.values():
            rep.load = Load(slo_attainment=0.5)
        t_short = max([await rep.publish_now() for rep in h.replicas.values()])

        def withdrawn(r: str) -> bool:
            return any(s.t_s > t_short and s.spend == 0.0 for s in h.replicas[r].shares)

        await wait_for(lambda: all(withdrawn(r) for r in participants), timeout_s=3.0, what="spend withdrawn")


async def test_silent_replica_is_routed_around_and_status_says_so(nats_server, tmp_path: Path) -> None:
    async with Harness(nats_server.url, tmp_path, coordinator_publish_weights=True) as h:
        await wait_for(lambda: len(h.weights) > 2, what="routing weights")
        h.replicas["r3"].publishing = False
        t0 = time.monotonic()
        await wait_for(
            lambda: any(t > t0 + 1.0 and w.weights.get("r3", 0.0) == 0.0 for t, w in h.weights),
            timeout_s=5.0,
            what="r3 routed around",
        )
        status = await h.peers.request(
            subjects.coordinator("status"), CoordinatorStatusRequest(), CoordinatorStatus
        )
        assert "r3" in status.stale and "r3" not in status.live
        assert status.fast is not None and status.policy == "collm"
        assert {r.replica_id: r.reason_code for r in status.fast.replicas}["r3"] == "stale"


async def test_by_default_weights_are_decided_but_left_to_the_gateway(nats_server, tmp_path: Path) -> None:
    async with Harness(nats_server.url, tmp_path) as h:
        await wait_for(lambda: len([d for d in h.decisions if d.loop == "fast"]) > 3, what="fast decisions")
        assert h.weights == [], "collm publishes no routing weights unless COLLM_COORDINATOR_PUBLISH_WEIGHTS"
        fast = [d for d in h.decisions if d.loop == "fast"][-1]
        assert math.isclose(sum(r.routing_weight for r in fast.replicas), 1.0, abs_tol=1e-3)


async def test_a_slow_replica_never_blocks_the_tick(nats_server, tmp_path: Path) -> None:
    # r0 answers no command until the test lets it, and the coordinator would wait a minute for its
    # answer: a tick that waited for r0 would publish nothing more while r0 holds its command.
    r0_answers = asyncio.Event()
    async with Harness(
        nats_server.url,
        tmp_path,
        coordinator_warmup_s=0.5,
        coordinator_publish_weights=True,
        coordinator_control_timeout_s=60.0,
    ) as h:
        r0 = h.replicas["r0"]
        r0.hold = r0_answers
        try:
            await wait_for(lambda: h.aggregator.plans, what="a round plan")
            await wait_for(lambda: r0.held > 0, what="a command to r0 that it does not answer")
            t0 = time.monotonic()
            n0 = len(h.weights)
            others = [r for r in IDS if r != "r0"]

            # While r0 holds its command, weights keep coming every fast tick and the others get
            # commands (shares are refreshed every half TTL, 1 s).
            def ticking() -> bool:
                return len(h.weights) - n0 >= int(2.0 / FAST_S) - 3 and all(
                    any(s.t_s > t0 for s in h.replicas[r].shares) for r in others
                )

            await wait_for(ticking, timeout_s=30.0, what="weights and the others' commands")
            assert r0.held > 0 and not r0.shares, "r0 still holds its command, unanswered"
        finally:
            r0_answers.set()


async def test_without_aggregator_the_fast_loop_runs_and_rounds_cannot_open(
    nats_server, tmp_path: Path
) -> None:
    async with Harness(
        nats_server.url, tmp_path, with_aggregator=False, coordinator_publish_weights=True
    ) as h:
        await wait_for(
            lambda: h.coord.aggregator_available is False, timeout_s=5.0, what="open_round to fail"
        )
        n = len(h.weights)
        # Weights keep being published: three more fast ticks.
        await wait_for(lambda: len(h.weights) >= n + 3, what="weights to keep being published")
        assert all((h.last_share(r) or 0.0) == 0.0 for r in IDS), "no round, no training share"
        status = await h.peers.request(
            subjects.coordinator("status"), CoordinatorStatusRequest(), CoordinatorStatus
        )
        assert status.aggregator_available is False and status.rounds == []


async def test_policy_endpoint_reads_and_sets(nats_server, tmp_path: Path) -> None:
    async with Harness(nats_server.url, tmp_path) as h:
        reply = await h.peers.request(subjects.coordinator("policy"), SetPolicy(), PolicyReply)
        assert reply.policy == "collm" and "leftover" in reply.policies
        reply = await h.peers.request(
            subjects.coordinator("policy"), SetPolicy(policy="separate"), PolicyReply
        )
        assert (reply.previous, reply.policy) == ("collm", "separate")
        t0 = time.monotonic()
        await wait_for(
            lambda: any(t > t0 and w.policy == "separate" for t, w in h.weights), what="separate weights"
        )
        with pytest.raises(BusError) as err:
            await h.peers.request(subjects.coordinator("policy"), SetPolicy(policy="fastest"), PolicyReply)
        assert err.value.code == 400 and "unknown policy" in err.value.message


async def test_module_entrypoint_serves_and_stops_cleanly(nats_server) -> None:
    env = {
        **os.environ,
        "COLLM_NATS_URL": nats_server.url,
        "COLLM_COORDINATOR_USE_STORE": "false",
        "COLLM_LOG_JSON": "false",
    }
    proc = subprocess.Popen([sys.executable, "-m", "collm_coordinator"], env=env, stderr=subprocess.PIPE)
    try:
        bus = await Bus.connect(
            CoordinatorSettings(nats_url=nats_server.url, coordinator_use_store=False), "t"
        )
        try:
            deadline = time.monotonic() + 20
            info = None
            while time.monotonic() < deadline and info is None:
                try:
                    raw = await bus.nc.request("$SRV.INFO.collm-coordinator", b"", timeout=0.5)
                    info = json.loads(raw.data)
                except Exception:
                    await asyncio.sleep(0.2)
            assert info is not None, "the coordinator never answered $SRV.INFO"
            assert {e["name"] for e in info["endpoints"]} == {"status", "policy"}
        finally:
            await bus.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(15)
    assert code == 0, proc.stderr.read().decode() if proc.stderr else ""


def test_bad_settings_exit_with_code_2(nats_server) -> None:
    env = {**os.environ, "COLLM_NATS_URL": nats_server.url, "COLLM_COORDINATOR_FAST_INTERVAL_S": "90"}
    proc = subprocess.run(
        [sys.executable, "-m", "collm_coordinator"], env=env, capture_output=True, timeout=30
    )
    assert proc.returncode == 2
    assert b"must be shorter" in proc.stderr
