"""A replica that stops reporting is routed around and dropped from the round plan."""

from __future__ import annotations

import pytest

from collm_coordinator.core import CoordinatorCore
from tests.unit.coordinator.cluster import config, obs, tick

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("policy", ["collm", "separate", "fixed_ratio", "leftover"])
def test_silent_replica_is_routed_around_and_dropped_from_plans(policy: str) -> None:
    cfg = config(slow_interval_s=10.0, round_deadline_s=5.0, warmup_s=1.0)
    core = CoordinatorCore(cfg, policy)
    ids = ("r0", "r1", "r2", "r3")
    for t in range(0, 3):
        tick(core, float(t), *(obs(r, float(t), busy=0.2) for r in ids))
    # r3 falls silent at t=3; the others keep reporting.
    last = None
    for t in range(3, 25):
        last = tick(core, float(t), *(obs(r, float(t), busy=0.2) for r in ids[:3]))
        if t >= 3 + cfg.stale_after_s + 1:
            assert "r3" in last.diagnostics.stale
            assert "r3" not in {s.replica_id for s in last.fast.shares}
            if last.fast.routing is not None:
                assert last.fast.routing.weights.get("r3", 0.0) == 0.0
                for table in last.fast.routing.adapter_weights.values():
                    assert table.get("r3", 0.0) == 0.0
        if last.slow is not None and t > 3 + cfg.stale_after_s:
            for plan in last.slow.plans:
                assert "r3" not in {p.replica_id for p in plan.participants}
    assert last is not None
    plans_after = list(core.state.rounds.values())
    assert all("r3" not in {x.replica_id for x in r.plan.participants} for r in plans_after)


def test_stale_is_judged_on_receipt_time_not_replica_clock() -> None:
    core = CoordinatorCore(config(), "collm")
    # The replica's own clock is far behind; it is still live because it was received now.
    d = tick(core, 100.0, obs("r0", 100.0, ts_s=5.0))
    assert d.diagnostics.live == ("r0",)


def test_replica_that_comes_back_is_routed_again() -> None:
    core = CoordinatorCore(config(), "collm")
    tick(core, 0.0, obs("r0", 0.0), obs("r1", 0.0))
    d = tick(core, 5.0, obs("r0", 5.0))
    assert d.diagnostics.stale == ("r1",)
    d = tick(core, 6.0, obs("r0", 6.0), obs("r1", 6.0))
    assert d.diagnostics.stale == () and d.fast.routing.weights["r1"] > 0
