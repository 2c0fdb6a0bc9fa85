"""An adapter that was not ready at a slow tick gets its round as soon as it is, not a slow interval later."""

from __future__ import annotations

import pytest

from collm_coordinator.core import (
    AdapterVersionView,
    CoordinatorCore,
    Decisions,
    ReplicaObservation,
    SlowDecision,
)
from tests.unit.coordinator.cluster import config, obs, tick

pytestmark = pytest.mark.unit


def run(policy: str, until_s: int, bank_v1_at_s: int | None, split: bool) -> dict[int, Decisions]:
    """Tick once a second; med has v1 from the start, bank gets it at `bank_v1_at_s`. `split`: r0 holds
    med data and r1 bank data (else both hold both). No adapter is resident (no version from telemetry)."""
    core = CoordinatorCore(config(warmup_s=3.0, slow_interval_s=30.0), policy)

    def observations(t: float) -> list[ReplicaObservation]:
        if split:
            return [
                obs("r0", t, busy=0.1, domain="med", adapters=()),
                obs("r1", t, busy=0.1, domain="bank", adapters=()),
            ]
        return [obs(r, t, busy=0.1, domains=("med", "bank"), adapters=()) for r in ("r0", "r1")]

    out = {}
    for t in range(until_s + 1):
        versions = ()
        if t == 0:
            versions += (AdapterVersionView("med", 1),)
        if t == bank_v1_at_s:
            versions += (AdapterVersionView("bank", 1),)
        d = tick(core, float(t), *observations(float(t)), adapter_versions=versions)
        if d.slow is not None:
            out[t] = d
    return out


@pytest.mark.parametrize("policy", ["collm", "separate", "fixed_ratio", "leftover"])
def test_adapter_created_after_the_slow_tick_is_considered_at_the_next_fast_tick(policy: str) -> None:
    slow = run(policy, 33, bank_v1_at_s=5, split=False)
    assert sorted(slow) == [3, 5, 33]  # the catch-up at 5 leaves the slow cadence (3, 33) alone
    first = slow[3].slow
    assert first is not None
    assert [p.adapter for p in first.plans] == ["med"]
    assert "no version" in {s.adapter: s.reason for s in first.skipped}["bank"]
    catch_up = slow[5].slow
    assert catch_up is not None
    # Only bank is planned off-cycle (med's round is in flight and is not planned again).
    considered = {p.adapter for p in catch_up.plans} | {s.adapter for s in catch_up.skipped}
    assert considered == {"bank"}, catch_up


def test_collm_opens_the_late_adapters_round_where_there_is_capacity() -> None:
    slow = run("collm", 10, bank_v1_at_s=5, split=True)
    planned = {p.adapter: t for t, d in slow.items() if d.slow for p in d.slow.plans}
    assert planned == {"med": 3, "bank": 5}
    bank = next(p for p in slow[5].slow.plans if p.adapter == "bank")  # type: ignore[union-attr]
    assert [p.replica_id for p in bank.participants] == ["r1"]


def test_an_adapter_that_stays_unready_is_not_planned_off_cycle() -> None:
    assert sorted(run("collm", 33, bank_v1_at_s=None, split=True)) == [3, 33]


def test_a_data_holder_appearing_waits_for_the_slow_tick() -> None:
    """Replicas starting together report one by one: planning at the first report would leave the others
    out, so an adapter that lacked a data holder (not a version) keeps the slow cadence."""
    core = CoordinatorCore(config(warmup_s=3.0, slow_interval_s=30.0), "collm")
    slow_ticks = []
    for t in range(0, 12):
        samples = 0 if t < 5 else 200  # r0 reports local data from t=5 on
        versions = (AdapterVersionView("med", 1),) if t == 0 else ()
        d = tick(
            core,
            float(t),
            obs("r0", float(t), busy=0.1, samples=samples, adapters=()),
            adapter_versions=versions,
        )
        if d.slow is not None:
            slow_ticks.append(t)
    assert slow_ticks == [3]


def risk_run(policy: str, calm_from_s: int | None, until_s: int = 33) -> dict[int, Decisions]:
    """r0 holds med data, r1 bank data; r0's queue puts it at SLO risk until `calm_from_s` (None: always).
    Both report attainment 0.95, the default target: no headroom, so a replica at risk takes no part in a
    plan (`_at_risk_catch_up` for the other case)."""
    core = CoordinatorCore(config(warmup_s=3.0, slow_interval_s=30.0), policy)
    out = {}
    for t in range(until_s + 1):
        at_risk = calm_from_s is None or t < calm_from_s
        versions = (AdapterVersionView("med", 1), AdapterVersionView("bank", 1)) if t == 0 else ()
        d = tick(
            core,
            float(t),
            obs("r0", float(t), busy=0.1, queue=12 if at_risk else 0, domain="med", attainment=0.95),
            obs("r1", float(t), busy=0.1, domain="bank", attainment=0.95),
            adapter_versions=versions,
        )
        if d.slow is not None:
            out[t] = d
    return out


def test_an_adapter_held_back_by_a_momentary_risk_is_planned_once_it_clears() -> None:
    slow = risk_run("collm", calm_from_s=6)
    assert sorted(slow) == [3, 6, 33]  # the catch-up at 6 leaves the slow cadence alone
    first = slow[3].slow
    assert first is not None and [p.adapter for p in first.plans] == ["bank"]  # r0 at risk: med waits
    catch_up = slow[6].slow
    assert catch_up is not None
    assert [(p.adapter, [q.replica_id for q in p.participants]) for p in catch_up.plans] == [("med", ["r0"])]
    assert {s.adapter for s in catch_up.skipped} == set()  # only med was considered off-cycle


def test_an_adapter_whose_holders_stay_at_risk_keeps_the_slow_cadence() -> None:
    assert sorted(risk_run("collm", calm_from_s=None)) == [3, 33]


def evaluating_run(
    policy: str, outcome_at_s: int | None, until_s: int = 45, rounds: str = "sync"
) -> dict[int, Decisions]:
    """r0 holds med data, r1 bank data. med's first round (opened at the first slow tick, 3) is still
    evaluating at the second one (33) and publishes v2 at `outcome_at_s`; bank's round publishes at 24."""
    from collm_coordinator.core import RoundEvent

    core = CoordinatorCore(
        config(warmup_s=3.0, slow_interval_s=30.0, round_deadline_s=20.0, rounds=rounds), policy
    )
    out = {}
    for t in range(until_s + 1):
        versions = (AdapterVersionView("med", 1), AdapterVersionView("bank", 1)) if t == 0 else ()
        events: tuple[RoundEvent, ...] = ()
        if t == 24:
            events = (RoundEvent("med", "evaluating", 1), RoundEvent("bank", "published", 2, 1, 2))
        if t == outcome_at_s:
            events = (RoundEvent("med", "published", 1, 1, 2),)
        d = tick(
            core,
            float(t),
            obs("r0", float(t), busy=0.1, domain="med"),
            obs("r1", float(t), busy=0.1, domain="bank"),
            adapter_versions=versions,
            round_events=events,
        )
        if d.slow is not None:
            out[t] = d
    return out


@pytest.mark.parametrize("policy", ["collm", "fixed_ratio"])
def test_an_adapter_still_evaluating_at_the_slow_tick_gets_its_next_round_when_it_ends(policy: str) -> None:
    slow = evaluating_run(policy, outcome_at_s=38)
    assert sorted(slow) == [3, 33, 38]
    tick33 = slow[33].slow
    assert tick33 is not None
    assert [p.adapter for p in tick33.plans] == ["bank"]
    assert "round in flight (evaluating)" in {s.adapter: s.reason for s in tick33.skipped}["med"]
    catch_up = slow[38].slow
    assert catch_up is not None
    # Only med is planned off-cycle, on the version its last round published.
    assert [(p.adapter, p.base_version) for p in catch_up.plans] == [("med", 2)]
    assert catch_up.skipped == ()


def test_a_round_that_ends_before_the_slow_tick_keeps_the_cadence() -> None:
    assert sorted(evaluating_run("collm", outcome_at_s=30)) == [3, 33]


@pytest.mark.parametrize("policy", ["collm", "fixed_ratio"])
def test_async_rounds_plan_the_next_round_as_soon_as_the_collection_closed(policy: str) -> None:
    """Async rounds: med's round closes its collection at 24 (evaluating): med is planned again in that tick,
    on v1 (the aggregator rebases it onto what the evaluating round publishes), off the slow cadence;
    the evaluating round's publication at 38 still teaches the version, so later plans start from v2."""
    slow = evaluating_run(policy, outcome_at_s=38, until_s=70, rounds="async")
    assert sorted(slow)[:3] == [3, 24, 33]
    catch_up = slow[24].slow
    assert catch_up is not None
    assert [(p.adapter, p.base_version) for p in catch_up.plans] == [("med", 1)]
    assert catch_up.skipped == ()
    tick33 = slow[33].slow
    assert tick33 is not None
    assert "round in flight (planned)" in {s.adapter: s.reason for s in tick33.skipped}["med"]
    # The second round never reports (no aggregator here): forgotten at 55 (its deadline 44 + grace), med
    # is planned at once (it waited since the slow tick) on the version the first one published.
    assert [(p.adapter, p.base_version) for p in slow[55].slow.plans] == [("med", 2)]  # type: ignore[union-attr]


def _at_risk_catch_up(attainment: float) -> tuple[dict[int, SlowDecision], dict[int, float]]:
    """med's round ends (38) after the slow tick (33) while r0, its only data holder, is at risk from 36
    until 41; every replica reports `attainment` (the default target is 0.95). The slow decisions by
    tick, and r0's share by tick."""
    from collm_coordinator.core import RoundEvent

    core = CoordinatorCore(
        config(warmup_s=3.0, slow_interval_s=30.0, round_deadline_s=20.0, rounds="sync"), "collm"
    )
    slow: dict[int, SlowDecision] = {}
    r0_share: dict[int, float] = {}
    for t in range(46):
        versions = (AdapterVersionView("med", 1), AdapterVersionView("bank", 1)) if t == 0 else ()
        events: tuple[RoundEvent, ...] = ()
        if t == 24:
            events = (RoundEvent("med", "evaluating", 1), RoundEvent("bank", "published", 2, 1, 2))
        if t == 38:
            events = (RoundEvent("med", "published", 1, 1, 2),)
        queue = 12 if 36 <= t < 41 else 0
        d = tick(
            core,
            float(t),
            obs("r0", float(t), busy=0.1, domain="med", queue=queue, attainment=attainment),
            obs("r1", float(t), busy=0.1, domain="bank", attainment=attainment),
            adapter_versions=versions,
            round_events=events,
        )
        if d.slow is not None:
            slow[t] = d.slow
        if d.fast is not None:
            r0_share[t] = next(s.share for s in d.fast.shares if s.replica_id == "r0")
    return slow, r0_share


def test_an_adapter_caught_up_while_its_holder_is_at_risk_waits_for_the_risk_to_clear() -> None:
    """Attainment at the target (no headroom): the catch-up at 38 finds no participant and med is planned
    at 41, when the risk clears."""
    slow, _ = _at_risk_catch_up(0.95)
    assert sorted(slow) == [3, 33, 38, 41]
    assert slow[38].plans == ()
    assert "every replica holding its data is at SLO risk" in slow[38].skipped[0].reason
    assert [(p.adapter, p.base_version) for p in slow[41].plans] == [("med", 2)]


def test_with_headroom_a_holder_at_risk_takes_part_and_trains_once_the_risk_clears() -> None:
    """Attainment above the target (headroom): the catch-up at 38 plans med on r0 though r0 is at risk;
    the fast loop holds r0's share at 0 until the risk clears, then lets it rise."""
    slow, r0_share = _at_risk_catch_up(1.0)
    assert [(p.adapter, p.base_version) for p in slow[38].plans] == [("med", 2)]
    assert [p.replica_id for p in slow[38].plans[0].participants] == ["r0"]
    assert all(r0_share[t] == 0.0 for t in range(38, 41))
    assert r0_share[41] > 0.0
