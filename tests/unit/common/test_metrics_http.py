"""A service's metrics endpoint keeps metric names as declared, whatever format the scraper asks for."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import Gauge

from collm_common.metrics_http import start_metrics_server

pytestmark = pytest.mark.unit

GAUGE = Gauge("collm_test:colon_gauge", "A test gauge whose name has a colon, as vLLM's names do.")


def get(port: int, accept: str | None = None, method: str = "GET") -> tuple[int, str, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", method=method)
    if accept:
        req.add_header("Accept", accept)
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.status, resp.headers["Content-Type"], resp.read().decode()


def test_the_text_format_with_colon_names_even_when_openmetrics_is_asked_for() -> None:
    GAUGE.set(3)
    server = start_metrics_server(0, "127.0.0.1")
    try:
        port = server.server_port
        # What Prometheus sends: it prefers OpenMetrics.
        prom = "application/openmetrics-text;version=1.0.0;escaping=underscores;q=0.5,text/plain;q=0.4"
        for accept in (prom, None):
            status, ctype, body = get(port, accept)
            assert status == 200 and ctype.startswith("text/plain;")
            assert "\ncollm_test:colon_gauge 3.0\n" in body
            assert "collm_test_colon_gauge" not in body
        assert get(port, method="HEAD")[2] == ""
    finally:
        server.shutdown()
        server.server_close()
