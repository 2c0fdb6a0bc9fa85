"""Update validation, federated-eval summaries, the promotion gate and the built-in planner."""

import math

import numpy as np
import pytest

from collm_aggregator.evaluation import (
    EvalSummary,
    GateRule,
    LossEntry,
    PairedGain,
    paired_gain,
    promotion_gate,
    summarize,
)
from collm_aggregator.planner import (
    PlanConfig,
    PlanDraft,
    ReplicaView,
    Skip,
    choose_evaluators,
    default_plans,
    quorum_for,
)
from collm_aggregator.validation import (
    BASE_MODEL,
    KEYS,
    NORM,
    NOT_FINITE,
    SHAPE,
    SPEC,
    Expected,
    check_tensors,
)

pytestmark = pytest.mark.unit

KA, KB = "m.q_proj.lora_A.weight", "m.q_proj.lora_B.weight"


def base() -> dict[str, np.ndarray]:
    return {KA: np.ones((2, 3), np.float32), KB: np.zeros((4, 2), np.float32)}


EXPECTED = Expected(tensors=base(), spec_json='{"r": 2}', base_model="m0", max_delta_norm=10.0)


def check(t: dict[str, np.ndarray], spec: str = '{"r": 2}', model: str = "m0"):
    return check_tensors(t, spec, model, EXPECTED)


def test_valid_update_reports_its_change_norm() -> None:
    t = base()
    t[KB] = t[KB] + 0.5
    rejection, norm = check(t)
    assert rejection is None and norm == pytest.approx(math.sqrt(8 * 0.25))


@pytest.mark.parametrize(
    ("mutate", "code"),
    [
        (lambda t: t.__setitem__(KB, np.full((4, 2), np.nan, np.float32)), NOT_FINITE),
        (lambda t: t.__setitem__(KA, np.full((2, 3), np.inf, np.float32)), NOT_FINITE),
        (lambda t: t.__setitem__(KB, np.zeros((5, 2), np.float32)), SHAPE),
        (lambda t: t.pop(KB), KEYS),
        (lambda t: t.__setitem__("m.k_proj.lora_A.weight", np.zeros((2, 3), np.float32)), KEYS),
        (lambda t: t.__setitem__(KB, np.full((4, 2), 100.0, np.float32)), NORM),
    ],
)
def test_bad_updates_are_rejected_with_a_code(mutate, code: str) -> None:
    t = base()
    mutate(t)
    rejection, _ = check(t)
    assert rejection is not None and rejection.code == code and rejection.reason


def test_spec_and_base_model_must_match() -> None:
    assert check(base(), spec='{"r": 4}')[0].code == SPEC
    assert check(base(), model="other")[0].code == BASE_MODEL


def test_summary_weights_by_examples_and_pairs_before_after() -> None:
    s = summarize(
        [
            LossEntry("r0", "math", 30, 2.0, 1.0),
            LossEntry("r1", "math", 10, 4.0, 3.0),
            LossEntry("r2", "code", 20, None, 5.0),  # cannot score the current version: not in the pair
            LossEntry("r3", "code", 0, 1.0, 1.0),  # no examples: ignored
        ]
    )
    assert s.before == pytest.approx((30 * 2 + 10 * 4) / 40)
    assert s.after == pytest.approx((30 * 1 + 10 * 3) / 40)
    assert s.domains_after == {"math": pytest.approx(1.5), "code": pytest.approx(5.0)}
    assert s.domains_before == {"math": pytest.approx(2.5)}
    assert s.num_examples == 60 and s.replicas == ("r0", "r1", "r2")
    empty = summarize([])
    assert (empty.before, empty.after) == (None, None)
    nan = summarize([LossEntry("r0", "x", 5, 1.0, float("nan"))])
    assert nan.after == math.inf


def test_gate_without_per_example_losses_needs_the_minimum_gain() -> None:
    rule = GateRule(min_gain_nats=0.01)
    assert promotion_gate(EvalSummary(2.0, 1.98), rule).publish
    assert not promotion_gate(EvalSummary(2.0, 1.995), rule).publish  # better, but by less than the gain
    assert not promotion_gate(EvalSummary(2.0, 2.0), rule).publish
    assert not promotion_gate(EvalSummary(2.0, 2.2), rule).publish
    assert promotion_gate(EvalSummary(2.0, 2.05), GateRule(min_gain_nats=-0.1)).publish  # a test's wide gate
    assert not promotion_gate(EvalSummary(2.0, math.inf), rule).publish
    assert promotion_gate(EvalSummary(None, 2.0), rule).publish
    assert not promotion_gate(EvalSummary(None, None), rule).publish
    assert promotion_gate(EvalSummary(None, None), GateRule(publish_without_eval=True)).publish


def _entry(rid: str, cur: list[float], cand: list[float], tokens: list[int]) -> LossEntry:
    n = sum(tokens)
    return LossEntry(
        rid, "math", len(tokens), sum(cur) / n, sum(cand) / n, tuple(tokens), tuple(cand), tuple(cur)
    )


def test_paired_gain_pools_examples_per_token_with_the_ratio_estimators_error() -> None:
    a = _entry("r0", [10.0, 20.0, 30.0], [9.0, 18.0, 29.0], [10, 20, 30])
    b = _entry("r1", [8.0, 12.0], [8.0, 10.0], [8, 12])
    g = paired_gain([a, b, LossEntry("r2", "math", 4, 1.0, 0.5)])  # r2 reports no examples: not pooled
    assert g is not None and (g.examples, g.tokens) == (5, 80)
    d = [-1.0, -2.0, -1.0, 0.0, -2.0]
    t = [10, 20, 30, 8, 12]
    diff = sum(d) / 80
    se = math.sqrt(5 / 4 * sum((di - diff * ti) ** 2 for di, ti in zip(d, t, strict=True))) / 80
    assert g.diff_nats == pytest.approx(diff) and g.se_nats == pytest.approx(se)
    assert summarize([a, b]).paired == g
    assert paired_gain([_entry("r0", [1.0], [0.5], [4])]) is None  # one example: no error to estimate


def test_paired_gate_publishes_only_a_gain_beyond_its_noise() -> None:
    rule = GateRule(min_gain_nats=0.005, z=2.0)

    def gate(diff: float, se: float) -> bool:
        return promotion_gate(
            EvalSummary(2.0, 2.0 + diff, paired=PairedGain(diff, se, 64, 4000)), rule
        ).publish

    assert gate(-0.05, 0.01)  # -0.05 + 2 * 0.01 = -0.03 <= -0.005
    assert not gate(-0.05, 0.03)  # within its noise: -0.05 + 0.06 > 0
    assert not gate(-0.004, 0.0)  # no noise, but below the minimum gain
    assert not gate(0.02, 0.001)  # worse: never
    assert not gate(math.inf, math.inf)
    reason = promotion_gate(EvalSummary(2.0, 1.95, paired=PairedGain(-0.05, 0.01, 64, 4000)), rule).reason
    assert "-0.0500 +- 0.0100" in reason and "64 examples" in reason


CFG = PlanConfig(
    token_budget=100, learning_rate=1e-4, deadline_s=30, quorum_fraction=0.5, telemetry_stale_s=10
)
NOW = 1000.0


def test_built_in_plan_picks_live_replicas_with_data_for_the_domains() -> None:
    replicas = [
        ReplicaView("r0", NOW - 1, 50, ("math",)),
        ReplicaView("r1", NOW - 1, 50, ("code",)),
        ReplicaView("r2", NOW - 1, 0, ("math",)),  # no local data
        ReplicaView("r3", NOW - 60, 50, ("math",)),  # silent for too long
        ReplicaView("r4", NOW - 2, 50, ("math", "code")),
    ]
    out = default_plans(replicas, {"math": ["math"], "shared": []}, {"math": 3, "shared": 1}, set(), CFG, NOW)
    math_plan, shared_plan = out
    assert isinstance(math_plan, PlanDraft) and math_plan.participants == ("r0", "r4")
    assert (math_plan.base_version, math_plan.quorum, math_plan.deadline_unix_s) == (3, 1, NOW + 30)
    assert isinstance(shared_plan, PlanDraft) and shared_plan.participants == ("r0", "r1", "r4")
    assert shared_plan.quorum == 2


def test_built_in_plan_skips_with_reasons() -> None:
    replicas = [ReplicaView("r0", NOW, 5, ("math",))]
    out = default_plans(
        replicas, {"a": [], "b": [], "c": ["law"]}, {"a": None, "b": 1, "c": 1}, {"b"}, CFG, NOW
    )
    assert all(isinstance(o, Skip) for o in out)
    reasons = {o.adapter: o.reason for o in out}
    assert "no current version" in reasons["a"]
    assert "still running" in reasons["b"]
    assert "0 replica(s)" in reasons["c"]


def test_evaluators_are_the_first_holders_by_name_whoever_trained() -> None:
    holders = [f"r{i:02d}" for i in range(32)]
    # The same sites judge every round: holders (participants among them) in name order, up to the cap.
    assert choose_evaluators(["r20", "x9"], holders, 4) == ["r00", "r01", "r02", "r03"]
    assert choose_evaluators(["r07"], holders, 4) == choose_evaluators(["r20", "r21"], holders, 4)
    assert choose_evaluators(["r20", "x9"], holders, None) == [*holders, "x9"]
    # Whatever order the lists come in.
    parts = ["r07", "r03", "r05", "r01", "r02"]
    first = ["r00", "r01", "r02", "r03"]
    assert choose_evaluators(list(reversed(parts)), list(reversed(holders)), 4) == first
    # A participant whose update was refused neither judges nor takes a place under the cap.
    assert choose_evaluators(["a", "evil", "b"], ["c", "d", "evil"], 3, exclude={"evil"}) == ["a", "b", "c"]
    assert choose_evaluators([], ["b", "a"], 4) == ["a", "b"]
    assert choose_evaluators([], [], 4) == []


def test_quorum_for() -> None:
    assert [quorum_for(n, 0.5) for n in (1, 2, 3, 4)] == [1, 1, 2, 2]
    assert quorum_for(3, 1.0) == 3


def test_pre_scored_current_losses_pair_only_on_the_same_eval_set() -> None:
    from collm_aggregator.evaluation import ScoredDomain, pair_with_current

    cur = [ScoredDomain("math", "m1", 1.5), ScoredDomain("med", "d1", 2.5)]
    assert pair_with_current(cur, [ScoredDomain("math", "m1", 1.2)]) == {"math": 1.5}
    assert pair_with_current(cur, [ScoredDomain("math", "m1", 1.2), ScoredDomain("med", "d1", 2.0)]) == {
        "math": 1.5,
        "med": 2.5,
    }
    assert pair_with_current(cur, [ScoredDomain("med", "d2", 2.0)]) is None  # its held-out set changed
    assert pair_with_current(cur, [ScoredDomain("code", "c1", 2.0)]) is None  # never pre-scored
    assert pair_with_current([ScoredDomain("math", "", 1.5)], [ScoredDomain("math", "", 1.2)]) is None
