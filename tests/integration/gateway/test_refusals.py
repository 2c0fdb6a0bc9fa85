"""Every response carries its request's trace id, and every refusal is counted in Prometheus.

A real NATS and Redis, the gateway app in-process with API keys, a rate-limited key and a small body
limit, and a replica double. `x-collm-trace-id` is on answers, streams and every error envelope (500
included), and it is the trace id of the request's server span and of the trace context the replica
receives. `collm_gateway_requests_refused_total{status,reason}` counts each refusal exactly once,
whatever refused it (API keys, rate limit, body limit, validation, unknown model or route).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from collm_common.logs import JsonFormatter
from collm_gateway.keys import hash_key

from .conftest import BASE_MODEL

pytestmark = pytest.mark.integration

KEY = "sk-test-acme"
SLOW = "sk-test-slow"  # one request per 100 s, burst 1
KEYS = {
    hash_key(KEY): {"tenant": "acme"},
    hash_key(SLOW): {"tenant": "slow", "rate_limit_rps": 0.01, "burst": 1},
}
TRACE_ID = re.compile(r"[0-9a-f]{32}")
CHAT = {"model": BASE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def refused(status: int, reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "collm_gateway_requests_refused_total", {"status": str(status), "reason": reason}
    )
    return value or 0.0


def auth(key: str | None = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture
async def gw(make_gateway, store, replicas) -> AsyncIterator[Any]:
    await store.set_meta("other-fin", {"tenant": "other"})
    await store.publish("other-fin", b"w", expected_current=None, base_model=BASE_MODEL, source="create")
    r0 = await replicas("r0", adapters={"other-fin": 1})
    async with make_gateway(api_keys=KEYS, max_body_bytes=2048) as g:
        await g.wait_replicas("r0")
        g.replica = r0
        yield g


async def chunked_body() -> AsyncIterator[bytes]:
    for _ in range(5):
        yield b" " * 1000


Send = Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]
JSON = {"content-type": "application/json"}

REFUSALS: list[tuple[str, Send, int, str]] = [
    ("no key", lambda h: h.post("/v1/chat/completions", json=CHAT), 401, "invalid_api_key"),
    ("wrong key", lambda h: h.post("/v1/models", headers=auth("sk-nope")), 401, "invalid_api_key"),
    (
        "declared body over the limit",
        lambda h: h.post("/v1/chat/completions", json={**CHAT, "user": "u" * 3000}, headers=auth()),
        413,
        "request_too_large",
    ),
    (
        "chunked body over the limit",
        lambda h: h.post("/v1/chat/completions", content=chunked_body(), headers={**auth(), **JSON}),
        413,
        "request_too_large",
    ),
    (
        "JSON that does not parse",
        lambda h: h.post("/v1/chat/completions", content=b"{nope", headers={**auth(), **JSON}),
        400,
        "invalid_json",
    ),
    (
        "a string for an integer",
        lambda h: h.post("/v1/chat/completions", json={**CHAT, "max_tokens": "16"}, headers=auth()),
        400,
        "invalid_value",
    ),
    (
        "a boolean for a number",
        lambda h: h.post(
            "/v1/completions", json={"model": BASE_MODEL, "prompt": "p", "temperature": True}, headers=auth()
        ),
        400,
        "invalid_value",
    ),
    (
        "a missing field",
        lambda h: h.post("/v1/chat/completions", json={"model": BASE_MODEL}, headers=auth()),
        400,
        "missing_field",
    ),
    (
        "an unsupported parameter",
        lambda h: h.post("/v1/chat/completions", json={**CHAT, "functions": [{"name": "f"}]}, headers=auth()),
        400,
        "unsupported_value",
    ),
    (
        "an unknown model",
        lambda h: h.post("/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=auth()),
        404,
        "model_not_found",
    ),
    (
        "another tenant's adapter",
        lambda h: h.post("/v1/chat/completions", json={**CHAT, "model": "other-fin"}, headers=auth()),
        404,
        "model_not_found",
    ),
    ("an unknown route", lambda h: h.get("/v1/nothing", headers=auth()), 404, "not_found"),
    ("a wrong method", lambda h: h.get("/v1/chat/completions", headers=auth()), 405, "method_not_allowed"),
]


@pytest.mark.parametrize(("what", "send", "status", "reason"), REFUSALS, ids=[r[0] for r in REFUSALS])
async def test_each_refusal_is_an_envelope_with_the_trace_id_counted_once_by_status_and_reason(
    gw, what: str, send: Send, status: int, reason: str
) -> None:
    before = refused(status, reason)
    resp = await send(gw.http)
    assert resp.status_code == status, (what, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == reason
    assert TRACE_ID.fullmatch(resp.headers["x-collm-trace-id"]), what
    assert refused(status, reason) == before + 1, what
    assert gw.replica.requests == []


async def test_a_rate_limited_request_is_counted_and_traced(gw) -> None:
    assert (await gw.http.get("/v1/models", headers=auth(SLOW))).status_code == 200
    before = refused(429, "rate_limit_exceeded")
    resp = await gw.http.get("/v1/models", headers=auth(SLOW))
    assert resp.status_code == 429 and resp.headers["retry-after"]
    assert TRACE_ID.fullmatch(resp.headers["x-collm-trace-id"])
    assert refused(429, "rate_limit_exceeded") == before + 1


async def test_refusals_are_on_the_metrics_endpoint(gw) -> None:
    await gw.http.post("/v1/chat/completions", json={**CHAT, "temperature": "hot"}, headers=auth())
    text = (await gw.http.get("/metrics")).text
    line = next(
        ln
        for ln in text.splitlines()
        if ln.startswith('collm_gateway_requests_refused_total{reason="invalid_value",status="400"}')
    )
    assert float(line.split()[-1]) >= 1


async def test_answers_and_streams_carry_the_trace_id_of_their_server_span(gw, span_exporter) -> None:
    plain = await gw.http.post("/v1/chat/completions", json=CHAT, headers=auth())
    streamed = await gw.http.post(
        "/v1/completions", json={"model": BASE_MODEL, "prompt": "p", "stream": True}, headers=auth()
    )
    assert plain.status_code == streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    for resp, name in ((plain, "POST /v1/chat/completions"), (streamed, "POST /v1/completions")):
        trace_id = resp.headers["x-collm-trace-id"]
        assert TRACE_ID.fullmatch(trace_id)
        servers = [
            s
            for s in span_exporter.get_finished_spans()
            if s.name == name and format(s.context.trace_id, "032x") == trace_id
        ]
        assert len(servers) == 1, name
    # the replica got the same trace in its trace context
    replica_traces = [h["traceparent"].split("-")[1] for h in gw.replica.headers]
    assert replica_traces == [plain.headers["x-collm-trace-id"], streamed.headers["x-collm-trace-id"]]


async def test_the_trace_id_of_a_request_that_came_with_one_is_that_trace(gw) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {**auth(), "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    ok = await gw.http.post("/v1/chat/completions", json=CHAT, headers=headers)
    bad = await gw.http.post("/v1/chat/completions", json={**CHAT, "seed": "1"}, headers=headers)
    assert (ok.status_code, bad.status_code) == (200, 400)
    assert ok.headers["x-collm-trace-id"] == bad.headers["x-collm-trace-id"] == trace_id


async def test_an_unexpected_error_is_a_500_envelope_with_the_trace_id(gw) -> None:
    async def broken() -> None:
        raise RuntimeError("a bug")

    gw.app.add_api_route("/v1/broken", broken)
    gw.app.middleware_stack = gw.app.build_middleware_stack()
    before = refused(500, "internal_error")
    resp = await httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gw.app, raise_app_exceptions=False), base_url="http://gateway"
    ).get("/v1/broken", headers=auth())
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "internal_error"
    assert TRACE_ID.fullmatch(resp.headers["x-collm-trace-id"])
    assert refused(500, "internal_error") == before  # a failure, not a refusal


class Lines(logging.Handler):
    """The gateway's request log lines, formatted as the services write them (JSON)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter("gateway"))
        self.docs: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.docs.append(json.loads(self.format(record)))


async def test_a_requests_log_line_carries_the_trace_id_of_its_response(gw) -> None:
    lines = Lines()
    logger = logging.getLogger("collm_gateway.requests")
    logger.addHandler(lines)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        plain = await gw.http.post("/v1/chat/completions", json=CHAT, headers=auth())
        streamed = await gw.http.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth())
    finally:
        logger.setLevel(level)
        logger.removeHandler(lines)
    for resp in (plain, streamed):
        (line,) = [d for d in lines.docs if d.get("request_id") == resp.headers["x-request-id"]]
        assert line["trace_id"] == resp.headers["x-collm-trace-id"]
