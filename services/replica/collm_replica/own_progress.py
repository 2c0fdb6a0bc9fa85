"""A participant's own progress not yet in the version it is asked to train from (async rounds).

With async rounds an adapter's next round opens while its previous one still aggregates, evaluates and
publishes, so the next job's base version does not hold this replica's last update yet. Started from that
base, the job would compute its change again from where the last one started, on the same local data,
and the aggregator, rebasing it onto the version the last round publishes, would apply nearly the same
step twice. Instead the job starts from the base plus this replica's own change of its last round (where
the published version is about to be), and the update it sends is the base plus what this job added:

    start = B + d_last          (d_last: the last round's update minus its base, when B lacks it)
    sent  = B + (end - start)   so the aggregator sees, from B, only this job's change

B lacks the last round's change when B is that round's own base, or B was published by an earlier round.
Pure: tensors in, tensors out; the participant keeps one `OwnProgress` per adapter in memory (a restart
forgets it, and the next job starts from its base).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

Tensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class OwnProgress:
    """What the replica's last round job of an adapter changed: its update minus its base."""

    round_id: int
    base_version: int
    change: dict[str, torch.Tensor]

    @classmethod
    def of(cls, round_id: int, base_version: int, sent: Tensors, base: Tensors) -> OwnProgress | None:
        """The change of an update `sent` from its `base` (None: their tensors differ)."""
        if not _same_shapes(sent, base):
            return None
        return cls(round_id, base_version, {k: (sent[k] - base[k]).detach().clone() for k in sent})

    def missing_from(self, base_version: int, published_by_round: int | None) -> bool:
        """Does version `base_version` (published by round `published_by_round`, None: not by a round)
        lack this change? Yes when it is the version this change was trained from, or a later one that
        an earlier round published; a version published by this round or a later one, or imported,
        rolled back to or created otherwise, does not need it."""
        if base_version == self.base_version:
            return True
        if base_version < self.base_version or published_by_round is None:
            return False
        return published_by_round < self.round_id


def start_point(
    base: Tensors, carried: OwnProgress | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The job's starting tensors and the offset to take off its update ({} when nothing is carried or
    the tensors differ)."""
    if carried is None or not _same_shapes(carried.change, base):
        return dict(base), {}
    return {k: base[k] + carried.change[k] for k in base}, dict(carried.change)


def sent_tensors(end: Tensors, offset: Tensors) -> dict[str, torch.Tensor]:
    """The update to send: the job's end minus the carried offset (its change from the base is this
    job's own)."""
    if not offset:
        return dict(end)
    return {k: end[k] - offset[k] if k in offset else end[k] for k in end}


def _same_shapes(a: Tensors, b: Tensors) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
