"""Every Prometheus metric is `collm_<service>_...` and says its unit in its name.

Units as Prometheus names them: `_seconds`, `_bytes`, `_ratio` (0..1), `_total` (counters), or the
thing counted (`_tokens`, `_requests`, `_replicas`, `_rounds`, `_versions`), `_nats` for a loss in nats
per token. Enum metrics (a state set: the label is the metric's own name) have no unit.
"""

from __future__ import annotations

import importlib

import pytest
from prometheus_client import REGISTRY

pytestmark = pytest.mark.unit

UNITS = ("_total", "_seconds", "_bytes", "_ratio", "_tokens", "_requests", "_replicas", "_rounds",
         "_versions", "_nats", "_info")  # fmt: skip

MODULES = {
    "gateway": "collm_gateway.metrics",
    "replica": "collm_replica.metrics",
    "coordinator": "collm_coordinator.metrics",
    "aggregator": "collm_aggregator.metrics",
    "wire": "collm_common.wire.base",
}


def families(prefix: str) -> dict[str, str]:
    """Metric family name (counters with their `_total`) -> type, for families starting with `prefix`."""
    return {
        fam.name + ("_total" if fam.type == "counter" else ""): fam.type
        for fam in REGISTRY.collect()
        if fam.name.startswith(prefix)
    }


def without_unit(service: str) -> list[str]:
    importlib.import_module(MODULES[service])
    return sorted(
        name
        for name, kind in families(f"collm_{service}_").items()
        if kind != "stateset" and not name.endswith(UNITS)
    )


@pytest.mark.parametrize("service", ["gateway", "replica", "coordinator", "aggregator", "wire"])
def test_metric_names_carry_units(service: str) -> None:
    assert without_unit(service) == []


def test_every_service_has_metrics_under_its_own_prefix() -> None:
    for service in MODULES:
        importlib.import_module(MODULES[service])
        assert families(f"collm_{service}_"), service


def test_gateway_latencies_are_by_model_and_version_with_bounded_series() -> None:
    from collm_gateway import metrics

    for hist in (metrics.TTFT, metrics.TPOT, metrics.E2E):
        assert hist._labelnames == ("model", "adapter_version")  # noqa: SLF001
    series = metrics.VersionSeries(versions_per_model=2)
    model = "unit-test-model"
    for v in (1, 2, 3):
        metrics.REQUESTS.labels(model, f"{model}@v{v}", "200").inc()
        metrics.TTFT.labels(model, f"{model}@v{v}").observe(0.1)
        evicted = series.touch(model, f"{model}@v{v}", "200")
    assert evicted == [f"{model}@v1"]
    assert series.touch(model, f"{model}@v2", "200") == []  # seen again: now the most recent
    names = {
        s.labels.get("adapter_version")
        for fam in REGISTRY.collect()
        if fam.name in ("collm_gateway_requests", "collm_gateway_ttft_seconds")
        for s in fam.samples
        if s.labels.get("model") == model
    }
    assert names == {f"{model}@v2", f"{model}@v3"}


def test_replica_requests_are_by_model_and_version_with_bounded_series() -> None:
    from collm_replica import metrics

    assert metrics.REQUESTS._labelnames == ("replica", "model", "adapter_version", "outcome")  # noqa: SLF001
    for hist in (metrics.TTFT, metrics.TPOT):
        assert hist._labelnames == ("replica", "model", "adapter_version")  # noqa: SLF001
    series = metrics.VersionSeries(versions_per_model=2)
    rid, model = "unit-test-replica", "unit-test-model"
    evicted: list[str] = []
    for version in (f"{model}@v1", f"{model}@v2", f"{model}@v2+r1.1"):
        metrics.REQUESTS.labels(rid, model, version, "stop").inc()
        metrics.TTFT.labels(rid, model, version).observe(0.1)
        evicted = series.touch(rid, model, version, "stop")
    assert evicted == [f"{model}@v1"]
    assert series.touch(rid, model, f"{model}@v2", "length") == []  # seen again: now the most recent
    assert series.touch("another-replica", model, f"{model}@v1", "stop") == []  # bounded per replica
    names = {
        s.labels.get("adapter_version")
        for fam in REGISTRY.collect()
        if fam.name in ("collm_replica_requests", "collm_replica_ttft_seconds")
        for s in fam.samples
        if s.labels.get("model") == model and s.labels.get("replica") == rid
    }
    assert names == {f"{model}@v2", f"{model}@v2+r1.1"}


def test_replica_training_limits_are_read_from_the_engine_at_scrape() -> None:
    from types import SimpleNamespace

    from collm_replica import metrics

    engine = SimpleNamespace(
        generated_tokens_total=3,
        prefill_tokens_total=5,
        ft_tokens_total=7,
        prefix_cache_queries_total=0,
        prefix_cache_hits_total=0,
        train_limits={"share": 2},
        infer_ms_total=1500.0,
        forward_ms_total=1200.0,
        train_ms_total=250.0,
        eval_ms_total=0.0,
    )
    metrics.ENGINE_TOKENS.attach("limits-test", lambda: engine)  # type: ignore[arg-type,return-value]
    try:
        engine.train_limits = {"share": 4, "slack": 1}  # read when scraped, not when attached
        engine.eval_ms_total = 500.0
        families = list(REGISTRY.collect())
        got = {
            (s.labels["limit"], s.value)
            for fam in families
            if fam.name == "collm_replica_ft_limit_iterations"
            for s in fam.samples
            if s.labels.get("replica") == "limits-test" and s.name.endswith("_total")
        }
        busy = {
            s.labels["work"]: s.value
            for fam in families
            if fam.name == "collm_replica_busy_seconds"
            for s in fam.samples
            if s.labels.get("replica") == "limits-test" and s.name.endswith("_total")
        }
        forward = [
            s.value
            for fam in families
            if fam.name == "collm_replica_inference_forward_seconds"
            for s in fam.samples
            if s.labels.get("replica") == "limits-test" and s.name.endswith("_total")
        ]
    finally:
        metrics.ENGINE_TOKENS.detach("limits-test")
    assert got == {("share", 4.0), ("slack", 1.0)} and forward == [1.2]
    assert busy == {"inference": 1.5, "training": 0.25, "evaluation": 0.5}
