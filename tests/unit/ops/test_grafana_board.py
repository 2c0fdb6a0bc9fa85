"""The Grafana board (deploy/grafana/collm.json): it is what `collm_ops.grafana` builds, and every query
names metrics that the services expose (that each returns data is `make compose-check`'s part)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from collm_ops import grafana

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
BOARD = ROOT / "deploy" / "grafana" / "collm.json"
# PromQL words that are not metric names.
PROMQL = {"sum", "max", "min", "avg", "by", "rate", "increase", "histogram_quantile", "le", "without"}
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names of a PromQL expression (its words less functions, keywords, label names in
    `by (...)` and numbers), with the exposition suffixes a counter or histogram adds removed."""
    expr = re.sub(r"by \([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    out = set()
    for word in _NAME.findall(expr):
        if word in PROMQL:
            continue
        out.add(re.sub(r"_(total|bucket|sum|count)$", "", word))
    return out


def declared_sources() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "services").rglob("*.py"))


def test_the_committed_board_is_the_one_built() -> None:
    assert grafana.main(["--check", str(BOARD)]) == 0
    board = json.loads(BOARD.read_text(encoding="utf-8"))
    assert board["uid"] == grafana.UID
    assert len(grafana.board_queries(board)) == sum(len(p.queries) for p in grafana.PANELS)


def test_every_query_names_metrics_the_services_declare() -> None:
    source = declared_sources()
    board = json.loads(BOARD.read_text(encoding="utf-8"))
    names = set()
    for title, expr in grafana.board_queries(board):
        found = metric_names(expr)
        assert found, (title, expr)
        names |= found
    # A counter is declared with or without its `_total`.
    missing = sorted(n for n in names if f'"{n}"' not in source and f'"{n}_total"' not in source)
    assert not missing, missing
    # The serving row reads vLLM's names, so a board made for vLLM reads the replicas too.
    vllm = {"vllm:num_requests_running", "vllm:time_to_first_token_seconds", "vllm:kv_cache_usage_perc"}
    assert vllm <= names


def test_every_panel_reads_the_provisioned_data_source() -> None:
    provisioned = yaml.safe_load(
        (ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    (ds,) = provisioned["datasources"]
    board = json.loads(BOARD.read_text(encoding="utf-8"))
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert panels
    for p in panels:
        assert p["datasource"] == {"type": ds["type"], "uid": ds["uid"]}, p["title"]
        assert all(t["datasource"]["uid"] == ds["uid"] for t in p["targets"]), p["title"]


def test_metric_names_of_a_query() -> None:
    latency = "rate(vllm:e2e_request_latency_seconds_bucket[1m])"
    q = f"histogram_quantile(0.99, sum by (le, model_name) ({latency}))"
    assert metric_names(q) == {"vllm:e2e_request_latency_seconds"}
    assert metric_names("sum by (state) (increase(collm_aggregator_rounds_total[1h]))") == {
        "collm_aggregator_rounds"
    }
