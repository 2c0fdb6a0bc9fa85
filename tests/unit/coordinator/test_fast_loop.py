"""The fast loop: a burst cuts fine-tuning shares within one tick and routing shifts to slack."""

from __future__ import annotations

import pytest

from collm_coordinator.core import CoordinatorCore, SentShare, share_command_due
from tests.unit.coordinator.cluster import config, obs, steady, tick

pytestmark = pytest.mark.unit

IDS = ("r0", "r1", "r2", "r3")


def shares(d) -> dict[str, float]:
    return {s.replica_id: s.share for s in d.fast.shares}


def codes(d) -> dict[str, str]:
    return {s.replica_id: s.reason_code for s in d.fast.shares}


def trained_cluster() -> tuple[CoordinatorCore, object]:
    """Four lightly loaded replicas, a round planned at t=3 and shares recovered to plan by t=12. Shares
    count whole against serving capacity (`headroom_gain=0`; with headroom: test_headroom.py)."""
    core = CoordinatorCore(config(headroom_gain=0.0), "collm")
    d = steady(core, 0.0, 12.0, dict.fromkeys(IDS, 0.2))
    assert d is not None and d.fast is not None
    assert core.state.rounds, "a round should be in flight"
    assert sum(shares(d).values()) > 0.5, "light load: the plan trains"
    return core, d


def test_burst_cuts_shares_within_one_tick_and_routes_to_slack() -> None:
    core, before = trained_cluster()
    # One tick later a burst lands: r1 queues deeply, every replica is busier.
    t = 13.0
    after = tick(
        core,
        t,
        obs("r0", t, busy=0.5),
        obs("r1", t, busy=0.95, queue=12),
        obs("r2", t, busy=0.5),
        obs("r3", t, busy=0.5),
    )
    s0, s1 = shares(before), shares(after)
    assert all(s1[r] <= s0[r] for r in IDS)
    assert s1["r1"] == 0.0 and codes(after)["r1"] == "slo_risk"
    # The cluster-wide burst cuts every other participant too, in this same tick.
    assert all(codes(after)[r] == "burst" for r in ("r0", "r2", "r3") if s0[r] > 0)
    assert sum(s1.values()) < sum(s0.values())
    # What training leaves covers the burst's demand (a one-second spike counts at 1/burst_spike_factor).
    cfg = core.config
    left = cfg.burst_util * sum(1.0 - s1[r] for r in IDS)
    assert left >= after.diagnostics.demand / cfg.burst_spike_factor - 1e-6
    w0, w1 = before.fast.routing.weights, after.fast.routing.weights
    assert w1["r1"] < w0["r1"]
    assert w1["r1"] == min(w1.values())
    assert sum(w1[r] for r in ("r0", "r2", "r3")) > sum(w0[r] for r in ("r0", "r2", "r3"))


def test_share_recovers_gradually_after_burst() -> None:
    core, before = trained_cluster()
    planned = shares(before)
    t = 13.0
    tick(core, t, *(obs(r, t, busy=0.95, queue=12) for r in IDS))
    prev = dict.fromkeys(IDS, 0.0)
    for k in range(1, 6):
        t = 13.0 + k
        d = tick(core, t, *(obs(r, t, busy=0.2) for r in IDS))
        now = shares(d)
        for r in IDS:
            assert now[r] <= prev[r] + core.config.share_recover_per_tick + 1e-9
            assert now[r] <= planned[r] + 1e-9
        prev = now


def test_a_share_cut_to_zero_rises_to_the_burst_level_while_the_burst_lasts() -> None:
    """A lasting load above what the planned shares leave, but below the cluster's capacity: shares an
    SLO risk cut to 0 climb back gradually to the cut share (planned x factor), never past it, instead of
    staying at 0 for as long as the load lasts."""
    core, before = trained_cluster()
    planned = shares(before)
    cfg = core.config
    t = 13.0
    tick(core, t, *(obs(r, t, busy=0.95, queue=12) for r in IDS))
    prev = dict.fromkeys(IDS, 0.0)
    for k in range(1, 12):
        t = 13.0 + k
        d = tick(core, t, *(obs(r, t, busy=0.6) for r in IDS))
        now = shares(d)
        assert all(c == "burst" for c in codes(d).values()), d.fast.reason
        factor = float(d.fast.reason.rsplit("x", 1)[1])
        for r in IDS:
            assert now[r] <= prev[r] + cfg.share_recover_per_tick + 1e-9
            assert now[r] <= planned[r] * factor + 5e-3  # the factor is printed to 2 decimals
        # What training leaves still covers the demand the cut was computed for.
        assert cfg.burst_util * sum(1.0 - now[r] for r in IDS) >= d.diagnostics.demand - 1e-6
        prev = now
    # By the end every share sits at its cut level (the load and so the factor stay the same).
    assert all(now[r] == pytest.approx(planned[r] * factor, abs=5e-3) for r in IDS)
    assert all(now[r] > 0.3 for r in IDS)


def test_single_replica_risk_does_not_cut_the_others_without_cluster_burst() -> None:
    core, before = trained_cluster()
    t = 13.0
    after = tick(core, t, obs("r0", t, busy=0.2), obs("r1", t, busy=0.2, queue=9), obs("r2", t, busy=0.2),
                 obs("r3", t, busy=0.2))  # fmt: skip
    assert codes(after)["r1"] == "slo_risk" and shares(after)["r1"] == 0.0
    for r in ("r0", "r2", "r3"):
        assert shares(after)[r] == pytest.approx(shares(before)[r])


def test_low_attainment_alone_puts_a_replica_at_risk() -> None:
    core, _ = trained_cluster()
    t = 13.0
    after = tick(core, t, *(obs(r, t, busy=0.2, attainment=0.5 if r == "r2" else 1.0) for r in IDS))
    assert codes(after)["r2"] == "slo_risk"


@pytest.mark.parametrize(
    ("finished", "attainment", "z", "at_risk"),
    [
        (15, 14 / 15, 1.0, False),  # one miss in 15: under 0.95, but not with confidence
        (15, 13 / 15, 1.0, True),  # two misses in 15
        (30, 28 / 30, 1.0, False),
        (30, 27 / 30, 1.0, True),
        (15, 14 / 15, 0.0, True),  # z = 0: the measured attainment itself
        (4, 0.5, 1.0, False),  # too few requests to judge (min_finished_for_attainment)
    ],
)
def test_attainment_risk_needs_confidence(finished: int, attainment: float, z: float, at_risk: bool) -> None:
    core = CoordinatorCore(config(risk_attainment_z=z), "collm")
    o = obs("r0", 0.0, busy=0.2, attainment=attainment, finished=finished)
    why = core.state.risk_of(o, 0.2)
    assert (why is not None) == at_risk, why
    if at_risk:
        assert why is not None and why.startswith(f"attainment {attainment:.2f} of {finished} < 0.95")


def test_attainment_upper_bound_is_the_wilson_interval() -> None:
    from collm_coordinator.core.state import attainment_upper_bound

    # 14 of 15 at one sigma, by hand: centre (p + 1/30) / (1 + 1/15), half-width
    # sqrt(p (1 - p) / 15 + 1/900) / (1 + 1/15).
    p = 14 / 15
    hand = (p + 1 / 30 + (p * (1 - p) / 15 + 1 / 900) ** 0.5) / (1 + 1 / 15)
    assert attainment_upper_bound(p, 15, 1.0) == pytest.approx(hand)
    assert attainment_upper_bound(1.0, 15, 1.0) == 1.0
    assert attainment_upper_bound(0.8, 15, 0.0) == 0.8


def test_routing_prefers_resident_adapter() -> None:
    core = CoordinatorCore(config(), "collm")
    t = 0.0
    d = tick(core, t, obs("r0", t, adapters=("med",)), obs("r1", t, adapters=("bank",)))
    aw = d.fast.routing.adapter_weights
    assert aw["med"]["r0"] > aw["med"]["r1"]
    assert aw["bank"]["r1"] > aw["bank"]["r0"]
    assert sum(aw["med"].values()) == pytest.approx(1.0, abs=1e-3)


def test_collm_weights_are_computed_but_not_published_by_default() -> None:
    core = CoordinatorCore(config(publish_weights=False), "collm")
    d = tick(core, 0.0, obs("r0", 0.0), obs("r1", 0.0))
    assert d.fast.routing is not None and d.fast.routing.publish is False
    core = CoordinatorCore(config(), "separate")
    d = tick(core, 0.0, obs("r0", 0.0), obs("r1", 0.0))
    assert d.fast.routing is not None and d.fast.routing.publish is True


def test_one_noisy_second_is_not_a_burst_but_a_sustained_rise_is() -> None:
    core, before = trained_cluster()
    planned = shares(before)
    # One replica's second is busier than usual (a long prompt): a spike below burst_spike_factor.
    t = 13.0
    d = tick(core, t, *(obs(r, t, busy=0.2 if r != "r0" else 0.45) for r in IDS))
    assert all(c in ("slack", "recovering") for c in codes(d).values()), codes(d)
    assert shares(d) == pytest.approx(planned)
    # The same level held for the whole burst window is a burst.
    for k in range(1, 4):
        t = 13.0 + k
        d = tick(core, t, *(obs(r, t, busy=0.45) for r in IDS))
    assert any(c == "burst" for c in codes(d).values())
    assert sum(shares(d).values()) < sum(planned.values())


def test_a_share_is_sent_when_new_changed_or_half_its_ttl_old() -> None:
    sent = SentShare(0.3, 0.2, 10.0)
    assert share_command_due(None, 0.3, 0.0, 10.0, 5.0)
    assert not share_command_due(sent, 0.3, 0.2, 12.4, 5.0)  # unchanged, 2.4 s old of a 5-s TTL
    assert not share_command_due(sent, 0.3005, 0.2005, 11.0, 5.0)  # a change under 1e-3 is no change
    assert share_command_due(sent, 0.3, 0.2, 12.5, 5.0)  # half the TTL: sent again before it expires
    assert share_command_due(sent, 0.0, 0.2, 10.5, 5.0)  # changed: sent at once
    assert share_command_due(sent, 0.3, 0.0, 10.5, 5.0)  # the spend changed: sent at once


def test_a_load_swinging_about_capacity_keeps_the_replica_at_risk() -> None:
    """One-second loads of a saturated batching engine swing with the prompts that land in them: a
    replica reporting 1.5 and 0.8 in turn stays at risk every second (its mean over `burst_window_s`
    is over capacity), where the latest sample alone cleared the risk every other second and let a
    round be planned there; a spike counts at once, and a load that falls and stays low clears within
    the window."""
    core = CoordinatorCore(config(burst_window_s=3.0), "collm")
    st = core.state

    def risk_at(t: float, busy: float) -> str | None:
        st.ingest_telemetry(obs("r0", t, busy=busy))
        return st.view(t, record_history=True).at_risk.get("r0")

    assert risk_at(0.0, 0.8) is None
    assert risk_at(1.0, 1.5) == "serving load 1.50 above cap 0.90"  # a spike: at once
    for t in range(2, 10):
        why = risk_at(float(t), 0.8 if t % 2 == 0 else 1.5)
        assert why is not None and why.startswith("serving load 1."), (t, why)
    # Falls to 0.5 and stays: the window still holds the swing at t = 10 (1.5, 0.8, 1.5, 0.5), not at 11.
    why = risk_at(10.0, 0.5)
    assert why is not None and why.startswith("serving load 1.07")
    assert risk_at(11.0, 0.5) is None
