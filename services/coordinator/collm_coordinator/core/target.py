"""The long-term SLO attainment target, as a pure state: the signed virtual queue, its headroom, and the
spend (the part of a share the replicas train beyond their requests' slack).

    target = AttainmentTarget(config)
    target.count(good, finished, good_alone)   # each replica report: its window's counts
    target.update(dt_s)                         # each fast tick: q, headroom, spend

The target in force (`effective_target`) is the user's `attainment_target`, or, where serving alone could
not reach it (overload), `attainable_frac` x the attainable level: the attainment the requests would have
had without the training that ran while they were in flight (`good_alone`, smoothed over
`attainable_tau_s`). A target the load cannot allow would only cut training and buy no attainment.

Z = `virtual_queue` prices SLO risk in the slow loop; `headroom` lets shares grow and sets the spend; the
fast loop sends the spend with every share (fast_loop.py).
"""

from __future__ import annotations

import math

from collm_coordinator.core.config import CoreConfig


class AttainmentTarget:
    """The attainment target's control state (module docstring)."""

    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        # The signed virtual queue: Z = max(0, q), headroom from max(0, -q) (`update`).
        self.signed_queue = 0.0
        self.spend = 0.0  # follows spend_gain x headroom: at once down, at most spend_rise_per_s up
        self.last_attainment: float | None = None
        self._good = 0
        self._finished = 0
        self._good_alone = 0
        self._alone_finished = 0  # finished in the reports that carried good_alone
        self._reports = 0
        # The attainable level (module docstring); None until reports carried good_alone.
        self.attainable: float | None = None

    def count(self, good: int, finished: int, good_alone: int | None = None) -> None:
        """One replica report's `good`, `finished` and `good_alone` counts (over its SLO window; None:
        the replica does not measure it)."""
        self._good += good
        self._finished += finished
        self._reports += 1
        if good_alone is not None:
            self._good_alone += good_alone
            self._alone_finished += finished

    @property
    def effective_target(self) -> float:
        """The attainment target in force: the user's, or `attainable_frac` x the attainable level where
        that is lower (module docstring)."""
        cfg = self.config
        if self.attainable is None or cfg.attainable_frac <= 0:
            return cfg.attainment_target
        return min(cfg.attainment_target, cfg.attainable_frac * self.attainable)

    def update(self, dt_s: float) -> None:
        """q <- q + gain * (target - attainment) * dt / slow_interval, the signed virtual queue of the
        attainment target: it grows while the attainment falls short of the target and falls while
        it is above. Its positive part is Z (`virtual_queue`, the price of SLO risk in the slow
        loop); its negative part is headroom (`headroom`, h = min(1, headroom_gain * -q)): the SLO
        budget left unspent, which lets shares grow. q is bounded below where h reaches 1 (no
        wind-up: under the target the headroom goes at the rate it came, before Z grows; a replica
        whose own SLOs are at risk still gets share 0 in the same tick, `ClusterState.risk_of`) and above at
        `max_virtual_queue` (a past shortfall holds training back for minutes, not for as long as
        it lasted). The attainment is that of the reports received since the last fast tick: their
        `good` and `finished` counts summed, each report's over its replica's SLO window
        (`slo_window_s`), so with one report per replica per tick it is the cluster's windowed
        attainment, and a request counts in every tick while it is in a window; below
        `min_finished_for_attainment` finished in those reports q holds and the counts carry over;
        with none at all the attainment is unknown (`last_attainment` None: an idle stack shows
        none, not the last one measured)."""
        cfg = self.config
        if self._reports and not self._finished:
            # Reports came and no request finished in any replica's window: no attainment to show.
            self.last_attainment = None
            self._reports = 0
        if self._finished >= cfg.min_finished_for_attainment:
            self._reports = 0
            att = self._good / self._finished
            self.last_attainment = att
            self._learn_attainable(dt_s)
            step = cfg.virtual_queue_gain * (self.effective_target - att) * dt_s / cfg.slow_interval_s
            floor = -1.0 / cfg.headroom_gain if cfg.headroom_gain > 0 else 0.0
            self.signed_queue = min(cfg.max_virtual_queue, max(floor, self.signed_queue + step))
            self._good = 0
            self._finished = 0
            self._good_alone = 0
            self._alone_finished = 0
        self._update_spend(dt_s)

    def _learn_attainable(self, dt_s: float) -> None:
        """The attainable level follows the reports' good_alone / finished with time constant
        `attainable_tau_s` (the first measurement sets it)."""
        if self._alone_finished < self.config.min_finished_for_attainment:
            return
        now = self._good_alone / self._alone_finished
        if self.attainable is None:
            self.attainable = now
            return
        alpha = 1.0 - math.exp(-max(0.0, dt_s) / self.config.attainable_tau_s)
        self.attainable += alpha * (now - self.attainable)

    def _update_spend(self, dt_s: float) -> None:
        """The spend (the part of a share the replicas train beyond their requests' slack) follows
        `spend_gain` x h in steps of `share_step`: down at once, up by at most `spend_rise_per_s`, so the
        attainment window sees what a spend costs before it grows (the headroom grows while a window
        still shows the attainment of before); 0 while the last tick's attainment is under the target
        (the headroom, an integral, goes only at the rate it came)."""
        cfg = self.config
        aim = math.floor(cfg.spend_gain * self.headroom / cfg.share_step + 1e-9) * cfg.share_step
        aim = min(1.0, aim)
        if self.last_attainment is not None and self.last_attainment < self.effective_target:
            aim = 0.0  # the last tick fell short: no training at the requests' cost until it is back
        rise = cfg.spend_rise_per_s * max(0.0, dt_s)
        self.spend = round(aim if aim <= self.spend else min(aim, self.spend + rise), 4)

    @property
    def virtual_queue(self) -> float:
        """Z: the positive part of the signed queue (0 while attainment has been above the target)."""
        return max(0.0, self.signed_queue)

    @virtual_queue.setter
    def virtual_queue(self, z: float) -> None:
        """Set Z (>= 0): the signed queue becomes `z` (no headroom)."""
        self.signed_queue = max(0.0, z)

    @property
    def headroom(self) -> float:
        """h in [0, 1]: the negative part of the signed queue times `headroom_gain`."""
        return min(1.0, max(0.0, -self.signed_queue) * self.config.headroom_gain)
