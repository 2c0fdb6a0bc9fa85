"""The attainment target binds from both sides: the signed virtual queue's negative part is headroom,
which lets shares grow while attainment stays above the target and is taken back when it falls."""

from __future__ import annotations

import pytest

from collm_coordinator.core import CoordinatorCore
from collm_coordinator.core.slow_loop import usable_share
from tests.unit.coordinator.cluster import config, obs, steady, tick

pytestmark = pytest.mark.unit

IDS = ("r0", "r1", "r2", "r3")


def shares(d) -> dict[str, float]:
    return {s.replica_id: s.share for s in d.fast.shares}


def test_headroom_grows_above_the_target_is_bounded_and_goes_first_when_attainment_falls() -> None:
    core = CoordinatorCore(config(), "collm")
    cfg = core.config
    st = core.state
    steady(core, 0.0, 2.0, dict.fromkeys(IDS, 0.3), attainment=1.0)
    h2 = st.target.headroom
    assert h2 > 0 and st.target.virtual_queue == 0.0
    d = steady(core, 3.0, 200.0, dict.fromkeys(IDS, 0.3), attainment=1.0)
    assert st.target.headroom == 1.0 and st.target.signed_queue == pytest.approx(
        -1.0 / cfg.headroom_gain
    )  # no wind-up
    assert d.diagnostics.headroom == 1.0
    # Attainment under the target: the headroom goes first, then Z grows.
    t = 201.0
    seen: list[tuple[float, float]] = []
    while st.target.virtual_queue == 0.0:
        steady(core, t, t, dict.fromkeys(IDS, 0.3), attainment=0.5)
        seen.append((st.target.headroom, st.target.virtual_queue))
        t += 1.0
        assert t < 260.0, "Z never grew"
    assert seen[0][0] < 1.0  # the first tick under the target already takes headroom back
    assert all(h == 0.0 for h, z in seen if z > 0)
    assert [h for h, _ in seen] == sorted((h for h, _ in seen), reverse=True)


def test_no_headroom_without_headroom_gain() -> None:
    core = CoordinatorCore(config(headroom_gain=0.0), "collm")
    d = steady(core, 0.0, 100.0, dict.fromkeys(IDS, 0.3), attainment=1.0)
    assert (
        core.state.target.headroom == 0.0
        and core.state.target.virtual_queue == 0.0
        and d.diagnostics.headroom == 0.0
    )


@pytest.mark.parametrize("load", [0.3, 0.6])
def test_usable_share_grows_with_headroom_to_max_share(load: float) -> None:
    core = CoordinatorCore(config(), "collm")
    steady(core, 0.0, 2.0, dict.fromkeys(IDS, load))
    cfg = core.config
    view = core.state.view(3.0, record_history=False)
    rooms = []
    for h in (0.0, 0.5, 1.0):
        core.state.target.signed_queue = -h / cfg.headroom_gain
        rooms.append(usable_share(core.state.view(3.0, record_history=False), "r0"))
    assert rooms == sorted(rooms)
    assert rooms[-1] == cfg.max_share
    assert rooms[0] < cfg.max_share
    assert view.displaced(0.4) == pytest.approx(0.4 * (1.0 - view.headroom))


def test_more_headroom_plans_more_training_at_the_same_load() -> None:
    planned = []
    for h in (0.0, 1.0):
        cfg = config(headroom_gain=1.0, util_cap=0.9)
        core = CoordinatorCore(cfg, "collm")
        t = 0.0
        while True:
            core.state.target.signed_queue = -h  # held for the experiment (attainment 1.0 would move it)
            d = tick(core, t, *(obs(r, t, busy=0.6) for r in IDS))
            if d.slow:
                break
            t += 1.0
        planned.append(sum(p.share for plan in d.slow.plans for p in plan.participants))
    assert planned[1] > planned[0] > 0


def test_with_headroom_a_burst_still_leaves_the_capacity_its_demand_needs() -> None:
    """Shares count (1 - h) of themselves against capacity: a burst cuts them until what they leave
    under that model covers the demand, in the same tick; with h = 1 the shares stand while the load
    fits the cluster, and the replicas whose own SLOs are at risk stop at once."""
    core = CoordinatorCore(config(), "collm")
    cfg = core.config
    steady(core, 0.0, 20.0, dict.fromkeys(IDS, 0.2), attainment=1.0)
    core.state.target.signed_queue = -0.5 / cfg.headroom_gain
    before = tick(core, 21.0, *(obs(r, 21.0, busy=0.2) for r in IDS))
    h = core.state.target.headroom
    assert 0.0 < h < 1.0 and sum(shares(before).values()) > 0
    t = 22.0
    after = tick(
        core, t, *(obs(r, t, busy=0.95 if r == "r1" else 0.8, queue=12 if r == "r1" else 0) for r in IDS)
    )
    s1 = shares(after)
    assert s1["r1"] == 0.0
    h = core.state.target.headroom
    left = cfg.burst_util * sum(1.0 - (1.0 - h) * s1[r] for r in IDS)
    assert left >= after.diagnostics.demand / cfg.burst_spike_factor - 1e-6
    assert all(s1[r] <= shares(before)[r] for r in IDS)


def spends(d) -> dict[str, float]:
    return {s.replica_id: s.spend for s in d.fast.shares}


def test_the_spend_follows_the_headroom_and_is_withdrawn_under_the_target() -> None:
    """While attainment stays above the target the replicas that train get a spend (training beyond their
    requests' slack) of spend_gain x h, in share steps; the first tick under the target withdraws it,
    while the headroom (an integral) goes only gradually."""
    core = CoordinatorCore(config(spend_gain=0.5), "collm")
    cfg = core.config
    d = steady(core, 0.0, 200.0, dict.fromkeys(IDS, 0.3), attainment=1.0)
    assert core.state.target.headroom == 1.0
    training = [s for s in d.fast.shares if s.share > 0]
    assert training and all(s.spend == pytest.approx(0.5) for s in training)
    assert all(s.spend == 0.0 for s in d.fast.shares if s.reason_code in ("idle", "slo_risk", "burst"))
    d = steady(core, 201.0, 201.0, dict.fromkeys(IDS, 0.3), attainment=0.5)
    assert core.state.target.headroom > 0.5 and all(v == 0.0 for v in spends(d).values())
    # Back above the target: the spend rises again, by at most spend_rise_per_s.
    before = core.state.target.spend
    steady(core, 202.0, 211.0, dict.fromkeys(IDS, 0.3), attainment=1.0)
    assert before == 0.0 < core.state.target.spend <= 10 * cfg.spend_rise_per_s + 1e-9


def test_no_spend_without_spend_gain() -> None:
    core = CoordinatorCore(config(spend_gain=0.0), "collm")
    d = steady(core, 0.0, 200.0, dict.fromkeys(IDS, 0.3), attainment=1.0)
    assert core.state.target.headroom == 1.0 and all(v == 0.0 for v in spends(d).values())


@pytest.mark.parametrize("spend_gain", [0.0, 1.0])
def test_a_tail_past_the_slo_is_the_price_of_a_spend_not_a_risk(spend_gain: float) -> None:
    """With headroom and a spend, a replica's TTFT p99 over the SLO does not stop its training (its
    windowed attainment under the target still does); without a spend it does."""
    core = CoordinatorCore(config(spend_gain=spend_gain, ttft_slo_ms=1000.0), "collm")
    steady(core, 0.0, 200.0, dict.fromkeys(IDS, 0.3), attainment=1.0)
    assert core.state.target.headroom == 1.0
    slow = obs("r0", 201.0, busy=0.3, ttft_ms_p99=1500.0)
    risk = core.state.risk_of(slow, 0.3)
    assert (risk is None) == (spend_gain > 0)
    missing = obs("r0", 201.0, busy=0.3, ttft_ms_p99=1500.0, attainment=0.5, finished=40)
    assert core.state.risk_of(missing, 0.3) is not None
