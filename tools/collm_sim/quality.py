"""The simulated quality of an adapter: held-out eval loss against the tokens it was trained on.

Each domain's curve comes from the calibration file (`QualityCurve`: base loss and measured
(training tokens, eval loss) points, written by the engine benchmark). Between points the loss is
interpolated linearly in log(1 + tokens). Past the last measured point T_m:

* `extrapolate="hold"`: the loss stays at the last measured one (no gain the engine has not shown);
* `extrapolate="log"` (default): the curve continues as L(T) = L(T_m) - k * ln((1 + T/tau) / (1 + T_m/tau)),
  with k and tau fitted (least squares, tau on a log grid) to all measured points, up to
  `max_factor` x T_m, and holds beyond. A calibration on a CPU measures a few thousand tokens, far
  fewer than a cluster trains in minutes; holding would make every policy's quality saturate in its
  first round. Results say how many tokens were credited past the measured range.

A federated round's aggregate counts as the sum of the accepted participants' tokens: the adapter of
domain d after rounds with T_d tokens in total has loss curve_d(T_d).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from collm_common.calibration import QualityCurve


class QualityModel:
    def __init__(
        self, curves: Sequence[QualityCurve], extrapolate: str = "log", max_factor: float = 100.0
    ) -> None:
        if not curves:
            raise ValueError("the calibration has no quality curves: the simulator needs at least one domain")
        if extrapolate not in ("log", "hold"):
            raise ValueError("extrapolate must be 'log' or 'hold'")
        self.curves = {c.domain: c for c in curves}
        self.extrapolate = extrapolate
        self.max_factor = max_factor
        self._x: dict[str, list[float]] = {}
        self._y: dict[str, list[float]] = {}
        self._last: dict[str, float] = {}
        self._fit: dict[str, tuple[float, float]] = {}
        for c in curves:
            pts = sorted((int(t), float(loss)) for t, loss in c.points if t > 0)
            self._x[c.domain] = [0.0] + [math.log1p(t) for t, _ in pts]
            self._y[c.domain] = [c.base_loss] + [loss for _, loss in pts]
            self._last[c.domain] = float(pts[-1][0]) if pts else 0.0
            self._fit[c.domain] = fit_log_curve(c.base_loss, pts)

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(sorted(self.curves))

    def measured_tokens(self, domain: str) -> float:
        return self._last[domain]

    def base_loss(self, domain: str) -> float:
        return self.curves[domain].base_loss

    def loss(self, domain: str, tokens: float) -> float:
        xs, ys = self._x[domain], self._y[domain]
        tokens = max(0.0, tokens)
        x = math.log1p(tokens)
        if x >= xs[-1]:
            last = self._last[domain]
            k, tau = self._fit[domain]
            if self.extrapolate == "hold" or last <= 0 or k <= 0:
                return ys[-1]
            t = min(tokens, self.max_factor * last)
            return ys[-1] - k * math.log((1 + t / tau) / (1 + last / tau))
        for i in range(1, len(xs)):
            if x <= xs[i]:
                f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
                return ys[i - 1] + f * (ys[i] - ys[i - 1])
        return ys[-1]

    def gain(self, domain: str, tokens: float) -> float:
        return self.base_loss(domain) - self.loss(domain, tokens)


def fit_log_curve(base_loss: float, points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(k, tau) of base_loss - L(T) = k ln(1 + T/tau), least squares over tau in a log grid."""
    if not points:
        return 0.0, 1.0
    best = (math.inf, 0.0, 1.0)
    for i in range(41):
        tau = 10 ** (1 + i * 0.15)  # 10 .. 1e7 tokens
        f = [math.log1p(t / tau) for t, _ in points]
        y = [base_loss - loss for _, loss in points]
        den = sum(v * v for v in f)
        if den <= 0:
            continue
        k = sum(a * b for a, b in zip(f, y, strict=True)) / den
        err = sum((k * a - b) ** 2 for a, b in zip(f, y, strict=True))
        if err < best[0]:
            best = (err, k, tau)
    return max(0.0, best[1]), best[2]
