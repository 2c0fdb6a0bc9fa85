"""The virtual queue Z grows while attainment falls short of the target, and drains otherwise."""

from __future__ import annotations

import pytest

from collm_coordinator.core import CoordinatorCore
from tests.unit.coordinator.cluster import config, obs, tick

pytestmark = pytest.mark.unit


def run(core: CoordinatorCore, t0: int, t1: int, attainment: float) -> list[float]:
    zs = []
    for t in range(t0, t1):
        d = tick(core, float(t), *(obs(r, float(t), busy=0.2, attainment=attainment) for r in ("r0", "r1")))
        zs.append(d.diagnostics.virtual_queue)
    return zs


def test_virtual_queue_grows_while_short_and_drains_after() -> None:
    core = CoordinatorCore(config(attainment_target=0.95), "collm")
    short = run(core, 0, 20, attainment=0.7)
    assert short[0] >= 0
    assert all(b > a for a, b in zip(short[1:], short[2:], strict=False)), short
    peak = short[-1]
    assert peak > 0
    good = run(core, 20, 200, attainment=1.0)
    assert all(b <= a for a, b in zip(good, good[1:], strict=False))
    assert good[-1] == 0.0 and peak > good[0]


def test_virtual_queue_growth_follows_the_shortfall() -> None:
    a = CoordinatorCore(config(attainment_target=0.95), "collm")
    b = CoordinatorCore(config(attainment_target=0.95), "collm")
    za = run(a, 0, 10, attainment=0.9)[-1]
    zb = run(b, 0, 10, attainment=0.6)[-1]
    assert zb > za > 0


def test_the_virtual_queue_stops_at_its_bound_so_a_past_shortfall_is_paid_for_minutes_not_hours() -> None:
    """Z stops at `max_virtual_queue`: after a long shortfall it drains in bounded time (at 0.95 and
    attainment 1.0, gain 10 and 30-s rounds: 3 / (10 x 0.05 / 30) = 180 s), where an unbounded Z would
    hold training back for as long as the shortfall lasted."""
    bounded = CoordinatorCore(config(attainment_target=0.95), "collm")
    unbounded = CoordinatorCore(config(attainment_target=0.95, max_virtual_queue=1e9), "collm")
    for core in (bounded, unbounded):
        run(core, 0, 600, attainment=0.5)
    assert bounded.state.target.virtual_queue == bounded.config.max_virtual_queue == 3.0
    assert unbounded.state.target.virtual_queue > 30.0
    drained = run(bounded, 600, 800, attainment=1.0)
    assert 0.0 in drained and drained.index(0.0) <= 181


def test_large_virtual_queue_plans_less_training() -> None:
    def planned(z: float) -> int:
        # Unbounded, so that a huge Z is held (the bound is max_virtual_queue, 3 by default).
        core = CoordinatorCore(config(max_virtual_queue=1e9), "collm")
        t = 0.0
        while True:
            core.state.target.virtual_queue = z
            d = tick(core, t, *(obs(f"r{i}", t, busy=0.3) for i in range(4)))
            if d.slow:
                return sum(p.token_budget for plan in d.slow.plans for p in plan.participants)
            t += 1.0

    free, tight, frozen = planned(0.0), planned(2.0), planned(1e6)
    assert free > tight > frozen
    assert frozen == 0


def test_an_idle_cluster_has_no_attainment_and_its_queue_holds() -> None:
    """Once no request finishes in any replica's window, the attainment is unknown (None: what status and
    the dashboard show), not the last one measured, and the virtual queue holds where it was."""
    core = CoordinatorCore(config(attainment_target=0.95), "collm")
    z = run(core, 0, 10, attainment=0.0)[-1]
    assert core.state.target.last_attainment == 0.0 and z > 0
    for t in range(10, 20):
        idle = (obs(r, float(t), busy=0.0, attainment=None, finished=0) for r in ("r0", "r1"))
        d = tick(core, float(t), *idle)
    assert core.state.target.last_attainment is None
    assert d.diagnostics.virtual_queue == z
