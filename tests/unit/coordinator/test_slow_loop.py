"""The slow loop's plan respects every capacity constraint, and trains where quality is bought."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collm_coordinator.core import CoordinatorCore
from tests.unit.coordinator.cluster import TRAIN_TOKENS_PER_S, config, obs, tick

pytestmark = pytest.mark.unit

replica = st.tuples(
    st.floats(0.0, 1.0),  # serving busy fraction
    st.integers(0, 20),  # queue
    st.sampled_from(["med", "bank", "code"]),  # domain
    st.integers(0, 500),  # local samples
    st.floats(0.5, 1.0),  # attainment
)


def plan_for(reps: list[tuple[float, int, str, int, float]], z: float, **cfg_kw: object):
    cfg = config(**cfg_kw)
    core = CoordinatorCore(cfg, "collm")
    ids = [f"r{i}" for i in range(len(reps))]

    def observations(t: float):
        return [
            obs(rid, t, busy=b, queue=q, domain=d, samples=n, attainment=a)
            for rid, (b, q, d, n, a) in zip(ids, reps, strict=True)
        ]

    t = 0.0
    while True:
        core.state.target.virtual_queue = z
        d = tick(core, t, *observations(t))
        if d.slow is not None:
            return core, d, ids
        t += 1.0


@settings(max_examples=150, deadline=None)
@given(
    reps=st.lists(replica, min_size=1, max_size=12),
    z=st.floats(0.0, 50.0),
    cap=st.floats(0.3, 1.0),
    max_share=st.floats(0.1, 1.0),
)
def test_plan_respects_every_capacity_constraint(reps, z, cap, max_share) -> None:
    core, d, ids = plan_for(reps, z, util_cap=cap, max_share=max_share)
    cfg = core.config
    st = core.state
    view_risk = {r for r in ids if st.risk_of(st.latest[r], st.infer_load(st.latest[r]))}
    share = dict.fromkeys(ids, 0.0)
    for plan in d.slow.plans:
        assert plan.deadline_s == pytest.approx(d.now_s + cfg.round_deadline_s)
        assert 1 <= plan.quorum <= len(plan.participants)
        seen = set()
        for p in plan.participants:
            assert p.replica_id not in seen
            seen.add(p.replica_id)
            o = core.state.latest[p.replica_id]
            assert o.local_samples > 0, "a replica without data is never planned"
            assert plan.adapter in o.domains, "only replicas with data for the adapter's domain"
            if st.target.headroom <= 0:
                assert p.replica_id not in view_risk, "without headroom, replicas at SLO risk are not planned"
            assert p.token_budget >= cfg.min_budget_tokens
            assert p.token_budget <= p.share * cfg.round_deadline_s * TRAIN_TOKENS_PER_S + 1
            share[p.replica_id] += p.share
    for rid in ids:
        assert share[rid] <= cfg.max_share + 1e-6
        if share[rid] > cfg.share_step + 1e-6:
            load = st.infer_load(st.latest[rid])
            assert share[rid] <= 1.0 - load / cfg.util_cap + 1e-6, "no share the co-scheduler cannot spend"
    free = sum(1.0 - s for s in share.values())
    if any(share.values()):
        u = d.slow.forecast_demand / free if free > 0 else math.inf
        assert u <= cfg.util_cap + 1e-6, f"forecast utilisation {u} over cap {cfg.util_cap}"


def test_no_training_when_forecast_load_already_exceeds_cap() -> None:
    _, d, _ = plan_for([(0.9, 0, "med", 200, 1.0)] * 4, 0.0, util_cap=0.85)
    assert d.slow.plans == ()
    assert any("no participant" in s.reason for s in d.slow.skipped)


def test_a_busy_replica_gets_only_the_share_its_serving_leaves() -> None:
    # Two holders of one domain, one serving at 0.6 of its capacity and one idle, with room under the cap
    # for more than the idle one can take: the busy one's share stops at 1 - 0.6 / 0.9 (its co-scheduler
    # trains only in the time serving leaves), the idle one's at max_share.
    core, d, _ = plan_for([(0.6, 0, "med", 300, 1.0), (0.0, 0, "med", 300, 1.0)], 0.0, util_cap=0.9)
    (plan,) = d.slow.plans
    shares = {p.replica_id: p.share for p in plan.participants}
    assert shares["r0"] == pytest.approx(0.3)
    assert shares["r1"] == pytest.approx(core.config.max_share)


def test_a_replica_at_its_cap_still_gets_one_share_step() -> None:
    _, d, _ = plan_for([(0.89, 0, "med", 300, 1.0), (0.0, 0, "med", 300, 1.0)], 0.0, util_cap=0.9)
    (plan,) = d.slow.plans
    shares = {p.replica_id: p.share for p in plan.participants}
    assert shares["r0"] == pytest.approx(0.05)


def test_plan_spreads_tokens_over_adapters_with_diminishing_returns() -> None:
    reps = [(0.1, 0, dm, 300, 1.0) for dm in ("med", "med", "bank", "bank")]
    core, d, _ = plan_for(reps, 0.0, util_cap=0.5)
    by_adapter = {p.adapter: sum(x.token_budget for x in p.participants) for p in d.slow.plans}
    assert set(by_adapter) == {"med", "bank"}
    assert by_adapter["med"] == pytest.approx(by_adapter["bank"], rel=0.25)


def test_adapter_already_trained_a_lot_gets_fewer_tokens() -> None:
    reps = [(0.1, 0, dm, 300, 1.0) for dm in ("med", "med", "bank", "bank")]
    cfg = config(util_cap=0.5, headroom_gain=0.0)  # the cap binds: the gain decides who gets the tokens
    core = CoordinatorCore(cfg, "collm")
    core.state.quality_of("med").trained_tokens = 2_000_000  # far along its curve: little left to gain
    t = 0.0
    while True:
        observations = [obs(f"r{i}", t, busy=r[0], domain=r[2], samples=r[3]) for i, r in enumerate(reps)]
        d = tick(core, t, *observations)
        if d.slow:
            break
        t += 1.0
    by_adapter = {p.adapter: sum(x.token_budget for x in p.participants) for p in d.slow.plans}
    assert by_adapter.get("bank", 0) > by_adapter.get("med", 0)


def test_replica_with_unknown_training_speed_gets_a_probe() -> None:
    from collm_coordinator.core import CostPrior

    _, d, _ = plan_for([(0.1, 0, "med", 300, 1.0)] * 2, 0.0, cost_prior=CostPrior())
    (plan,) = d.slow.plans
    assert all(p.reason.startswith("probe") for p in plan.participants)
    assert all(p.token_budget == 512 for p in plan.participants)


def test_an_adapter_whose_data_holders_are_all_at_risk_says_so() -> None:
    # med's only holder has a queue (at risk); bank's holder is fine and gets a plan. Attainment at the
    # target (0.95): no headroom.
    _, d, _ = plan_for([(0.1, 12, "med", 300, 0.95), (0.1, 0, "bank", 300, 0.95)], 0.0)
    assert [p.adapter for p in d.slow.plans] == ["bank"]
    (skip,) = d.slow.skipped
    assert skip.adapter == "med"
    assert "every replica holding its data is at SLO risk (r0: queue 12" in skip.reason


def test_with_headroom_a_data_holder_at_risk_takes_part() -> None:
    # Attainment above the target: the SLO budget is left unspent, so r0's momentary queue does not cost
    # it the round; the fast loop holds its share at 0 while the risk lasts.
    core, d, _ = plan_for([(0.1, 12, "med", 300, 1.0), (0.1, 0, "bank", 300, 1.0)], 0.0)
    assert core.state.target.headroom > 0
    assert sorted(p.adapter for p in d.slow.plans) == ["bank", "med"]
    assert {s.replica_id: s.share for s in d.fast.shares}["r0"] == 0.0


def test_a_probe_refused_by_the_utilisation_cap_says_so() -> None:
    from collm_coordinator.core import CostPrior

    # Unknown training speed, so only a probe could train; the serving load leaves no room for it.
    _, d, _ = plan_for([(0.6, 0, "med", 300, 1.0)], 0.0, cost_prior=CostPrior(), util_cap=0.62)
    assert d.slow.plans == ()
    (skip,) = d.slow.skipped
    assert "probe refused: its share would exceed the utilisation cap 0.62" in skip.reason


def test_adapters_without_a_known_version_are_skipped() -> None:
    _, d, _ = plan_for([(0.1, 0, "med", 300, 1.0)], 0.0)
    # The test replicas hold med@v1 and bank@v1, so med is plannable; a domain with no version is not.
    core = CoordinatorCore(config(), "collm")
    t = 0.0
    while True:
        dd = tick(core, t, obs("r0", t, domain="law", adapters=()))
        if dd.slow:
            break
        t += 1.0
    assert [s.adapter for s in dd.slow.skipped] == ["law"]
    assert "no version" in dd.slow.skipped[0].reason


def test_the_starvation_floor_gives_an_adapter_left_without_rounds_one_step() -> None:
    """A high price on SLO risk plans nothing; at the last slow tick before an adapter's wait without a
    round would pass `starvation_floor_s`, it gets one share step anyway (never on a replica at risk)."""
    cfg = config(starvation_floor_s=180.0)
    core = CoordinatorCore(cfg, "collm")
    slow = []
    t = 0.0
    while t <= 400.0:
        core.state.target.virtual_queue = 50.0  # every step's gain is below its risk penalty
        d = tick(
            core, t,
            obs("r0", t, busy=0.5, domain="med", samples=300),
            obs("r1", t, busy=0.5, domain="bank", samples=300),
        )  # fmt: skip
        if d.slow is not None:
            slow.append(d.slow)
            for p in d.slow.plans:  # the round ends at once: the adapter waits again from its plan
                core.state.rounds.pop(p.adapter, None)
        t += 1.0
    planned = [p for s in slow for p in s.plans]
    assert not slow[0].plans, "the risk penalty alone plans nothing"
    assert planned, "the floor planned the waiting adapters"
    by_adapter: dict[str, list[float]] = {}
    for p in planned:
        assert "starvation floor" in p.reason and len(p.participants) == 1
        assert p.participants[0].share == pytest.approx(cfg.share_step)
        by_adapter.setdefault(p.adapter, []).append(p.opened_s)
    assert set(by_adapter) == {"med", "bank"}
    for times in by_adapter.values():
        # Waited since it was first seen (t = 0) or since its previous plan: more than the floor less one
        # slow interval, never more than the floor.
        waits = [b - a for a, b in zip([0.0, *times], times, strict=False)]
        assert all(
            cfg.starvation_floor_s - cfg.slow_interval_s < w <= cfg.starvation_floor_s for w in waits
        ), waits


def test_the_starvation_floor_takes_a_turn_on_replicas_whose_shares_are_full() -> None:
    """Two replicas hold three adapters' data and two of them outbid the third for all training time (their
    rounds overlap, so the replicas' shares stay full): the third still gets a round every
    `starvation_floor_s`, a share of a replica's training time as large as
    each of its jobs gets in turn, and no replica is asked to train more than its whole time."""
    doms = ("med", "bank", "code")
    cfg = config(
        starvation_floor_s=180.0,
        round_deadline_s=25.0,
        quality_prior={"code": 0.001, "med": 0.2, "bank": 0.2},
    )
    core = CoordinatorCore(cfg, "collm")
    ends: dict[str, float] = {}
    planned: dict[str, list[float]] = {a: [] for a in doms}
    floored = 0
    t = 0.0
    while t <= 900.0:
        for a, end in list(ends.items()):
            if t >= end:  # each round lasts 45 s, past the next slow tick
                core.state.rounds.pop(a, None)
                del ends[a]
        d = tick(
            core,
            t,
            *(obs(r, t, busy=0.05, domains=doms, adapters=doms, samples=300) for r in ("r0", "r1")),
        )
        assert all(s.share <= 1.0 for s in d.fast.shares)
        if d.slow is not None:
            for p in d.slow.plans:
                ends[p.adapter] = t + 45.0
                planned[p.adapter].append(t)
                if p.adapter == "code" and "starvation floor" in p.reason:
                    floored += 1
                    assert len(p.participants) == 1
                    assert p.participants[0].share == pytest.approx(0.3)  # a third of a full replica
        t += 1.0
    assert len(planned["med"]) > 20 and len(planned["bank"]) > 20
    code = planned["code"]
    assert code and floored, "the starved adapter got rounds, by the floor"
    waits = [b - a for a, b in zip([0.0, *code], [*code, t], strict=True)]
    assert max(waits) <= cfg.starvation_floor_s
