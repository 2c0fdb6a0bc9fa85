"""The four coordinator policies behind one interface (`COLLM_COORDINATOR_POLICY`)."""

from __future__ import annotations

from typing import Protocol

from collm_coordinator.core.baselines import FixedRatioPolicy, LeftoverPolicy, SeparatePolicy
from collm_coordinator.core.config import POLICIES
from collm_coordinator.core.fast_loop import collm_fast
from collm_coordinator.core.slow_loop import collm_slow
from collm_coordinator.core.state import ClusterView
from collm_coordinator.core.types import FastDecision, SlowDecision


class Policy(Protocol):
    """A coordinator policy: both loops as functions of a frozen view of the cluster."""

    name: str

    def fast(self, view: ClusterView) -> FastDecision: ...

    def slow(self, view: ClusterView) -> SlowDecision: ...


class CollmPolicy:
    """The two-timescale algorithm (fast_loop.py, slow_loop.py)."""

    name = "collm"

    def fast(self, view: ClusterView) -> FastDecision:
        return collm_fast(view)

    def slow(self, view: ClusterView) -> SlowDecision:
        return collm_slow(view)


def make_policy(name: str) -> Policy:
    if name == "collm":
        return CollmPolicy()
    if name == "separate":
        return SeparatePolicy()
    if name == "fixed_ratio":
        return FixedRatioPolicy()
    if name == "leftover":
        return LeftoverPolicy()
    raise ValueError(f"unknown coordinator policy {name!r}: choose one of {', '.join(POLICIES)}")
