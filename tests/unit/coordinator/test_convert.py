"""Wire messages <-> core dataclasses, and the calibration priors."""

from __future__ import annotations

import math

import pytest

from collm_common.calibration import Calibration, CostModel, QualityCurve
from collm_common.wire import decode, encode
from collm_common.wire.rounds import RoundOutcome, RoundPlan
from collm_common.wire.telemetry import ReplicaTelemetry, ResidentAdapter, TrainingJobStatus
from collm_coordinator import convert
from collm_coordinator.core import CoordinatorCore
from collm_coordinator.priors import cost_prior, quality_prior
from tests.unit.coordinator.cluster import config, obs, tick

pytestmark = pytest.mark.unit


def test_telemetry_becomes_an_observation_stamped_on_receipt() -> None:
    t = ReplicaTelemetry(
        replica_id="r3",
        ts_unix_s=10.0,
        interval_s=1.0,
        model="m",
        queue_len=2,
        running=5,
        max_batch=16,
        arrivals_per_s=3.5,
        infer_busy_frac=0.4,
        slo_attainment=0.9,
        adapters=[ResidentAdapter(name="med", version_id="med@v2", version=2, in_flight=3)],
        training_jobs=[
            TrainingJobStatus(
                adapter="med",
                state="running",
                base_version_id="med@v2",
                round_id=4,
                tokens_done=100,
                token_budget=900,
            )
        ],
        local_samples=40,
        domains=["med"],
    )
    o = convert.observation(decode(ReplicaTelemetry, encode(t)), received_s=99.0)
    assert o.received_s == 99.0 and o.ts_s == 10.0
    assert (o.queue_len, o.running, o.max_batch, o.infer_busy_frac) == (2, 5, 16, 0.4)
    assert o.adapters[0].name == "med" and o.adapters[0].version == 2 and o.adapters[0].in_flight == 3
    assert o.training[0].round_id == 4 and o.training[0].tokens_done == 100
    assert o.domains == ("med",)


def test_plans_become_valid_round_plans_and_outcomes_become_events() -> None:
    core = CoordinatorCore(config(), "collm")
    t = 0.0
    while True:
        d = tick(core, t, obs("r0", t, busy=0.1), obs("r1", t, busy=0.1))
        if d.slow:
            break
        t += 1.0
    for plan in d.slow.plans:
        msg = decode(RoundPlan, encode(convert.round_plan_message(plan, "collm")))
        assert msg.round_id == 0 and msg.adapter == plan.adapter
        assert msg.quorum <= len(msg.participants)
        assert [p.token_budget for p in msg.participants] == [p.token_budget for p in plan.participants]
        assert msg.deadline_unix_s == plan.deadline_s
    out = RoundOutcome(
        round_id=5, adapter="med", state="published", base_version=1, new_version=2, accepted=["r0"]
    )
    ev = convert.round_event(out)
    assert (ev.round_id, ev.state, ev.new_version, ev.accepted) == (5, "published", 2, ("r0",))
    fast = convert.fast_message(d, d.fast)
    assert {r.replica_id for r in fast.replicas} == {"r0", "r1"}
    assert all(r.reason_code for r in fast.replicas)


def test_priors_from_a_calibration() -> None:
    # Test data (a calibration object built here, not a measurement).
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
        quality=[
            QualityCurve(
                domain="med",
                base_loss=3.0,
                points=[(n, 3.0 - 0.2 * math.log1p(n / 1e4)) for n in (1e3, 1e4, 1e5)],
            )
        ],
    )
    cp = cost_prior(cal, micro_tokens=64)
    assert cp.train_tokens_per_s == pytest.approx(1000 * 64 / (10 + 1.5 * 64))
    assert cp.decode_step_ms is not None and cp.decode_step_ms(16) == 40.0
    assert quality_prior(cal, 1e4) == {"med": pytest.approx(0.2)}
