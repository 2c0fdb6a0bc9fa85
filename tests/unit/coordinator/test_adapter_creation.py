"""Adapters without a version are created by a replica that holds their data, once telemetry says so."""

from __future__ import annotations

import pytest

from collm_coordinator.core import AdapterVersionView, CoordinatorCore
from collm_coordinator.core.state_machine import CREATE_RETRY_S
from collm_coordinator.core.types import AdapterCreation
from tests.unit.coordinator.cluster import config, obs, tick

pytestmark = pytest.mark.unit


def test_a_missing_adapter_is_created_by_its_first_live_data_holder_and_asked_again_until_known() -> None:
    core = CoordinatorCore(config(warmup_s=3.0), "collm")
    assert tick(core, 0.0).creates == ()  # no telemetry yet: no domain, nothing to create
    d = tick(
        core,
        1.0,
        obs("r1", 1.0, domain="med", adapters=()),
        obs("r0", 1.0, domain="bank", samples=0, adapters=()),
    )
    assert d.creates == (AdapterCreation("med", "r1"),)  # r0 holds no samples: not a holder
    assert tick(core, 2.0, obs("r1", 2.0, domain="med", adapters=())).creates == ()  # asked already
    t = 1.0 + CREATE_RETRY_S
    assert tick(core, t, obs("r1", t, domain="med", adapters=())).creates == (AdapterCreation("med", "r1"),)
    t += 1.0
    versions = (AdapterVersionView("med", 1),)
    assert tick(core, t, obs("r1", t, domain="med", adapters=()), adapter_versions=versions).creates == ()
    t += CREATE_RETRY_S
    assert tick(core, t, obs("r1", t, domain="med", adapters=())).creates == ()  # known: never asked again


def test_the_first_slow_tick_comes_warmup_after_the_first_telemetry() -> None:
    core = CoordinatorCore(config(warmup_s=3.0, slow_interval_s=30.0), "collm")
    for t in range(10):  # replicas still loading their model: nothing reports
        assert tick(core, float(t)).slow is None
    slow_at = [
        t
        for t in range(10, 20)
        if tick(core, float(t), obs("r0", float(t)), adapter_versions=(AdapterVersionView("med", 1),)).slow
    ]
    assert slow_at == [13]


def test_an_adapter_without_evidence_borrows_the_gain_of_the_adapters_that_have_some() -> None:
    from collm_coordinator.core.state import ClusterState

    st = ClusterState(config(quality_prior_gain=0.1))
    st.ingest_telemetry(obs("r0", 0.0, domains=("med", "bank", "law"), adapters=()))
    med, bank = st.quality_of("med"), st.quality_of("bank")
    assert med.gain_coefficient == pytest.approx(0.1) == bank.gain_coefficient
    med.observe_round(20000.0, 2000.0, True, 2.0, 1.5)  # a large observed drop
    bank.observe_round(20000.0, 2000.0, True, 2.0, 1.9)
    law = st.quality_of("law")
    assert law.gain_coefficient == pytest.approx((med.gain_coefficient + bank.gain_coefficient) / 2)
    assert law.gain_coefficient > 0.1
    law.observe_round(20000.0, 2000.0, True, 2.0, 2.0)  # its own evidence now: the prior stays put
    prior = law.prior_gain
    med.observe_round(20000.0, 2000.0, True, 1.5, 1.0)
    assert st.quality_of("law").prior_gain == prior


def test_a_calibrated_domain_keeps_its_calibration_prior() -> None:
    from collm_coordinator.core.state import ClusterState

    st = ClusterState(config(quality_prior={"med": 0.3}))
    st.ingest_telemetry(obs("r0", 0.0, domains=("med", "bank"), adapters=()))
    st.quality_of("bank").observe_round(20000.0, 2000.0, True, 2.0, 1.0)
    assert st.quality_of("med").prior_gain == 0.3
