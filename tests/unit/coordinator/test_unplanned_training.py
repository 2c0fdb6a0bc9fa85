"""Replicas that train outside the coordinator's plan: a round opened by the aggregator's built-in planner
or an operator, or a local job, gets a share from the fast loop's rule (fast_loop.py) under every
co-located policy, and `separate`'s serving side stays at 0."""

from __future__ import annotations

import pytest

from collm_coordinator.core import CoordinatorCore, RoundEvent, TrainingProgress
from tests.unit.coordinator.cluster import config, obs, tick

pytestmark = pytest.mark.unit

IDS = ("r0", "r1", "r2", "r3")
# Round 41 of `shared`, opened on the aggregator (not planned by the coordinator).
BUILTIN_JOB = TrainingProgress("shared", "running", 41, 300, 20_000)


def shares(d) -> dict[str, float]:
    return {s.replica_id: s.share for s in d.fast.shares}


def codes(d) -> dict[str, str]:
    return {s.replica_id: s.reason_code for s in d.fast.shares}


def builtin_round_core(policy: str = "collm", **kw: object) -> CoordinatorCore:
    # The coordinator's own slow loop does not run in these ticks: every round is the aggregator's.
    return CoordinatorCore(config(warmup_s=1000.0, **kw), policy)


def ticks(core: CoordinatorCore, t0: float, t1: float, busy: float = 0.2, **kw: object):
    d = None
    t = t0
    while t <= t1 + 1e-9:
        d = tick(core, t, *(obs(r, t, busy=busy, training=(BUILTIN_JOB,), **kw) for r in IDS))  # type: ignore[arg-type]
        t += 1.0
    return d


def test_a_round_not_planned_here_trains_on_slack_and_yields_to_a_burst_within_one_tick() -> None:
    core = builtin_round_core(headroom_gain=0.0)  # shares count whole (with headroom: test_headroom.py)
    d = ticks(core, 0.0, 0.0)
    assert not core.state.rounds and d.slow is None
    # First tick: the share starts rising (decrease at once, increase gradually).
    assert all(s > 0 for s in shares(d).values()), d.fast.shares
    assert set(codes(d).values()) == {"recovering"}
    assert all("round 41 of shared" in s.reason for s in d.fast.shares)
    d = ticks(core, 1.0, 12.0)
    target = shares(d)
    assert set(codes(d).values()) == {"slack"}
    # Light load (0.2 of each replica): the slack split evenly, within max_share, on the share grid.
    cfg = core.config
    slack = len(IDS) - d.diagnostics.demand / cfg.util_cap
    for s in target.values():
        assert 0.5 <= s <= min(cfg.max_share, slack / len(IDS)) + 1e-9
        assert s / cfg.share_step == pytest.approx(round(s / cfg.share_step))
    # A burst: r1 queues deeply and every replica is busier. In this very tick r1 stops training and
    # the others are cut so that what training leaves covers the demand.
    t = 13.0
    after = tick(
        core,
        t,
        *(
            obs(r, t, busy=0.95 if r == "r1" else 0.5, queue=12 if r == "r1" else 0, training=(BUILTIN_JOB,))
            for r in IDS
        ),
    )
    s1 = shares(after)
    assert s1["r1"] == 0.0 and codes(after)["r1"] == "slo_risk"
    assert all(codes(after)[r] == "burst" and s1[r] < target[r] for r in ("r0", "r2", "r3"))
    left = cfg.burst_util * sum(1.0 - s1[r] for r in IDS)
    assert left >= after.diagnostics.demand / cfg.burst_spike_factor - 1e-6
    # A burst that every replica's SLOs feel: no training anywhere, at once.
    t = 14.0
    d = tick(core, t, *(obs(r, t, busy=0.95, queue=12, training=(BUILTIN_JOB,)) for r in IDS))
    assert shares(d) == dict.fromkeys(IDS, 0.0)
    assert set(codes(d).values()) == {"slo_risk"}
    # Load back to light: the shares rise again, gradually (the forecast remembers the burst a while).
    prev = shares(d)
    for k in range(15, 40):
        d = ticks(core, float(k), float(k))
        now = shares(d)
        assert all(now[r] <= prev[r] + cfg.share_recover_per_tick + 1e-9 for r in IDS)
        prev = now
    assert all(s > 0 for s in prev.values())


def test_no_slack_means_no_share_for_a_round_not_planned_here() -> None:
    core = builtin_round_core()
    # Every replica at 0.9 of its capacity: the forecast demand leaves nothing under util_cap 0.9.
    d = ticks(core, 0.0, 8.0, busy=0.9)
    assert shares(d) == dict.fromkeys(IDS, 0.0)
    assert all("no share for round 41 of shared" in s.reason for s in d.fast.shares)


def test_the_plan_comes_first_and_a_local_job_shares_what_it_leaves() -> None:
    # r0, r1 hold `med` data and are planned; r2 has no local data but runs a local job; r3 is idle.
    core = CoordinatorCore(config(adapters={"med": ("med",)}), "collm")
    local = TrainingProgress("med", "running", None, 100, 10_000)

    def at(t: float):
        return tick(
            core,
            t,
            obs("r0", t),
            obs("r1", t),
            obs("r2", t, samples=0, training=(local,)),
            obs("r3", t, samples=0),
        )

    d = None
    for k in range(16):
        d = at(float(k))
    assert "med" in core.state.rounds
    planned = {p.replica_id: p.share for p in core.state.rounds["med"].plan.participants}
    assert set(planned) == {"r0", "r1"}
    s = shares(d)
    assert s["r0"] == pytest.approx(planned["r0"]) and s["r1"] == pytest.approx(planned["r1"])
    assert s["r2"] > 0 and "a local job of med" in next(
        x.reason for x in d.fast.shares if x.replica_id == "r2"
    )
    assert s["r3"] == 0.0 and codes(d)["r3"] == "idle"
    # r2's share fits in what the plan leaves at the forecast demand.
    cfg = core.config
    free = sum(1.0 - planned.get(r, 0.0) for r in IDS)
    assert s["r2"] <= free - d.diagnostics.demand / cfg.util_cap + cfg.share_step


def test_a_job_of_a_finished_round_or_a_paused_job_gets_no_share() -> None:
    core = builtin_round_core()
    d = ticks(core, 0.0, 5.0)
    assert all(s > 0 for s in shares(d).values())
    # The aggregator aborts round 41 (superseded, or its deadline): a straggler may still report the job.
    t = 6.0
    d = tick(
        core,
        t,
        *(obs(r, t, training=(BUILTIN_JOB,)) for r in IDS),
        round_events=(RoundEvent("shared", "aborted", round_id=41, reason="superseded"),),
    )
    assert shares(d) == dict.fromkeys(IDS, 0.0) and set(codes(d).values()) == {"idle"}
    paused = TrainingProgress("shared", "paused", 42, 300, 20_000)
    d = tick(core, 7.0, *(obs(r, 7.0, training=(paused,)) for r in IDS))
    assert shares(d) == dict.fromkeys(IDS, 0.0)


@pytest.mark.parametrize("policy", ["fixed_ratio", "leftover"])
def test_co_located_baselines_give_their_share_to_a_round_not_planned_here(policy: str) -> None:
    core = builtin_round_core(policy)
    d = ticks(core, 0.0, 2.0)
    cfg = core.config
    share = cfg.fixed_share if policy == "fixed_ratio" else cfg.leftover_share
    assert shares(d) == pytest.approx(dict.fromkeys(IDS, round(share, 3)))
    assert set(codes(d).values()) == {policy}
    # Whatever the load: these baselines do not react to it (their replica-local co-scheduler does).
    d = ticks(core, 3.0, 3.0, busy=0.95, queue=12)
    assert shares(d) == pytest.approx(dict.fromkeys(IDS, round(share, 3)))
    # No job: no share.
    d = tick(core, 4.0, *(obs(r, 4.0) for r in IDS))
    assert shares(d) == dict.fromkeys(IDS, 0.0)


def test_separate_keeps_its_serving_replicas_at_zero() -> None:
    core = builtin_round_core("separate")
    d = ticks(core, 0.0, 2.0)
    serve = [s for s in d.fast.shares if s.reason_code == "serve_only"]
    train = [s for s in d.fast.shares if s.reason_code == "train_only"]
    assert serve and train
    assert all(s.share == 0.0 for s in serve)
    assert all(s.share == core.config.max_share for s in train)
