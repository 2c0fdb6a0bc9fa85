"""Quality curves of domains the calibration has not measured (pure).

The simulator prices training in served quality through each domain's calibrated curve (held-out loss
against training tokens). A domain without one gets the stated default: the calibrated domains'
curves averaged in relative terms, loss / base loss at each token count of the first calibrated curve
(by domain name; the others interpolated linearly in tokens, held past their last point), on the mean
of their base losses. The result file names every domain that got it. Live runs need no curve: the
replicas measure the base loss and the aggregator every published version's loss; the live
coordinator, without a calibrated prior for a domain, starts from what training has shown on the
other adapters, else its `quality_prior_gain` (`collm_coordinator.core.state.ClusterState.quality_of`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from collm_common.calibration import Calibration, QualityCurve


def relative_loss(curve: QualityCurve, tokens: float) -> float:
    """The curve's loss / base loss at `tokens` (linear between points, held past the last)."""
    pts = sorted((float(t), float(loss)) for t, loss in curve.points)
    if not pts or curve.base_loss <= 0:
        return 1.0
    xs, ys = [0.0, *(t for t, _ in pts)], [curve.base_loss, *(loss for _, loss in pts)]
    return float(np.interp(tokens, xs, ys)) / curve.base_loss


def default_curve(domain: str, curves: Sequence[QualityCurve]) -> QualityCurve:
    """`domain`'s default curve from the calibrated `curves` (module docstring)."""
    if not curves:
        raise ValueError(f"domain {domain!r}: no calibrated quality curve to take a default from")
    ordered = sorted(curves, key=lambda c: c.domain)
    base = float(np.mean([c.base_loss for c in ordered]))
    grid = sorted({int(t) for t, _ in ordered[0].points})
    points = [(t, base * float(np.mean([relative_loss(c, t) for c in ordered]))) for t in grid]
    return QualityCurve(domain=domain, base_loss=base, points=points)


def with_default_curves(cal: Calibration, domains: Sequence[str]) -> tuple[Calibration, list[str]]:
    """The calibration with a default curve for every domain of `domains` it has none for, and those
    domains (sorted)."""
    have = {c.domain for c in cal.quality}
    missing = sorted(set(domains) - have)
    if not missing:
        return cal, []
    added = [default_curve(d, cal.quality) for d in missing]
    return cal.model_copy(update={"quality": [*cal.quality, *added]}), missing
