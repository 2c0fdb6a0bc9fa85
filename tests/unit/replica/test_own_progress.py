"""A participant's own change carried into its next round job while the version it starts from lacks it."""

from __future__ import annotations

import pytest
import torch

from collm_replica.own_progress import OwnProgress, sent_tensors, start_point

pytestmark = pytest.mark.unit


def t(x: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((2, 3), x), "b": torch.full((3,), 2 * x)}


def test_a_change_is_carried_only_while_the_base_lacks_it() -> None:
    own = OwnProgress.of(round_id=7, base_version=3, sent=t(1.5), base=t(1.0))
    assert own is not None
    assert torch.equal(own.change["a"], torch.full((2, 3), 0.5))
    assert own.missing_from(3, published_by_round=5)  # its own base: the round has not published
    assert own.missing_from(4, published_by_round=6)  # published by an earlier round
    assert not own.missing_from(4, published_by_round=7)  # published by this very round
    assert not own.missing_from(5, published_by_round=8)  # ... or by a later one
    assert not own.missing_from(4, published_by_round=None)  # imported or created: start afresh
    assert not own.missing_from(2, published_by_round=4)  # rolled back to an older version


def test_the_job_starts_at_base_plus_change_and_sends_only_its_own_change() -> None:
    own = OwnProgress.of(7, 3, sent=t(1.5), base=t(1.0))
    base = t(2.0)  # the version the next job is asked to train from
    start, offset = start_point(base, own)
    assert torch.equal(start["a"], torch.full((2, 3), 2.5))
    end = {k: v + 0.25 for k, v in start.items()}  # what the job trained
    sent = sent_tensors(end, offset)
    assert torch.allclose(sent["a"], torch.full((2, 3), 2.25))  # base + this job's own change
    assert torch.allclose(sent["b"], torch.full((3,), 4.25))


def test_nothing_is_carried_without_a_change_or_across_different_tensors() -> None:
    base = t(2.0)
    assert start_point(base, None) == (base, {})
    assert OwnProgress.of(1, 1, sent={"a": torch.zeros(2, 3)}, base=t(0.0)) is None
    other = OwnProgress(1, 1, {"a": torch.zeros(4, 4), "b": torch.zeros(3)})
    start, offset = start_point(base, other)
    assert offset == {} and start == base
    assert sent_tensors(base, {}) == base
