"""Each baseline behaves as described (core/baselines.py)."""

from __future__ import annotations

import pytest

from collm_coordinator.core import CoordinatorCore
from tests.unit.coordinator.cluster import TRAIN_TOKENS_PER_S, config, obs, tick

pytestmark = pytest.mark.unit

IDS = tuple(f"r{i}" for i in range(8))
DOMAINS = ("med", "med", "bank", "bank", "code", "code", "med", "bank")
ADAPTERS = ("med", "bank", "code")


def run(policy: str, until: float = 6.0, burst_at: float | None = None, **cfg_kw: object):
    core = CoordinatorCore(config(**cfg_kw), policy)
    plans, last = [], None
    t = 0.0
    while t <= until:
        burst = burst_at is not None and t >= burst_at
        last = tick(
            core,
            t,
            *(
                obs(r, t, busy=0.95 if burst else 0.2, queue=12 if burst else 0, domain=d, adapters=ADAPTERS)
                for r, d in zip(IDS, DOMAINS, strict=True)
            ),
        )
        if last.slow:
            plans.extend(last.slow.plans)
        t += 1.0
    return core, last, plans


def shares(d) -> dict[str, float]:
    return {s.replica_id: s.share for s in d.fast.shares}


def test_separate_is_a_static_split_train_side_only_trains() -> None:
    core, d, plans = run("separate", until=40.0)
    train = {s.replica_id for s in d.fast.shares if s.reason_code == "train_only"}
    serve = {s.replica_id for s in d.fast.shares if s.reason_code == "serve_only"}
    assert len(train) == 2 and len(serve) == 6 and not train & serve
    # The split covers two different domains, so both have data to train on.
    assert len({DOMAINS[IDS.index(r)] for r in train}) == 2
    assert all(shares(d)[r] == 1.0 for r in train) and all(shares(d)[r] == 0.0 for r in serve)
    w = d.fast.routing.weights
    assert all(w[r] == 0.0 for r in train)
    assert all(w[r] == pytest.approx(1 / 6, abs=1e-3) for r in serve)
    participants = {p.replica_id for plan in plans for p in plan.participants}
    assert participants <= train
    for plan in plans:
        for p in plan.participants:
            assert p.token_budget == round(core.config.round_deadline_s * TRAIN_TOKENS_PER_S)
    # Static: the same split at every tick.
    _, d2, _ = run("separate", until=41.0)
    assert {s.replica_id for s in d2.fast.shares if s.reason_code == "train_only"} == train


def test_fixed_ratio_is_share_one_over_k_plus_one_on_every_replica() -> None:
    core, d, plans = run("fixed_ratio", fixed_ratio_k=3)
    assert d.fast.routing is None, "no weights: the gateway routes least-loaded"
    assert set(shares(d).values()) == {0.25}
    assert {s.reason_code for s in d.fast.shares} == {"fixed_ratio"}
    assert {p.replica_id for plan in plans for p in plan.participants} == set(IDS)
    for plan in plans:
        for p in plan.participants:
            assert p.share == 0.25
            assert p.token_budget == round(0.25 * core.config.round_deadline_s * TRAIN_TOKENS_PER_S)


def test_fixed_ratio_ignores_load() -> None:
    _, d, _ = run("fixed_ratio", until=8.0, burst_at=7.0)
    assert set(shares(d).values()) == {round(1 / 6, 3)}


def test_leftover_grants_full_share_everywhere_and_never_coordinates() -> None:
    core, d, plans = run("leftover", until=8.0, burst_at=7.0)
    assert d.fast.routing is None
    # Training fills what inference leaves on each replica: the coordinator does not cut it in a burst.
    assert set(shares(d).values()) == {1.0}
    assert {s.reason_code for s in d.fast.shares} == {"leftover"}
    assert {p.replica_id for plan in plans for p in plan.participants} == set(IDS)
    for plan in plans:
        for p in plan.participants:
            assert p.token_budget == round(core.config.round_deadline_s * TRAIN_TOKENS_PER_S)


def test_collm_cuts_in_the_same_burst_that_leftover_ignores() -> None:
    _, d, _ = run("collm", until=8.0, burst_at=7.0)
    assert set(shares(d).values()) == {0.0}
    assert {s.reason_code for s in d.fast.shares} == {"slo_risk"}


@pytest.mark.parametrize("signed_queue", [1e9, -1e9])  # Z huge; headroom 1
def test_baselines_do_not_use_the_virtual_queue(signed_queue: float) -> None:
    for policy in ("separate", "fixed_ratio", "leftover"):
        core = CoordinatorCore(config(), policy)
        core.state.target.signed_queue = signed_queue
        t = 0.0
        while True:
            d = tick(
                core,
                t,
                *(
                    obs(r, t, busy=0.2, domain=dm, adapters=ADAPTERS)
                    for r, dm in zip(IDS, DOMAINS, strict=True)
                ),
            )
            if d.slow:
                break
            t += 1.0
        assert d.slow.plans, policy


def test_policy_can_change_at_run_time_and_keeps_history() -> None:
    core, _, _ = run("collm", until=5.0)
    rounds = dict(core.state.rounds)
    core.set_policy("leftover")
    d = tick(
        core,
        5.5,
        *(obs(r, 5.5, busy=0.2, domain=dm, adapters=ADAPTERS) for r, dm in zip(IDS, DOMAINS, strict=True)),
    )
    assert d.policy == "leftover" and d.fast is not None
    assert core.state.rounds.keys() == rounds.keys()
    with pytest.raises(ValueError, match="unknown coordinator policy"):
        core.set_policy("greedy")
