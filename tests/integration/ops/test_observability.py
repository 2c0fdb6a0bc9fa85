"""Metrics, traces exported over OTLP/HTTP, and JSON logs, from the running stack's processes."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from openai import OpenAI

from collm_common import subjects
from collm_common.wire.rounds import RoundOutcome

from .conftest import ADAPTER, OpsStack, wait_until
from .otlp_receiver import ReceivedSpan

pytestmark = pytest.mark.integration

SPAN_SERVER, SPAN_CLIENT = 2, 3  # OTLP's SpanKind values


def chat(ops: OpsStack, model: str, n: int = 1) -> list[dict[str, str]]:
    """`n` streamed chat completions of 5 tokens each (`ignore_eos`: the tiny model with a trained adapter
    may well choose its end-of-sequence token first); the response headers of each (replica, version,
    trace id)."""
    client = OpenAI(base_url=f"{ops.stack.gateway_url}/v1", api_key="k", max_retries=0)
    out = []
    for i in range(n):
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": f"hello {i}"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for _chunk in raw.parse():
            pass
        out.append({k.lower(): v for k, v in raw.headers.items()})
    return out


@pytest.fixture(scope="module")
def traffic(ops: OpsStack, ops_round: RoundOutcome) -> list[dict[str, str]]:
    return chat(ops, "tiny", 3) + chat(ops, ADAPTER, 2)


# --- metrics ----------------------------------------------------------------------------------------------
# What Prometheus asks for: OpenMetrics first (a service answers in the text format, names as declared).
PROMETHEUS_ACCEPT = "application/openmetrics-text;version=1.0.0;escaping=underscores;q=0.5,text/plain;q=0.4"


def scrape(url: str) -> str:
    r = httpx.get(url, timeout=5, headers={"Accept": PROMETHEUS_ACCEPT})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def total(text: str, name: str, **labels: str) -> float:
    """The sum of every sample of `name` whose labels include `labels` (across the other labels)."""
    out = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            out += float(m.group(4))
    return out


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample of `name` whose labels include `labels`."""
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(4))
    return None


def test_every_service_serves_its_metrics_after_traffic(ops: OpsStack, traffic: list[dict[str, str]]) -> None:
    urls = ops.stack.metrics_urls()
    assert set(urls) == {"gateway", "coordinator", "aggregator", "replica-r0", "replica-r1"}
    version = traffic[-1]["x-collm-adapter-version"]
    assert version.startswith(f"{ADAPTER}@v")

    gw = scrape(urls["gateway"])
    assert sample(gw, "collm_gateway_requests_total", model="tiny", adapter_version="base", status="200") == 3
    assert sample(gw, "collm_gateway_requests_total", model=ADAPTER, adapter_version=version, status="200")
    for hist in ("collm_gateway_ttft_seconds", "collm_gateway_e2e_seconds"):
        assert sample(gw, f"{hist}_count", model="tiny", adapter_version="base") == 3, hist
        assert sample(gw, f"{hist}_count", model=ADAPTER, adapter_version=version), hist
    assert sample(gw, "collm_gateway_tpot_seconds_count", model="tiny", adapter_version="base")
    assert (sample(gw, "collm_gateway_completion_tokens_total", model="tiny") or 0) >= 3
    assert sample(gw, "collm_gateway_in_flight_requests") == 0

    served_by = {h["x-collm-replica"] for h in traffic}
    # The replicas whose update the round accepted trained in it (an update may also come late).
    trained = set(ops_round_outcome(ops).accepted)
    assert trained, "the round accepted an update"
    total_requests = 0.0
    for rid in ("r0", "r1"):
        rep = scrape(urls[f"replica-{rid}"])
        for name in ("collm_replica_queue_requests", "collm_replica_running_requests",
                     "collm_replica_ft_share_ratio", "collm_replica_kv_used_ratio",
                     "collm_replica_resident_adapter_versions"):  # fmt: skip
            assert sample(rep, name, replica=rid) is not None, (rid, name)
        if rid in trained:
            assert (sample(rep, "collm_replica_ft_tokens_total", replica=rid) or 0) > 0, (
                "it trained in the round"
            )
        for outcome in ("length", "stop"):
            total_requests += total(rep, "collm_replica_requests_total", replica=rid, outcome=outcome)
        if rid in served_by:
            assert (sample(rep, "collm_replica_generated_tokens_total", replica=rid) or 0) > 0
            assert sample(rep, "collm_replica_ttft_seconds_count", replica=rid)
    assert total_requests >= 5

    coord = scrape(urls["coordinator"])
    assert sample(coord, "collm_coordinator_ticks_total", loop="fast")
    assert sample(coord, "collm_coordinator_ticks_total", loop="slow")
    assert any(
        sample(coord, "collm_coordinator_decisions_total", reason=r) for r in ("idle", "planned", "slack")
    ), "decisions by reason"
    assert sample(coord, "collm_coordinator_share_reason", replica="r0") is not None
    assert sample(coord, "collm_coordinator_rounds_total", result="opened")

    agg = scrape(urls["aggregator"])
    assert (
        sample(agg, "collm_aggregator_rounds_total", adapter=ADAPTER, state=ops_round_state(ops)) is not None
    )
    assert sample(agg, "collm_aggregator_updates_total", verdict="accepted")
    assert sample(agg, "collm_aggregator_phase_seconds_count", phase="collecting")
    for text in (gw, coord, agg):
        assert "collm_wire_rejected_messages_total" in text or "collm_wire" not in text


def ops_round_outcome(ops: OpsStack) -> RoundOutcome:
    assert ops.round_outcome is not None
    return ops.round_outcome


def ops_round_state(ops: OpsStack) -> str:
    return ops_round_outcome(ops).state


def test_replica_requests_and_latencies_are_by_model_and_version(
    ops: OpsStack, traffic: list[dict[str, str]]
) -> None:
    rid = traffic[-1]["x-collm-replica"]
    rep = scrape(ops.stack.metrics_urls()[f"replica-{rid}"])
    version = traffic[-1]["x-collm-adapter-version"]
    assert sample(rep, "collm_replica_requests_total", replica=rid, adapter_version=version) is not None
    assert sample(rep, "collm_replica_ttft_seconds_count", replica=rid, adapter_version=version) is not None
    assert sample(
        rep, "collm_replica_tpot_seconds_count", replica=rid, model=ADAPTER, adapter_version=version
    )
    # Every request of the traffic, on either replica, is counted under its model and exact version.
    urls = ops.stack.metrics_urls()
    by_version: dict[tuple[str, str], int] = {}
    for h in traffic:
        key = (ADAPTER if h["x-collm-adapter-version"] != "base" else "tiny", h["x-collm-adapter-version"])
        by_version[key] = by_version.get(key, 0) + 1
    for (model, v), n in by_version.items():
        counted = sum(
            total(
                scrape(urls[f"replica-{r}"]), "collm_replica_requests_total", model=model, adapter_version=v
            )
            for r in ("r0", "r1")
        )
        assert counted >= n, (model, v, counted)


# --- traces over OTLP/HTTP ---------------------------------------------------------------------------------
def trace_of(ops: OpsStack, trace_id: str, want: set[str], timeout_s: float = 20) -> list[ReceivedSpan]:
    def spans() -> list[ReceivedSpan] | None:
        got = [s for s in ops.receiver.snapshot() if s.trace_id == trace_id]
        return got if want <= {s.name for s in got} else None

    return wait_until(spans, timeout_s, f"spans {want} of trace {trace_id}")  # type: ignore[no-any-return]


def test_a_request_is_exported_as_one_trace_across_gateway_and_replica(
    ops: OpsStack, traffic: list[dict[str, str]]
) -> None:
    headers = traffic[-1]
    trace_id, rid = headers["x-collm-trace-id"], headers["x-collm-replica"]
    spans = trace_of(ops, trace_id, {"POST /v1/chat/completions", f"generate {rid}", "generate"})
    index = {s.span_id: s for s in spans}
    gen = next(s for s in spans if s.name == "generate")
    assert gen.service == "collm-replica" and gen.instance == rid and gen.kind == SPAN_SERVER
    client = index[gen.parent_span_id]  # type: ignore[index]
    assert (
        client.name == f"generate {rid}" and client.service == "collm-gateway" and client.kind == SPAN_CLIENT
    )
    http = index[client.parent_span_id]  # type: ignore[index]
    assert http.name == "POST /v1/chat/completions" and http.parent_span_id is None
    assert [e for e, _ in gen.events] == ["queued", "prefill_start", "first_token", "finished"]
    assert gen.attributes["collm.adapter.version"] == headers["x-collm-adapter-version"]
    assert http.attributes["gen_ai.response.model"] == headers["x-collm-adapter-version"]
    assert (
        http.attributes["gen_ai.request.model"] == ADAPTER
        and http.attributes["gen_ai.usage.output_tokens"] >= 1
    )
    assert ops.receiver.content_types == {"application/x-protobuf"}


def test_a_round_is_exported_with_its_phases_and_the_coordinators_plan(
    ops: OpsStack, ops_round: RoundOutcome
) -> None:
    assert ops_round.trace_id, "the round outcome names its trace"
    spans = trace_of(ops, ops_round.trace_id, {"round", "round.collect"}, timeout_s=30)
    root = next(s for s in spans if s.name == "round")
    assert root.service == "collm-aggregator" and root.attributes["collm.round_id"] == ops_round.round_id
    names = {s.name for s in spans}
    assert {"round.collect", "round.aggregate", "round.evaluate"} <= names or ops_round.state == "aborted"
    assert any(s.service == "collm-replica" and s.name == "control process" for s in spans), (
        "the replicas' StartTraining handling is in the round's trace"
    )
    # The round links to the plan request that opened it, a trace that starts in the coordinator.
    (link_trace, link_span), *_ = root.links
    plan = trace_of(ops, link_trace, {"open_round process"})
    served = next(s for s in plan if s.span_id == link_span)
    assert served.service == "collm-aggregator" and served.kind == SPAN_SERVER
    request = next(s for s in plan if s.span_id == served.parent_span_id)
    assert request.service == "collm-coordinator"
    assert request.name == f"{subjects.aggregator('open_round')} request" and request.kind == SPAN_CLIENT


# --- logs ---------------------------------------------------------------------------------------------------
def request_lines(ops: OpsStack, child: str, trace_id: str) -> list[dict[str, Any]]:
    return [d for d in ops.logs.json_lines(child) if d.get("trace_id") == trace_id]


def test_gateway_log_lines_are_json_with_the_requests_trace_id(
    ops: OpsStack, traffic: list[dict[str, str]]
) -> None:
    for headers in traffic:
        trace_id = headers["x-collm-trace-id"]
        lines = wait_until(
            lambda t=trace_id: request_lines(ops, "gateway", t), 10, "the gateway's request line"
        )
        line = next(d for d in lines if d.get("request_id") == headers["x-request-id"])
        assert line["service"] == "collm-gateway" and line["status"] == 200
        assert line["replica"] == headers["x-collm-replica"]
        assert line["adapter_version"] == headers["x-collm-adapter-version"]
        assert re.fullmatch(r"[0-9a-f]{32}", line["trace_id"])
        assert {"ts", "level", "logger", "msg", "ttft_ms", "tpot_ms", "good"} <= set(line)
    for child in ("gateway", "coordinator", "aggregator", "replica-r0", "replica-r1"):
        assert ops.logs.json_lines(child), f"{child} writes JSON lines"


def test_a_requests_log_lines_in_gateway_and_replica_carry_the_same_trace_id(
    ops: OpsStack, traffic: list[dict[str, str]]
) -> None:
    headers = traffic[0]
    trace_id = headers["x-collm-trace-id"]
    replica, request_id = f"replica-{headers['x-collm-replica']}", headers["x-request-id"]
    wait_until(lambda: request_lines(ops, "gateway", trace_id), 10, "the gateway's request line")
    # The replica's line of the finished request: its id, the exact version, tokens and latencies.

    def replica_line() -> dict[str, Any] | None:
        lines = request_lines(ops, replica, trace_id)
        return next((d for d in lines if d.get("request_id") == request_id), None)

    line = wait_until(replica_line, 10, "the replica's line of the finished request")
    assert (
        line["service"] == "collm-replica" and line["adapter_version"] == headers["x-collm-adapter-version"]
    )
    assert line["completion_tokens"] >= 1 and line["prompt_tokens"] > 0 and line["ttft_ms"] > 0
    assert {"tpot_ms", "queue_ms", "e2e_ms", "finish_reason", "model"} <= set(line)


def test_replicas_expose_vllms_serving_metrics(ops: OpsStack, traffic: list[dict[str, str]]) -> None:
    """vLLM's names, types and labels beside CoLLM's own: a board written for vLLM reads the replicas."""
    urls = ops.stack.metrics_urls()
    served = {h["x-collm-replica"] for h in traffic}
    for rid in ("r0", "r1"):
        text = scrape(urls[f"replica-{rid}"])
        engine = {"model_name": "tiny", "engine": rid}
        assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
        assert "# TYPE vllm:request_success_total counter" in text
        # Telemetry sets the engine's state on every tick, busy or not.
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            assert sample(text, gauge, **engine) is not None, gauge
        usage = sample(text, "vllm:kv_cache_usage_perc", **engine)
        assert usage is not None and 0.0 <= usage <= 1.0
        if rid not in served:
            continue
        # The same finished requests as CoLLM's own counters (both are recorded before the response ends).
        finished = sum(
            total(text, "collm_replica_requests_total", replica=rid, outcome=o) for o in ("length", "stop")
        )
        assert total(text, "vllm:request_success_total", **engine) == finished > 0
        assert total(text, "vllm:time_to_first_token_seconds_count", **engine) == total(
            text, "collm_replica_ttft_seconds_count", replica=rid
        )
        assert sample(text, "vllm:time_to_first_token_seconds_bucket", le="0.001", **engine) is not None
        assert total(text, "vllm:generation_tokens_total", **engine) > 0
        assert total(text, "vllm:e2e_request_latency_seconds_count", **engine) == finished
