"""Task metrics: intent accuracy, final-answer accuracy and ROUGE-L on known answers."""

from __future__ import annotations

from decimal import Decimal

import pytest

from collm_replica.settings import ReplicaSettings
from collm_replica.task_metrics import (
    METRICS,
    answer_accuracy,
    final_number,
    intent_accuracy,
    normalise_label,
    rouge_l,
)


def test_intent_accuracy_is_an_exact_label_match_after_normalising() -> None:
    assert intent_accuracy("card_arrival", "card_arrival") == 1.0
    assert intent_accuracy('  "Card_Arrival".\nbecause the card...', "card_arrival") == 1.0
    assert intent_accuracy("card_arrival_delay", "card_arrival") == 0.0
    assert intent_accuracy("the intent is card_arrival", "card_arrival") == 0.0
    assert intent_accuracy("", "card_arrival") == 0.0 and intent_accuracy("", "") == 0.0
    assert normalise_label("\n\n  Top_Up!  \nmore") == "top_up"


def test_final_answer_accuracy_reads_the_marked_number_else_the_last_one() -> None:
    ref = "The foodstuff cost 2+3=$5\nSo the total cost is 5+10+1=$16\nThe answer is 16."
    assert final_number(ref) == Decimal(16)
    assert answer_accuracy("5 + 11 = 16. The answer is 16", ref) == 1.0
    assert answer_accuracy("It costs $16.00 in all", ref) == 1.0  # last number, currency and zeros ignored
    assert answer_accuracy("The answer is 15. Check: 16", ref) == 0.0  # the marked number wins
    assert answer_accuracy("#### 1,250", "The answer is 1250.") == 1.0
    assert answer_accuracy("-3 degrees", "The answer is -3") == 1.0
    assert answer_accuracy("no idea", ref) == 0.0
    assert answer_accuracy("16", "no number here") == 0.0


def test_rouge_l_is_the_lcs_f_measure_with_stemming() -> None:
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert rouge_l("completely different words", "the cat sat on the mat") == 0.0
    # LCS "cat sat on mat" ("mats" stems to "mat"), 4 tokens of 5 and 6: P = 4/5, R = 4/6.
    p, r = 4 / 5, 4 / 6
    assert rouge_l("a cat sat on mats", "the cat sat on the mat") == pytest.approx(2 * p * r / (p + r))
    assert rouge_l("Treatments treated", "treatment treat") == pytest.approx(1.0)  # Porter stems


def test_every_metric_is_bounded_and_the_settings_refuse_an_unknown_one() -> None:
    for m in METRICS.values():
        assert 0.0 <= m.score("x", "y") <= 1.0 and m.max_tokens > 0
    s = ReplicaSettings(model="tiny", task_metrics={"math": "answer_accuracy"})
    assert s.task_metrics == {"math": "answer_accuracy"}
    with pytest.raises(ValueError, match="unknown metric 'bleu'"):
        ReplicaSettings(model="tiny", task_metrics={"math": "bleu"})
