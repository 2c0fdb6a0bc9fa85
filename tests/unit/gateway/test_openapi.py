"""The gateway's OpenAPI document declares what the gateway answers (collm_gateway/api/responses.py):
every error status with the OpenAI error envelope, and no FastAPI `HTTPValidationError` (invalid input
is 400 here). The answers to invalid requests are checked against the document with schemathesis's
own conformance checks, in-process (no NATS, no Redis: each request is refused before it needs them).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from schemathesis.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from collm_gateway.app import build_app
from collm_gateway.auth import is_protected
from collm_gateway.settings import GatewaySettings

pytestmark = pytest.mark.unit

ADMIN = "sk-openapi-admin"
CHECKS = [
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
ENVELOPE_REF = "#/components/schemas/ErrorEnvelope"


@pytest.fixture(scope="module")
def app() -> Any:
    # The routes below refuse before they touch the bus or the store, so none is given.
    return build_app(GatewaySettings(admin_key=ADMIN, max_body_bytes=4096), None, None)  # type: ignore[arg-type]


def test_every_error_is_the_envelope_and_no_fastapi_validation_error(app: Any) -> None:
    doc = app.openapi()
    text = json.dumps(doc)
    assert "HTTPValidationError" not in text and "ValidationError" not in doc["components"]["schemas"]
    envelope = doc["components"]["schemas"]["ErrorEnvelope"]
    assert envelope["required"] == ["error"] and envelope["additionalProperties"] is False
    detail = doc["components"]["schemas"]["ErrorDetail"]
    assert sorted(detail["required"]) == ["code", "message", "param", "type"]
    operations = 0
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            operations += 1
            where = f"{method.upper()} {path}"
            statuses = {int(s) for s in op["responses"]}
            assert 200 in statuses and 500 in statuses, where
            has_input = bool(op.get("parameters") or op.get("requestBody"))
            assert (400 in statuses) == has_input, (
                where
            )  # invalid input is 400, and only where there is input
            if is_protected(path):
                assert {401, 429} <= statuses, where  # keys and rate limits apply to every /v1/ route
            for status in statuses - {200}:
                content = op["responses"][str(status)]["content"]
                assert content == {"application/json": {"schema": {"$ref": ENVELOPE_REF}}}, (where, status)
            for status in statuses & {429, 503}:
                assert op["responses"][str(status)]["headers"]["Retry-After"]["required"], (where, status)
    assert operations == 16


# (method, path, path parameters, body or raw bytes, key): each answered with an error the document lists.
REFUSED: list[tuple[str, str, dict[str, str], Any, str | None]] = [
    ("POST", "/v1/chat/completions", {}, {"model": 5, "messages": []}, None),
    ("POST", "/v1/chat/completions", {}, b"{not json", None),
    ("POST", "/v1/completions", {}, {"model": "m"}, None),
    ("POST", "/v1/completions", {}, {"model": "m", "prompt": "x" * 5000}, None),  # 413: over max_body_bytes
    ("GET", "/v1/models/{model}", {"model": "m" * 300}, None, None),
    ("POST", "/v1/load_lora_adapter", {}, {"lora_name": "a", "lora_path": "relative/dir"}, ADMIN),
    ("POST", "/v1/load_lora_adapter", {}, {"lora_name": "a", "lora_path": "/x"}, "sk-not-admin"),
    ("POST", "/v1/unload_lora_adapter", {}, {}, ADMIN),
    ("GET", "/v1/adapters/{name}/versions", {"name": "bad name"}, None, ADMIN),
    ("POST", "/v1/adapters/{name}/rollback", {"name": "med"}, {"version": 0}, ADMIN),
    ("POST", "/v1/samples", {}, {"samples": "none"}, ADMIN),
    ("POST", "/tokenize", {}, {"model": "m"}, None),
    ("POST", "/tokenize", {}, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None),
    ("POST", "/tokenize", {}, {"prompt": "x" * 5000}, None),  # 413: over max_body_bytes
    ("POST", "/detokenize", {}, {"tokens": [-1]}, None),
    ("POST", "/detokenize", {}, {"tokens": "1 2"}, None),
]


@pytest.mark.parametrize(("method", "path", "params", "body", "key"), REFUSED)
def test_refusals_conform_to_the_document(
    app: Any, method: str, path: str, params: dict[str, str], body: Any, key: str | None
) -> None:
    schema = schemathesis.openapi.from_dict(app.openapi())
    operation = schema[path][method]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = path.format(**params)
    client = TestClient(app, raise_server_exceptions=False)
    if isinstance(body, bytes):
        resp = client.request(
            method, url, content=body, headers={**headers, "Content-Type": "application/json"}
        )
    else:
        resp = client.request(method, url, json=body, headers=headers)
    sent: dict[str, Any] = {"body": body} if isinstance(body, dict) else {}
    case = operation.Case(path_parameters=params or None, headers=headers, **sent)
    assert 400 <= resp.status_code < 500, resp.text
    case.validate_response(resp, checks=CHECKS)


def test_the_metrics_and_health_answers_conform(app: Any) -> None:
    schema = schemathesis.openapi.from_dict(app.openapi())
    client = TestClient(app)
    for path in ("/metrics", "/healthz"):
        resp = client.get(path)
        assert resp.status_code == 200
        schema[path]["GET"].Case().validate_response(resp, checks=CHECKS)
