"""Under overload the target in force is a fraction of what serving alone attains (`good_alone` in the
replicas' reports), so a target the load cannot allow does not just cut training; where the load allows
it, the configured target stays."""

from __future__ import annotations

import pytest

from collm_coordinator.core import CoordinatorCore
from tests.unit.coordinator.cluster import config, obs, tick

pytestmark = pytest.mark.unit


def run(core: CoordinatorCore, t0: int, t1: int, attainment: float, alone: float | None) -> None:
    for t in range(t0, t1):
        good_alone = None if alone is None else round(40 * alone)
        reports = (
            obs(r, float(t), busy=0.2, attainment=attainment, finished=40, good_alone=good_alone)
            for r in ("r0", "r1")
        )
        tick(core, float(t), *reports)


def test_under_overload_the_target_in_force_follows_the_attainable_level() -> None:
    """Serving alone would attain 0.55 and the replicas attain 0.56: the target in force is 0.97 x 0.55
    (0.53), Z stays 0 and the headroom lets training grow, where the absolute target (0.95) holds Z at
    its bound and plans no training beyond the slack."""
    relative = CoordinatorCore(config(attainment_target=0.95), "collm")
    absolute = CoordinatorCore(config(attainment_target=0.95, attainable_frac=0.0), "collm")
    for core in (relative, absolute):
        run(core, 0, 300, attainment=0.5625, alone=0.55)
    rel, ab = relative.state.target, absolute.state.target
    assert rel.attainable == pytest.approx(0.55)
    assert rel.effective_target == pytest.approx(0.97 * 0.55)
    assert rel.virtual_queue == 0.0 and rel.headroom > 0 and rel.spend > 0
    assert ab.effective_target == 0.95
    assert ab.virtual_queue == absolute.config.max_virtual_queue and ab.spend == 0.0


def test_below_the_target_in_force_z_still_grows() -> None:
    """Attainable 0.55 but the replicas attain 0.4 (training costs too much): Z grows as before."""
    core = CoordinatorCore(config(attainment_target=0.95), "collm")
    run(core, 0, 60, attainment=0.4, alone=0.55)
    assert core.state.target.virtual_queue > 0 and core.state.target.spend == 0.0


def test_where_serving_alone_reaches_the_target_it_stays_as_configured() -> None:
    core = CoordinatorCore(config(attainment_target=0.95), "collm")
    run(core, 0, 120, attainment=0.9, alone=1.0)
    assert core.state.target.effective_target == 0.95
    assert core.state.target.virtual_queue > 0  # 0.9 < 0.95: short of the target


def test_without_good_alone_the_target_is_absolute() -> None:
    """Replicas that do not measure good_alone (None) leave the attainable level unknown."""
    core = CoordinatorCore(config(attainment_target=0.95), "collm")
    run(core, 0, 60, attainment=0.5, alone=None)
    assert core.state.target.attainable is None and core.state.target.effective_target == 0.95


def test_the_attainable_level_moves_with_its_time_constant() -> None:
    """From 1.0 to 0.5 measured: after one time constant (60 s) it has come ~63% of the way."""
    core = CoordinatorCore(config(attainment_target=0.95), "collm")
    run(core, 0, 10, attainment=1.0, alone=1.0)
    run(core, 10, 70, attainment=0.5, alone=0.5)
    assert core.state.target.attainable == pytest.approx(1.0 - 0.5 * 0.632, abs=0.02)
