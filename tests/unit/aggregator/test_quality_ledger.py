"""The quality ledger: one comparable loss per version, chained over the sites that scored both."""

from __future__ import annotations

import pytest

from collm_aggregator.quality_ledger import SiteScore, SiteTask, chained, site_mean, task_summary


def site(domain: str, replica: str, loss: float, tokens: int = 100, eval_set: str = "e") -> SiteScore:
    return SiteScore(domain, replica, eval_set, loss, tokens, tokens // 10)


def test_on_a_fixed_set_of_sites_the_chain_is_each_versions_mean_on_that_set() -> None:
    losses = {1: (2.0, 3.0), 2: (1.8, 2.6), 3: (1.5, 2.5)}  # version -> (loss on r0, on r1)

    def scores(v: int) -> list[SiteScore]:
        return [site("d", "r0", losses[v][0], 100), site("d", "r1", losses[v][1], 300)]

    q: dict[str, float] = {}
    for parent, v in ((1, 2), (2, 3)):
        ch = chained(q, scores(parent), scores(v))
        assert ch.restarted == ()
        q = ch.quality
        assert q["d"] == pytest.approx(site_mean(scores(v))["d"])
    assert q["d"] == pytest.approx((1.5 * 100 + 2.5 * 300) / 400)


def test_a_missing_site_does_not_mix_example_sets() -> None:
    # v1 -> v2 on both sites; v2 -> v3 only on r0 (r1 is down): r1 is harder, so a plain mean over
    # whoever answered would show v3 as much better than it is.
    v1 = [site("d", "r0", 1.0), site("d", "r1", 3.0)]
    v2 = [site("d", "r0", 0.9), site("d", "r1", 2.9)]
    q2 = chained({}, v1, v2)
    assert q2.parent_quality == {"d": pytest.approx(2.0)} and q2.quality["d"] == pytest.approx(1.9)
    q3 = chained(q2.quality, v2[:1], [site("d", "r0", 0.8)])
    assert q3.quality["d"] == pytest.approx(1.8)  # the change on r0 only (-0.1), not r0's level (0.8)
    # A site whose digest changed (new held-out samples) is another site: nothing pairs, the chain
    # restarts at the plain mean.
    q4 = chained(q3.quality, [site("d", "r0", 0.8, eval_set="old")], [site("d", "r0", 0.7, eval_set="new")])
    assert q4.restarted == ("d",) and q4.quality["d"] == pytest.approx(0.7)


def test_the_parent_keeps_its_record_and_new_domains_anchor() -> None:
    before = [site("a", "r0", 2.0), site("b", "r0", 5.0)]
    after = [site("a", "r0", 1.5), site("b", "r0", 4.0)]
    ch = chained({"a": 2.2}, before, after)
    assert ch.parent_quality == {"a": 2.2, "b": 5.0}  # "a" stays as recorded; "b" anchors at its mean
    assert ch.quality == {"a": pytest.approx(1.7), "b": pytest.approx(4.0)}
    # Non-finite scores are left out; with no site at all there is nothing to record.
    assert chained({}, [site("a", "r0", float("inf"))], [site("a", "r0", 1.0)]).restarted == ("a",)
    assert chained({"a": 1.0}, [], []).quality == {}


def test_task_summary_is_example_weighted_over_the_sites() -> None:
    out = task_summary(
        [
            SiteTask("math", "r0", "answer_accuracy", 0.5, 8),
            SiteTask("math", "r1", "answer_accuracy", 0.0, 8),
            SiteTask("cs", "r0", "intent_accuracy", 1.0, 2),
            SiteTask("cs", "r1", "intent_accuracy", 0.0, 0),  # nothing scored there
        ]
    )
    assert out == {
        "cs": {"metric": "intent_accuracy", "score": 1.0, "examples": 2, "sites": 1},
        "math": {"metric": "answer_accuracy", "score": 0.25, "examples": 16, "sites": 2},
    }
