"""The Prometheus endpoint of a service process (`COLLM_METRICS_PORT`): the default registry in the
Prometheus text format (`prometheus_client.generate_latest`) on every GET, whatever the scraper's
`Accept` header asks.

prometheus_client's own server negotiates OpenMetrics with a scraper that asks for it (Prometheus does),
and its OpenMetrics writer escapes the colons of sample names but not of their `# HELP`/`# TYPE` lines
(prometheus/client_python#1177), so the replicas' vLLM metrics (`vllm:num_requests_running`, ...) would
reach Prometheus as `vllm_num_requests_running`, which no board written for vLLM reads. The text format
keeps the names as declared, as the gateway's `/metrics` and vLLM's own do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


def metrics_app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
    """WSGI: the registry in the text format on GET (and HEAD), 405 otherwise."""
    if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
        start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Length", "0")])
        return [b""]
    body = generate_latest(REGISTRY)
    start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
    return [b"" if environ["REQUEST_METHOD"] == "HEAD" else body]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        return None


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> WSGIServer:
    """Serve `metrics_app` on `addr:port` (0: any free port) from a daemon thread; returns the server
    (`server_port` is the port bound)."""
    server = make_server(addr, port, metrics_app, server_class=_Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
