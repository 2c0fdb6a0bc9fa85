"""Rounds in flight: events from the aggregator, failures to open, missing outcomes, quality learning."""

from __future__ import annotations

import pytest

from collm_coordinator.core import CoordinatorCore, RoundEvent, TrainingProgress
from collm_coordinator.core.quality import effective_tokens, fit_log_gain, log_gain
from tests.unit.coordinator.cluster import config, obs, tick

pytestmark = pytest.mark.unit

IDS = ("r0", "r1")


def plan_once(core: CoordinatorCore):
    t = 0.0
    while True:
        d = tick(core, t, *(obs(r, t, busy=0.2) for r in IDS))
        if d.slow and d.slow.plans:
            return t, d
        t += 1.0


def test_open_failed_clears_the_round_and_its_shares() -> None:
    core = CoordinatorCore(config(), "collm")
    t, d = plan_once(core)
    assert "med" in core.state.rounds
    d = tick(
        core,
        t + 1,
        *(obs(r, t + 1) for r in IDS),
        round_events=(RoundEvent("med", "open_failed", reason="no aggregator"),),
    )
    assert "med" not in core.state.rounds
    assert all(s.share == 0.0 and s.reason_code == "idle" for s in d.fast.shares)


def test_round_without_outcome_expires_after_deadline_and_grace() -> None:
    core = CoordinatorCore(config(slow_interval_s=100.0, round_deadline_s=20.0), "collm")
    t, d = plan_once(core)
    deadline = d.slow.plans[0].deadline_s
    x = t + 1
    while x < deadline + 10:
        tick(core, x, *(obs(r, x) for r in IDS))
        x += 1
    assert "med" in core.state.rounds
    d = tick(core, deadline + 11, *(obs(r, deadline + 11) for r in IDS))
    assert "med" not in core.state.rounds
    assert any("no outcome" in n for n in d.diagnostics.notes)


@pytest.mark.parametrize("rounds", ["sync", "async"])
def test_a_round_being_evaluated_outlives_the_grace_until_the_evaluation_grace(rounds: str) -> None:
    core = CoordinatorCore(
        config(slow_interval_s=300.0, round_deadline_s=20.0, evaluation_grace_s=60.0, rounds=rounds), "collm"
    )

    def kept() -> bool:  # async: the round finishes beside the adapter's next one
        return "med" in core.state.rounds if rounds == "sync" else 7 in core.state.finishing

    t, d = plan_once(core)
    deadline = d.slow.plans[0].deadline_s
    tick(core, t + 1, *(obs(r, t + 1) for r in IDS), round_events=(RoundEvent("med", "opened", 7),))
    tick(core, deadline, *(obs(r, deadline) for r in IDS), round_events=(RoundEvent("med", "evaluating", 7),))
    x = deadline + 1
    while x <= deadline + 60:
        d = tick(core, x, *(obs(r, x) for r in IDS))
        x += 1
    assert kept()  # 60 s past its deadline: its candidate is still being scored
    assert not any("no outcome" in n for n in d.diagnostics.notes)
    d = tick(core, deadline + 61, *(obs(r, deadline + 61) for r in IDS))
    assert not kept()
    assert any("no outcome 60s after its deadline" in n for n in d.diagnostics.notes)


def test_published_round_teaches_the_gain_coefficient() -> None:
    core = CoordinatorCore(config(), "collm")
    t, d = plan_once(core)
    plan = next(p for p in d.slow.plans if p.adapter == "med")
    q = core.state.quality_of("med")
    k0, t0 = q.gain_coefficient, q.trained_tokens
    # The participants report their progress; then the aggregator publishes a big improvement.
    done = tuple(
        obs(
            p.replica_id,
            t + 1,
            training=(TrainingProgress("med", "done", 7, p.token_budget, p.token_budget),),
        )
        for p in plan.participants
    )
    tick(core, t + 1, *done, round_events=(RoundEvent("med", "opened", round_id=7),))
    # Progress counts only once the round id is known; report again after "opened".
    done = tuple(
        obs(
            p.replica_id,
            t + 2,
            training=(TrainingProgress("med", "done", 7, p.token_budget, p.token_budget),),
        )
        for p in plan.participants
    )
    d = tick(core, t + 2, *done)
    assert all(s.share == 0.0 for s in d.fast.shares), "participants that finished their budget stop training"
    tick(
        core,
        t + 3,
        *(obs(r, t + 3) for r in IDS),
        round_events=(
            RoundEvent(
                "med",
                "published",
                round_id=7,
                new_version=2,
                accepted=IDS,
                eval_loss_before=2.0,
                eval_loss_after=1.0,
            ),
        ),
    )
    assert "med" not in core.state.rounds
    assert q.trained_tokens > t0 and q.rounds_observed == 1
    assert q.gain_coefficient > k0
    assert core.state.versions["med"] == 2


def test_events_of_another_round_are_ignored() -> None:
    core = CoordinatorCore(config(), "collm")
    t, _ = plan_once(core)
    tick(core, t + 1, *(obs(r, t + 1) for r in IDS), round_events=(RoundEvent("med", "opened", round_id=3),))
    tick(
        core, t + 2, *(obs(r, t + 2) for r in IDS), round_events=(RoundEvent("med", "published", round_id=2),)
    )
    assert core.state.rounds["med"].round_id == 3


def test_quality_model_arithmetic() -> None:
    assert log_gain(0.5, 100.0, 0.0, 100.0) == pytest.approx(0.5 * 0.6931, rel=1e-3)
    # Diminishing returns: the same tokens later are worth less.
    assert log_gain(1.0, 100.0, 1000.0, 100.0) < log_gain(1.0, 100.0, 0.0, 100.0)
    assert effective_tokens(1e9, 500.0) == pytest.approx(500.0)
    assert effective_tokens(10.0, 1e9) == pytest.approx(10.0, rel=1e-6)
    assert effective_tokens(0.0, 10.0) == 0.0
    # A curve that follows the model exactly gives back its k.
    import math

    pts = [(n, 3.0 - 0.4 * math.log1p(n / 1000.0)) for n in (500, 1000, 4000, 16000)]
    assert fit_log_gain(pts, 3.0, 1000.0) == pytest.approx(0.4, rel=1e-6)
    assert fit_log_gain([(100, 3.5)], 3.0, 1000.0) == 0.0
