"""The routing policy: staleness, coordinator weights (fresh, decaying, expired), least-loaded fallback."""

import math
import random

import pytest

from collm_gateway.routing import (
    ReplicaSnapshot,
    RoutingConfig,
    WeightsSnapshot,
    load_score,
    rank_replicas,
    weights_factor,
)

pytestmark = pytest.mark.unit

CFG = RoutingConfig(
    telemetry_stale_s=3.0, telemetry_stale_intervals=3.0, weights_hold_frac=0.5, adapter_miss_penalty=0.5
)


def rep(rid: str, age_s: float = 0.1, **kw) -> ReplicaSnapshot:
    kw.setdefault("max_batch", 8)
    return ReplicaSnapshot(replica_id=rid, age_s=age_s, **kw)


def first_choices(replicas, weights, adapter=None, n=1000, version=None):
    counts: dict[str, int] = {}
    for i in range(n):
        d = rank_replicas(replicas, weights, adapter, (i + 0.5) / n, CFG, version)
        counts[d.ranked[0].replica_id] = counts.get(d.ranked[0].replica_id, 0) + 1
    return counts


def test_no_replicas_gives_empty_ranking() -> None:
    d = rank_replicas([], None, None, 0.3, CFG)
    assert d.ranked == () and d.weights_factor == 0.0


def test_stale_replicas_are_excluded_and_reported() -> None:
    d = rank_replicas([rep("a", age_s=3.5), rep("b", age_s=0.5)], None, None, 0.0, CFG)
    assert d.replica_ids == ["b"]
    assert d.stale == ("a",)


def test_staleness_scales_with_a_replicas_own_interval() -> None:
    # interval 2 s: stale only after 3 intervals = 6 s, which is longer than telemetry_stale_s
    slow = rep("slow", age_s=5.0, interval_s=2.0)
    assert rank_replicas([slow], None, None, 0.0, CFG).replica_ids == ["slow"]
    assert rank_replicas([rep("slow", age_s=6.5, interval_s=2.0)], None, None, 0.0, CFG).replica_ids == []


def test_nan_age_is_stale() -> None:
    assert rank_replicas([rep("a", age_s=math.nan)], None, None, 0.0, CFG).replica_ids == []


def test_least_loaded_first_then_by_load() -> None:
    rs = [rep("a", queue_len=4, running=4), rep("b", running=2), rep("c", queue_len=1, running=4)]
    d = rank_replicas(rs, None, None, 0.99, CFG)
    assert d.replica_ids == ["b", "c", "a"]
    assert all(c.source == "least_loaded" for c in d.ranked)


def test_load_is_relative_to_capacity() -> None:
    big = rep("big", running=8, max_batch=32)  # 0.25
    small = rep("small", running=4, max_batch=8)  # 0.5
    assert rank_replicas([small, big], None, None, 0.0, CFG).replica_ids == ["big", "small"]


def test_local_in_flight_counts_when_telemetry_lags() -> None:
    a = rep("a", running=0, local_in_flight=6)
    b = rep("b", running=2)
    assert rank_replicas([a, b], None, None, 0.0, CFG).replica_ids == ["b", "a"]


def test_ties_are_shared_by_the_draw() -> None:
    counts = first_choices([rep("a"), rep("b"), rep("c")], None, n=300)
    assert counts == {"a": 100, "b": 100, "c": 100}


def test_resident_adapter_is_preferred_but_not_at_any_load() -> None:
    cold = rep("cold", running=1)
    warm = rep("warm", running=2, adapters={"medical": 3})
    # 2/8 = 0.25 beats 1/8 + 0.5 penalty
    assert rank_replicas([cold, warm], None, "medical", 0.0, CFG).replica_ids == ["warm", "cold"]
    busy_warm = rep("warm", running=8, adapters={"medical": 3})  # 1.0 > 0.125 + 0.5
    assert rank_replicas([cold, busy_warm], None, "medical", 0.0, CFG).replica_ids == ["cold", "warm"]


def test_pinned_version_must_match_to_count_as_resident() -> None:
    r = rep("a", adapters={"medical": 3})
    assert load_score(r, "medical", 3, CFG) == 0.0
    assert load_score(r, "medical", 2, CFG) == 0.5
    assert load_score(r, "other", None, CFG) == 0.5
    assert load_score(r, None, None, CFG) == 0.0


def test_fresh_weights_decide_the_first_choice_proportionally() -> None:
    w = WeightsSnapshot(age_s=0.0, ttl_s=10.0, weights={"a": 3.0, "b": 1.0})
    counts = first_choices([rep("a", running=8), rep("b")], w)
    assert counts == {"a": 750, "b": 250}
    d = rank_replicas([rep("a", running=8), rep("b")], w, None, 0.1, CFG)
    assert d.weights_factor == 1.0
    assert d.ranked[0].source == "weights" and d.ranked[0].probability == pytest.approx(0.75)


def test_weights_decay_towards_even_then_are_ignored() -> None:
    rs = [rep("a"), rep("b", running=4)]
    base = {"a": 0.0, "b": 1.0}
    # held in full until half the ttl
    assert first_choices(rs, WeightsSnapshot(age_s=5.0, ttl_s=10.0, weights=base)) == {"b": 1000}
    # three quarters of the ttl: half coordinator, half even -> b 0.75, a 0.25
    assert weights_factor(WeightsSnapshot(7.5, 10.0, base), CFG) == pytest.approx(0.5)
    counts = first_choices(rs, WeightsSnapshot(age_s=7.5, ttl_s=10.0, weights=base))
    assert counts == {"a": 250, "b": 750}
    # expired: ignored, least-loaded says a
    d = rank_replicas(rs, WeightsSnapshot(age_s=10.0, ttl_s=10.0, weights=base), None, 0.9, CFG)
    assert d.weights_factor == 0.0 and d.replica_ids == ["a", "b"]
    assert d.ranked[0].source == "least_loaded"


def test_per_adapter_weights_override_replica_weights() -> None:
    w = WeightsSnapshot(
        age_s=0.0, ttl_s=10.0, weights={"a": 1.0, "b": 0.0}, adapter_weights={"medical": {"a": 0.0, "b": 1.0}}
    )
    rs = [rep("a"), rep("b")]
    assert first_choices(rs, w, adapter="medical") == {"b": 1000}
    assert first_choices(rs, w, adapter="finance") == {"a": 1000}
    assert first_choices(rs, w, adapter=None) == {"a": 1000}


def test_weights_only_for_stale_or_unknown_replicas_fall_back_to_least_loaded() -> None:
    w = WeightsSnapshot(age_s=0.0, ttl_s=10.0, weights={"gone": 1.0})
    d = rank_replicas([rep("a", running=3), rep("b")], w, None, 0.0, CFG)
    assert d.weights_factor == 0.0
    assert d.replica_ids == ["b", "a"]


def test_bad_weight_values_are_ignored() -> None:
    w = WeightsSnapshot(age_s=0.0, ttl_s=10.0, weights={"a": math.nan, "b": -5.0, "c": math.inf, "d": 2.0})
    assert first_choices([rep(x) for x in "abcd"], w, n=100) == {"d": 100}


def test_every_eligible_replica_is_ranked_once_retries_follow_load() -> None:
    w = WeightsSnapshot(age_s=0.0, ttl_s=10.0, weights={"c": 1.0})
    rs = [rep("a", running=6), rep("b", running=1), rep("c", running=7), rep("d", age_s=100.0)]
    d = rank_replicas(rs, w, None, 0.42, CFG)
    assert d.replica_ids == ["c", "b", "a"]
    assert [c.source for c in d.ranked] == ["weights", "least_loaded", "least_loaded"]


@pytest.mark.parametrize("draw", [-1.0, 0.0, 0.999999999, 1.0, 7.0, math.nan])
def test_any_draw_gives_a_valid_ranking(draw: float) -> None:
    w = WeightsSnapshot(age_s=0.0, ttl_s=10.0, weights={"a": 1.0, "b": 1.0})
    for weights in (w, None):
        d = rank_replicas([rep("a"), rep("b")], weights, None, draw, CFG)
        assert sorted(d.replica_ids) == ["a", "b"]


def test_weights_factor_edges() -> None:
    assert weights_factor(None, CFG) == 0.0
    assert weights_factor(WeightsSnapshot(0.0, 0.0, {}), CFG) == 0.0
    assert weights_factor(WeightsSnapshot(-1.0, 4.0, {}), CFG) == 1.0  # clock jitter: treat as fresh
    hold_all = RoutingConfig(weights_hold_frac=1.0)
    assert weights_factor(WeightsSnapshot(3.99, 4.0, {}), hold_all) == 1.0
    assert weights_factor(WeightsSnapshot(4.0, 4.0, {}), hold_all) == 0.0


@pytest.mark.parametrize("seed", range(20))
def test_a_limited_ranking_is_the_head_of_the_full_one(seed: int) -> None:
    # Many replicas with tied and untied loads, some stale, with and without weights: ranking only the
    # first `limit` gives exactly the first `limit` choices of the full ranking.
    rng = random.Random(seed)
    rs = [
        rep(f"r{i:02d}", age_s=rng.choice([0.1, 0.1, 0.1, 50.0]), running=rng.randint(0, 3),
            queue_len=rng.choice([0, 0, 2]), local_in_flight=rng.randint(0, 4),
            adapters=rng.choice([{}, {"x": 1}]))
        for i in range(40)
    ]  # fmt: skip
    w = WeightsSnapshot(
        age_s=rng.uniform(0, 12), ttl_s=10.0, weights={f"r{i:02d}": rng.random() for i in range(10)}
    )
    for weights in (w, None):
        for k in range(40):
            draw = rng.random()
            full = rank_replicas(rs, weights, "x", draw, CFG)
            for limit in (1, 2, 3, 7, 100):
                head = rank_replicas(rs, weights, "x", draw, CFG, limit=limit)
                assert head.ranked == full.ranked[:limit], (k, limit)
                assert (head.weights_factor, head.stale) == (full.weights_factor, full.stale)
