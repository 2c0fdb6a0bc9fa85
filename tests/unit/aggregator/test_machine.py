"""The round state machine with explicit times: quorum, deadline, stragglers, rejections, the gate."""

import pytest

from collm_aggregator.evaluation import EvalSummary, GateRule
from collm_aggregator.machine import (
    Abort,
    Admitted,
    Close,
    Late,
    Phase,
    PhaseError,
    RoundMachine,
    RoundRules,
    Wait,
)
from collm_aggregator.validation import (
    DUPLICATE,
    NO_SAMPLES,
    NORM_OUTLIER,
    NOT_FINITE,
    NOT_PARTICIPANT,
    WRONG_ADAPTER,
    WRONG_BASE,
    Rejection,
)

pytestmark = pytest.mark.unit
T0 = 1_000.0


def machine(quorum: int = 2, deadline: float = 60.0, **rules) -> RoundMachine:
    m = RoundMachine(
        7, "med", 3, ("a", "b", "c"), RoundRules(quorum=quorum, deadline_unix_s=T0 + deadline, **rules), T0
    )
    m.start_collecting(T0)
    return m


def submit(m: RoundMachine, rid: str, t: float, base: int = 3, samples: int = 10, norm: float = 1.0):
    verdict = m.admit(rid, "med", base)
    if isinstance(verdict, Admitted):
        return m.record(rid, base, samples, t, staleness=verdict.staleness, delta_norm=norm)
    if isinstance(verdict, Rejection):
        return m.reject(rid, verdict, t, base)
    m.mark_late(rid, t)
    return verdict


def test_waits_until_the_deadline_then_closes_with_quorum() -> None:
    m = machine()
    submit(m, "a", T0 + 1)
    assert m.poll(T0 + 2) == Wait(T0 + 60)
    submit(m, "b", T0 + 3)
    assert m.poll(T0 + 4) == Wait(T0 + 60)  # quorum reached, but c may still come: wait to the deadline
    assert isinstance(m.poll(T0 + 60), Close)
    accepted = m.close(T0 + 60)
    assert [e.replica_id for e in accepted] == ["a", "b"]
    assert m.phase is Phase.AGGREGATING


def test_closes_as_soon_as_every_participant_reported() -> None:
    m = machine()
    for i, rid in enumerate("abc"):
        submit(m, rid, T0 + i)
    assert m.poll(T0 + 3) == Close("every participant reported")


def test_quorum_grace_closes_early_and_the_straggler_is_late() -> None:
    m = machine(quorum_grace_s=5.0)
    submit(m, "a", T0 + 1)
    submit(m, "b", T0 + 2)
    assert m.poll(T0 + 3) == Wait(T0 + 7)
    assert m.poll(T0 + 7) == Close("quorum reached and grace period over")
    m.close(T0 + 7)
    assert isinstance(submit(m, "c", T0 + 8), Late)
    assert m.late == {"c": T0 + 8}
    assert "c" not in m.entries


def test_deadline_without_quorum_aborts() -> None:
    m = machine(quorum=2)
    submit(m, "a", T0 + 1)
    d = m.poll(T0 + 60)
    assert isinstance(d, Abort) and "1 valid update(s) of 2" in d.reason
    m.abort(d.reason, T0 + 60)
    assert m.phase is Phase.ABORTED and m.final


def test_rejected_updates_do_not_count_and_the_round_still_completes() -> None:
    m = machine(quorum=2)
    submit(m, "a", T0 + 1)
    m.reject("b", Rejection(NOT_FINITE, "NaN"), T0 + 2, 3)
    submit(m, "c", T0 + 3, base=2)  # wrong base version (late_policy=drop)
    assert m.entries["c"].rejection.code == WRONG_BASE
    d = m.poll(T0 + 4)
    assert isinstance(d, Abort)  # every participant heard, only 1 valid
    m2 = machine(quorum=1)
    submit(m2, "a", T0 + 1)
    m2.reject("b", Rejection(NOT_FINITE, "NaN"), T0 + 2, 3)
    submit(m2, "c", T0 + 3, base=2)
    assert m2.poll(T0 + 4) == Close("every participant reported")
    assert [e.replica_id for e in m2.close(T0 + 4)] == ["a"]
    assert sorted(e.rejection.code for e in m2.all_rejections) == [NOT_FINITE, WRONG_BASE]


def test_strangers_duplicates_and_wrong_adapter_are_refused_without_replacing_entries() -> None:
    m = machine()
    assert m.admit("mallory", "med", 3).code == NOT_PARTICIPANT
    m.reject("mallory", m.admit("mallory", "med", 3), T0 + 1)
    submit(m, "a", T0 + 1)
    dup = m.admit("a", "med", 3)
    assert dup.code == DUPLICATE
    m.reject("a", dup, T0 + 2)
    assert m.entries["a"].rejection is None  # the first, valid entry stays
    assert m.admit("b", "code", 3).code == WRONG_ADAPTER
    assert [e.replica_id for e in m.refused] == ["mallory", "a"]
    assert "mallory" not in m.entries


def test_zero_samples_are_rejected() -> None:
    m = machine()
    e = submit(m, "a", T0 + 1, samples=0)
    assert e.rejection.code == NO_SAMPLES


def test_staleness_policy_weights_older_bases_down() -> None:
    m = machine(late_policy="staleness", staleness_weight=0.5, max_staleness=1)
    submit(m, "a", T0 + 1, base=3, samples=10)
    submit(m, "b", T0 + 2, base=2, samples=10)
    e = submit(m, "c", T0 + 3, base=1, samples=10)  # gap 2 > max_staleness
    assert e.rejection.code == WRONG_BASE
    assert m.weights() == {"a": 10.0, "b": 5.0}


def test_carried_late_updates_join_the_next_round_only_under_staleness() -> None:
    from collm_aggregator.machine import Entry

    late = Entry("a", 2, 8, T0 - 5, carried_from=6)
    drop = machine()
    assert drop.carry(late).code == WRONG_BASE
    m = machine(late_policy="staleness", quorum=1)
    assert m.carry(late) == Admitted(1)
    assert m.weights() == {"a@r6": 4.0}
    assert m.valid_from_participants == 0  # carried updates never make the quorum
    assert m.carry(late).code == DUPLICATE


def test_rebase_moves_the_base_and_ages_every_accepted_update_only_after_the_close() -> None:
    m = machine()
    submit(m, "a", T0 + 1)
    submit(m, "b", T0 + 2)
    with pytest.raises(PhaseError):
        m.rebase(4)  # still collecting
    m.close(T0 + 60)
    with pytest.raises(PhaseError):
        m.rebase(3)  # not newer than the base
    m.rebase(4)
    assert m.base_version == 4 and m.rebased_from == 3
    assert [e.staleness for e in m.accepted] == [1, 1]
    assert m.weights() == {"a": 5.0, "b": 5.0}  # uniform: the normalised weights are unchanged


def test_norm_outliers_are_rejected_at_close() -> None:
    m = machine(quorum=2, norm_outlier_factor=4.0)
    submit(m, "a", T0 + 1, norm=1.0)
    submit(m, "b", T0 + 2, norm=1.2)
    submit(m, "c", T0 + 3, norm=50.0)
    accepted = m.close(T0 + 3)
    assert [e.replica_id for e in accepted] == ["a", "b"]
    assert m.entries["c"].rejection.code == NORM_OUTLIER


def test_norm_outliers_can_abort_the_round() -> None:
    m = machine(quorum=3, norm_outlier_factor=4.0)
    for rid, n in (("a", 1.0), ("b", 1.1), ("c", 90.0)):
        submit(m, rid, T0 + 1, norm=n)
    assert m.close(T0 + 2) == []
    assert m.phase is Phase.ABORTED and "norm outliers" in m.reason


def test_gate_publishes_or_holds_back() -> None:
    m = machine(quorum=1, gate=GateRule(min_gain_nats=0.05))
    submit(m, "a", T0 + 1)
    m.close(T0 + 2)
    m.candidate_ready(T0 + 3)
    assert m.decide(EvalSummary(2.0, 1.94)).publish
    m.published(4, T0 + 4)
    assert (m.phase, m.new_version) == (Phase.PUBLISHED, 4)
    assert m.timeline == {
        "opened": T0,
        "collecting": T0,
        "aggregating": T0 + 2,
        "evaluating": T0 + 3,
        "published": T0 + 4,
    }

    h = machine(quorum=1, gate=GateRule(min_gain_nats=0.05))
    submit(h, "a", T0 + 1)
    h.close(T0 + 2)
    h.candidate_ready(T0 + 3)
    g = h.decide(EvalSummary(2.0, 1.97))
    assert not g.publish and "needs <= -0.0500" in g.reason
    with pytest.raises(PhaseError):
        h.published(4, T0 + 4)
    h.held_back(T0 + 4)
    assert h.phase is Phase.HELD_BACK and h.reason == g.reason


def test_gate_without_eval_holds_back_unless_configured() -> None:
    for allow, publish in ((False, False), (True, True)):
        m = machine(quorum=1, gate=GateRule(publish_without_eval=allow))
        submit(m, "a", T0 + 1)
        m.close(T0 + 2)
        m.candidate_ready(T0 + 3)
        assert m.decide(EvalSummary(None, None)).publish is publish


def test_illegal_transitions_raise() -> None:
    m = machine()
    with pytest.raises(PhaseError):
        m.candidate_ready(T0)
    with pytest.raises(PhaseError):
        m.decide(EvalSummary(1.0, 1.0))
    m.abort("stop", T0 + 1)
    with pytest.raises(PhaseError):
        m.abort("again", T0 + 2)
    with pytest.raises(PhaseError):
        m.poll(T0 + 3)


def test_rules_are_validated() -> None:
    with pytest.raises(ValueError):
        RoundRules(quorum=0, deadline_unix_s=1.0)
    with pytest.raises(ValueError):
        RoundMachine(1, "a", 1, (), RoundRules(quorum=1, deadline_unix_s=1.0), 0.0)
