"""Which replica serves a request: a pure policy over snapshots (no I/O, no clock, no randomness of its own).

Inputs are the replicas' latest telemetry with its age, the coordinator's latest `RoutingWeights` with
its age, the requested adapter (and pinned version), and one uniform draw in [0, 1). The output is a
ranked list of replicas to try in order (the first is the choice, the rest are retries).

Guarantees:

* A replica whose telemetry is stale (older than `max(telemetry_stale_s, telemetry_stale_intervals *
  its interval_s)`) is never ranked.
* Coordinator weights (per adapter when the coordinator sent a row for it, else per replica) decide the
  first choice by a weighted draw. They apply in full for `weights_hold_frac * ttl_s`, then their
  influence decays linearly towards even weights, and from `ttl_s` on they are ignored.
* Without usable weights the first choice is the least-loaded replica: load is (queue + running) over
  capacity (max_batch), counting this gateway's own in-flight requests when telemetry lags behind them;
  a replica where the adapter is not resident (or holds another version than a pinned one) pays
  `adapter_miss_penalty`. Ties are broken by the draw, so equal replicas share the traffic.
* Every eligible replica appears exactly once; after the first choice the rest follow by that
  least-loaded score, so a retry goes to the next-best replica.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import itemgetter
from typing import Literal


@dataclass(frozen=True)
class ReplicaSnapshot:
    """What the gateway knows of one replica at decision time."""

    replica_id: str
    age_s: float
    interval_s: float = 1.0
    queue_len: int = 0
    running: int = 0
    max_batch: int = 0
    # Requests this gateway sent there and has not seen finish (telemetry lags up to one interval).
    local_in_flight: int = 0
    # Resident adapters: name -> version number.
    adapters: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightsSnapshot:
    """The coordinator's latest routing weights and how old they are."""

    age_s: float
    ttl_s: float
    weights: Mapping[str, float]
    adapter_weights: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class RoutingConfig:
    telemetry_stale_s: float = 3.0
    telemetry_stale_intervals: float = 3.0
    weights_hold_frac: float = 0.5
    adapter_miss_penalty: float = 0.5


@dataclass(frozen=True)
class Choice:
    replica_id: str
    # How this replica got its rank: drawn by weights, or ordered by the least-loaded score.
    source: Literal["weights", "least_loaded"]
    score: float
    probability: float | None = None


@dataclass(frozen=True)
class RoutingDecision:
    ranked: tuple[Choice, ...]
    # 1.0: coordinator weights in full, 0.0: not used (none, expired, or no weight on any eligible replica).
    weights_factor: float
    stale: tuple[str, ...] = ()

    @property
    def replica_ids(self) -> list[str]:
        return [c.replica_id for c in self.ranked]


def stale_after_s(interval_s: float, cfg: RoutingConfig) -> float:
    """The age past which telemetry sent every `interval_s` is stale."""
    return max(cfg.telemetry_stale_s, cfg.telemetry_stale_intervals * max(interval_s, 0.0))


def is_stale(r: ReplicaSnapshot, cfg: RoutingConfig) -> bool:
    return not (r.age_s <= stale_after_s(r.interval_s, cfg))  # NaN ages are stale too


def weights_factor(w: WeightsSnapshot | None, cfg: RoutingConfig) -> float:
    """How much the coordinator's weights count, from 1 (fresh) to 0 (expired or absent)."""
    if w is None or not w.ttl_s > 0 or math.isnan(w.age_s):
        return 0.0
    age_s = max(w.age_s, 0.0)
    if age_s >= w.ttl_s:
        return 0.0
    hold_s = cfg.weights_hold_frac * w.ttl_s
    if age_s <= hold_s:
        return 1.0
    return (w.ttl_s - age_s) / (w.ttl_s - hold_s)


def is_resident(r: ReplicaSnapshot, adapter: str | None, version: int | None) -> bool:
    if adapter is None:
        return True
    have = r.adapters.get(adapter)
    return have is not None and (version is None or have == version)


def load_score(r: ReplicaSnapshot, adapter: str | None, version: int | None, cfg: RoutingConfig) -> float:
    """Least-loaded score: busy slots over capacity, plus the penalty for a missing adapter."""
    busy = max(r.queue_len + r.running, r.local_in_flight, 0)
    score = busy / max(r.max_batch, 1)
    if not is_resident(r, adapter, version):
        score += cfg.adapter_miss_penalty
    return score


def _clamp_draw(draw: float) -> float:
    if math.isnan(draw) or draw < 0.0:
        return 0.0
    return min(draw, math.nextafter(1.0, 0.0))


def rank_replicas(
    replicas: Sequence[ReplicaSnapshot],
    weights: WeightsSnapshot | None,
    adapter: str | None,
    draw: float,
    cfg: RoutingConfig,
    adapter_version: int | None = None,
    limit: int | None = None,
) -> RoutingDecision:
    """Rank the replicas to try for one request (see the module docstring for the rules). `limit`: rank
    only the first `limit` (what the caller will try at most; the ranking's head is the same)."""
    draw = _clamp_draw(draw)
    stale_ids: list[str] = []
    # (least-loaded score, id, snapshot) of every eligible replica: sorted, the least-loaded order.
    keyed: list[tuple[float, str, ReplicaSnapshot]] = []
    limits: dict[float, float] = {}  # stale_after_s by interval (replicas mostly share one)
    penalty = cfg.adapter_miss_penalty
    for r in replicas:
        limit_s = limits.get(r.interval_s)
        if limit_s is None:
            limit_s = limits[r.interval_s] = stale_after_s(r.interval_s, cfg)
        if not (r.age_s <= limit_s):  # stale (`is_stale`)
            stale_ids.append(r.replica_id)
            continue
        # `load_score`, written out: this loop runs for every replica on every request.
        busy = r.queue_len + r.running
        if r.local_in_flight > busy:
            busy = r.local_in_flight
        if busy < 0:
            busy = 0
        capacity = r.max_batch
        score = busy / (capacity if capacity >= 1 else 1)
        if adapter is not None:  # `is_resident`
            have = r.adapters.get(adapter)
            if have is None or (adapter_version is not None and have != adapter_version):
                score += penalty
        keyed.append((score, r.replica_id, r))
    stale = tuple(sorted(stale_ids))
    if not keyed:
        return RoutingDecision((), 0.0, stale)
    n = len(keyed) if limit is None else max(1, min(limit, len(keyed)))
    # Only the head of the least-loaded order when the caller tries no more than `n`.
    head = sorted(keyed) if n >= len(keyed) else heapq.nsmallest(n, keyed)

    factor = weights_factor(weights, cfg)
    by_id = sorted(keyed, key=itemgetter(1)) if factor > 0 else []
    ids = [rid for _, rid, _ in by_id]
    shares = _blend(ids, weights, adapter, factor) if factor > 0 else None
    if shares is None:
        # Least loaded first; the draw picks among the replicas tied for the lowest score.
        best = head[0][0]
        isclose = math.isclose
        tied = [k for k in keyed if k[0] == best or isclose(k[0], best, rel_tol=1e-9, abs_tol=1e-12)]
        # In (score, id) order, as `sorted(tied)` (ids are unique): by id, then stably by score.
        tied.sort(key=itemgetter(1))
        tied.sort(key=itemgetter(0))
        score, rid, _ = tied[int(draw * len(tied))]
        order = [(score, rid)] + [(sc, i) for sc, i, _ in head if i != rid][: n - 1]
        ranked = tuple(Choice(i, "least_loaded", sc) for sc, i in order)
        return RoutingDecision(ranked, 0.0, stale)

    first_score, fid, _ = by_id[_weighted_pick(shares, draw)]
    probs = dict(zip(ids, shares, strict=True))
    rest = [(sc, i) for sc, i, _ in head if i != fid][: n - 1]
    ranked = (
        Choice(fid, "weights", first_score, probs[fid]),
        *(Choice(i, "least_loaded", sc, probs[i]) for sc, i in rest),
    )
    return RoutingDecision(ranked, factor, stale)


def _blend(
    ids: Sequence[str], w: WeightsSnapshot | None, adapter: str | None, factor: float
) -> list[float] | None:
    """Per-replica probabilities, in the order of `ids`: factor * coordinator share + (1 - factor) *
    even share.

    None when the coordinator gave no positive weight to any eligible replica (its table is about
    replicas we cannot use), so the caller falls back to least-loaded.
    """
    assert w is not None
    table = w.adapter_weights.get(adapter) if adapter is not None else None
    if table is None:
        table = w.weights
    inf = math.inf
    # `_finite_positive` of each weight, with the common case (a float) first.
    raw = [
        (x if 0.0 < x < inf else 0.0) if type(x) is float else _finite_positive(x)
        for x in map(table.get, ids, repeat(0.0))
    ]
    total = sum(raw)
    if total <= 0.0:
        return None
    even_part = (1.0 - factor) * (1.0 / len(ids))
    return [factor * (v / total) + even_part for v in raw]


def _finite_positive(x: float) -> float:
    return x if isinstance(x, int | float) and math.isfinite(x) and x > 0 else 0.0


def _weighted_pick(probs: Sequence[float], draw: float) -> int:
    """The index the draw picks by `probs` (>= 0; one with no share never): the first whose running
    sum, in order, passes `draw` times the total."""
    target = draw * sum(probs)
    k = bisect_right(list(accumulate(probs)), target)  # the running sums only grow at positive shares
    if k < len(probs):
        return k
    # rounding at the top end: the last replica with a positive share
    return next(k for k in range(len(probs) - 1, -1, -1) if probs[k] > 0.0)
