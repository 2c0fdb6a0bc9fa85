"""Task metrics users recognise, scored on a domain's held-out examples from greedy generations (pure).

A domain's loss says how likely the model finds the reference answer; a task metric says how often what
it actually answers is right. Each metric compares one generated answer with the example's reference
response and scores it in [0, 1]; a version's score on a site is the mean over the site's first held-out
examples (`TaskEvaluator` in `task_eval.py` generates them):

* `intent_accuracy`: the answer's first line, lower-cased and stripped of surrounding punctuation and
  quotes, equals the reference label exactly (classification data such as banking intents);
* `answer_accuracy`: the final number of the answer equals the reference's (grade-school maths: the
  number after "The answer is" or "####" when present, otherwise the last number in the text; commas,
  currency signs and trailing zeros ignored);
* `rouge_l`: ROUGE-L F1 of the answer against the reference (Google's `rouge-score`, Porter stemming),
  for free-text answers such as medical questions.

`METRICS` names each metric with the output tokens its generations may use (`max_tokens`).
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import cache
from typing import Any

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
_FINAL = re.compile(r"(?:the answer is|####)\s*:?\s*(-?\$?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_STRIP = string.punctuation + string.whitespace + "\u201c\u201d\u2018\u2019"


def normalise_label(text: str) -> str:
    """The first non-empty line, lower-cased, without surrounding punctuation, quotes or spaces."""
    for line in text.strip().splitlines():
        if line.strip(_STRIP):
            return line.strip(_STRIP).lower()
    return ""


def intent_accuracy(answer: str, reference: str) -> float:
    return float(normalise_label(answer) == normalise_label(reference) != "")


def _number(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").replace("$", "")).normalize()
    except InvalidOperation:
        return None


def final_number(text: str) -> Decimal | None:
    """The final answer's number: after "The answer is" / "####" when present, else the last number."""
    marked = _FINAL.findall(text)
    found = marked or _NUMBER.findall(text)
    return _number(found[-1]) if found else None


def answer_accuracy(answer: str, reference: str) -> float:
    want = final_number(reference)
    return float(want is not None and final_number(answer) == want)


@cache
def _rouge() -> Any:
    from rouge_score import rouge_scorer  # imported on first use: only replicas that score free text

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(answer: str, reference: str) -> float:
    return float(_rouge().score(reference, answer)["rougeL"].fmeasure)


@dataclass(frozen=True)
class TaskMetric:
    name: str
    score: Callable[[str, str], float]  # (generated answer, reference) -> [0, 1]
    max_tokens: int  # output tokens a generation may use


METRICS: dict[str, TaskMetric] = {
    m.name: m
    for m in (
        TaskMetric("intent_accuracy", intent_accuracy, max_tokens=16),
        TaskMetric("answer_accuracy", answer_accuracy, max_tokens=160),
        TaskMetric("rouge_l", rouge_l, max_tokens=96),
    )
}
