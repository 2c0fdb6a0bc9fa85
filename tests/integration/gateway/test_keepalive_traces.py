"""Each request on a kept-alive connection is its own trace, whatever came before it on that connection.

A gateway behind a real uvicorn (real sockets: SDK clients keep their connections alive), no replica:
every request is answered (a 503 or a 400 envelope), each with `x-collm-trace-id`. A request body over
uvicorn's 64 KiB read buffer pauses the socket's reading while the app reads the body; the requests that
follow on the same connection must still get their own trace (or the one their `traceparent` names).
"""

from __future__ import annotations

import re

import pytest

from .conftest import BASE_MODEL

pytestmark = pytest.mark.integration

TRACE_ID = re.compile(r"[0-9a-f]{32}")


def chat(content: str) -> dict[str, object]:
    return {"model": BASE_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


@pytest.mark.parametrize("first_body_bytes", [1_000, 70_000, 300_000])
async def test_requests_after_a_large_body_on_one_connection_are_each_their_own_trace(
    make_served_gateway, first_body_bytes: int
) -> None:
    async with make_served_gateway() as gw:
        ids = []
        first = await gw.http.post("/v1/chat/completions", json=chat("x" * first_body_bytes))
        ids.append(first.headers["x-collm-trace-id"])
        for _ in range(3):
            r = await gw.http.post("/v1/chat/completions", json=chat("hi"))
            ids.append(r.headers["x-collm-trace-id"])
        sent = "4bf92f3577b34da6a3ce929d0e0e4736"
        named = await gw.http.post(
            "/v1/chat/completions",
            json=chat("hi"),
            headers={"traceparent": f"00-{sent}-00f067aa0ba902b7-01"},
        )
        assert all(TRACE_ID.fullmatch(i) for i in ids)
        assert len(set(ids)) == len(ids), ids
        assert named.headers["x-collm-trace-id"] == sent
