"""CoLLM's Grafana board: `deploy/grafana/collm.json`, built with grafana-foundation-sdk.

    python -m collm_ops.grafana --write deploy/grafana/collm.json    # (re)build the board
    python -m collm_ops.grafana --check deploy/grafana/collm.json    # exit 1 when the file is not the build

The board reads one Prometheus data source (uid `prometheus`, `deploy/grafana/provisioning/`) that
scrapes every service (`deploy/prometheus/prometheus.yml`). Its serving row uses only the names, labels
(`model_name`) and buckets of vLLM's `/metrics`, which the replicas also expose, so a board made for vLLM
reads a CoLLM stack too; the other rows are CoLLM's own: the gateway's requests and SLO, fine-tuning on
the replicas, federated rounds and versions, and the coordinator's control (attainment against its
target, virtual queue, headroom, spend). `PANELS` declares every panel once; `board_queries` reads the
queries back from a board file (`make compose-check` runs each against the stack's Prometheus and
requires data).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UID = "collm"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    row: str
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""


def _q(expr: str, legend: str) -> Query:
    return Query(expr, legend)


def _quantiles(metric: str, by: str = "model_name") -> tuple[Query, ...]:
    return tuple(
        _q(
            f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket[1m])))",
            f"p{round(q * 100)} {{{{{by}}}}}",
        )
        for q in (0.5, 0.99)
    )


PANELS: tuple[PanelSpec, ...] = (
    # --- serving: vLLM's names -------------------------------------------------------------------------
    PanelSpec(
        "Serving (vLLM metrics)",
        "Requests running / waiting",
        "short",
        (
            _q("sum by (model_name) (vllm:num_requests_running)", "running {{model_name}}"),
            _q("sum by (model_name) (vllm:num_requests_waiting)", "waiting {{model_name}}"),
        ),
    ),
    PanelSpec(
        "Serving (vLLM metrics)", "Time to first token", "s", _quantiles("vllm:time_to_first_token_seconds")
    ),
    PanelSpec(
        "Serving (vLLM metrics)", "Inter-token latency", "s", _quantiles("vllm:inter_token_latency_seconds")
    ),
    PanelSpec(
        "Serving (vLLM metrics)", "End-to-end latency", "s", _quantiles("vllm:e2e_request_latency_seconds")
    ),
    PanelSpec(
        "Serving (vLLM metrics)",
        "Token throughput",
        "short",
        (
            _q("sum by (model_name) (rate(vllm:prompt_tokens_total[1m]))", "prompt tokens/s {{model_name}}"),
            _q(
                "sum by (model_name) (rate(vllm:generation_tokens_total[1m]))",
                "generated tokens/s {{model_name}}",
            ),
        ),
    ),
    PanelSpec(
        "Serving (vLLM metrics)",
        "KV cache usage",
        "percentunit",
        (_q("max by (instance) (vllm:kv_cache_usage_perc)", "{{instance}}"),),
    ),
    PanelSpec(
        "Serving (vLLM metrics)",
        "Finished requests by reason",
        "reqps",
        (_q("sum by (finished_reason) (rate(vllm:request_success_total[5m]))", "{{finished_reason}}"),),
    ),
    # --- the gateway -----------------------------------------------------------------------------------
    PanelSpec(
        "Gateway",
        "Requests by status",
        "reqps",
        (_q("sum by (status) (rate(collm_gateway_requests_total[5m]))", "{{status}}"),),
    ),
    PanelSpec(
        "Gateway",
        "Requests in flight",
        "short",
        (_q("sum(collm_gateway_in_flight_requests)", "in flight"),),
    ),
    # --- fine-tuning -----------------------------------------------------------------------------------
    PanelSpec(
        "Fine-tuning",
        "Fine-tuning share in force",
        "percentunit",
        (_q("max by (replica) (collm_replica_ft_share_ratio)", "{{replica}}"),),
        "The share of each replica's time fine-tuning may take (the coordinator's, or the local default).",
    ),
    PanelSpec(
        "Fine-tuning",
        "Fine-tuning tokens",
        "short",
        (_q("sum by (replica) (rate(collm_replica_ft_tokens_total[5m]))", "tokens/s {{replica}}"),),
    ),
    PanelSpec(
        "Fine-tuning",
        "Rounds by result",
        "short",
        (_q("sum by (state) (increase(collm_aggregator_rounds_total[1h]))", "{{state}}"),),
        "Federated rounds ended in the last hour, by how they ended.",
    ),
    PanelSpec(
        "Fine-tuning",
        "Versions published",
        "short",
        (_q("sum(increase(collm_aggregator_publications_total[1h]))", "last hour"),),
    ),
    # --- the coordinator's control ---------------------------------------------------------------------
    PanelSpec(
        "Control",
        "SLO attainment",
        "percentunit",
        (_q("collm_coordinator_attainment_ratio", "attainment"),),
        "The cluster's windowed SLO attainment, as the coordinator measures it against its target.",
    ),
    PanelSpec(
        "Control",
        "Virtual queue, headroom, spend",
        "short",
        (
            _q("collm_coordinator_virtual_queue_ratio", "virtual queue Z"),
            _q("collm_coordinator_headroom_ratio", "headroom h"),
            _q("collm_coordinator_spend_ratio", "spend"),
        ),
        "Z prices SLO risk while attainment falls short of the target; above it the headroom grows and the "
        "spend lets replicas train beyond their requests' slack.",
    ),
)


def build(panels: Sequence[PanelSpec] = PANELS) -> dict[str, Any]:
    """The board as Grafana's dashboard JSON: a row per `PanelSpec.row`, two panels across."""
    from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    ds = DataSourceRef(type_val=DATASOURCE["type"], uid=DATASOURCE["uid"])
    board = (
        dashboard.Dashboard("CoLLM")
        .uid(UID)
        .tags(["collm", "vllm"])
        .refresh("30s")
        .time("now-1h", "now")
        .description(
            "Serving (vLLM's metric names), fine-tuning, federated rounds and the coordinator's control."
        )
    )
    row = None
    for p in panels:
        if p.row != row:
            board = board.with_row(dashboard.Row(p.row))
            row = p.row
        panel = timeseries.Panel().title(p.title).unit(p.unit).datasource(ds).height(8).span(12)
        if p.description:
            panel = panel.description(p.description)
        for i, q in enumerate(p.queries):
            panel = panel.with_target(
                prometheus.Dataquery()
                .expr(q.expr)
                .legend_format(q.legend)
                .ref_id(chr(ord("A") + i))
                .datasource(ds)
            )
        board = board.with_panel(panel)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render(panels: Sequence[PanelSpec] = PANELS) -> str:
    return json.dumps(build(panels), indent=1, sort_keys=True) + "\n"


def board_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel of a board file, in order."""
    out = []
    for panel in board.get("panels", []):
        for target in panel.get("targets", []):
            out.append((panel.get("title", ""), target["expr"]))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m collm_ops.grafana", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path, metavar="FILE", help="write the board to FILE")
    mode.add_argument(
        "--check", type=Path, metavar="FILE", help="exit 1 when FILE is not the board built now"
    )
    args = ap.parse_args(argv)
    text = render()
    if args.write is not None:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text, encoding="utf-8")
        sys.stdout.write(f"{args.write}: {len(board_queries(json.loads(text)))} queries\n")
        return 0
    if args.check.read_text(encoding="utf-8") != text:
        fix = f"python -m collm_ops.grafana --write {args.check}"
        sys.stderr.write(f"{args.check} differs from the board built now: {fix}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
