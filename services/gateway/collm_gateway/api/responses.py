"""What the OpenAPI document says each route answers: its error statuses, each with the OpenAI error
envelope (`errors.envelope`), never FastAPI's `HTTPValidationError` (invalid input is 400 here).

Routes declare their statuses with `responses=errors(...)` (FastAPI's additional responses); the app
declares 500 for every route. A route with input that never answers 422 would still get FastAPI's
default 422 `HTTPValidationError`; `document` (the app's `openapi`) drops exactly those, so the document
lists only what the gateway sends. The fuzz test (tests/fuzz/test_gateway_openapi.py) checks every
answer against this document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str = Field(description="What went wrong, for a person (limits, the reason, what to do).")
    type: str = Field(description="OpenAI's error type, e.g. invalid_request_error, rate_limit_error.")
    param: str | None = Field(description="The request field at fault, if one is.")
    code: str | None = Field(description="A stable machine-readable code, e.g. model_not_found.")


class ErrorEnvelope(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


_SECONDS = {"schema": {"type": "string", "pattern": "^[0-9]+$"}}
RETRY_AFTER = {
    "Retry-After": {"description": "Seconds to wait before retrying.", "required": True, **_SECONDS}
}
WWW_AUTHENTICATE = {
    "WWW-Authenticate": {"description": "Bearer", "required": True, "schema": {"type": "string"}}
}

# Why a route may answer each status; routes list the ones they can send.
DESCRIPTIONS: dict[int, str] = {
    400: "Invalid request: a field's value or type, missing fields, JSON that does not parse.",
    401: "Missing or unknown API key (when keys are required).",
    403: "An admin endpoint without an admin key, or a path the aggregator may not read.",
    404: "Unknown model, adapter, version or path (another tenant's adapter looks the same).",
    409: "Conflicts with what exists: another LoRA spec or base model, a concurrent publication.",
    413: "Request body, or a batch of samples, too large.",
    422: "Well-formed, but cannot be done: an adapter that cannot be imported or served, samples that "
    "no replica can keep.",
    429: "The key's rate limit, or every replica's queue, is full.",
    500: "An unexpected error in the gateway.",
    502: "A part below the gateway (a replica, the aggregator) failed.",
    503: "Not now: no replica available, or NATS, the adapter store or the aggregator unreachable.",
    504: "Time ran out: a replica or the aggregator did not answer in time.",
}
HEADERS: dict[int, dict[str, Any]] = {401: WWW_AUTHENTICATE, 429: RETRY_AFTER, 503: RETRY_AFTER}

# Every /v1/ route: authentication (401) and per-key rate limits (429) run before the route.
AUTHENTICATED = (401, 429)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for these error statuses, each with the error envelope."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in sorted(set(statuses)):
        doc: dict[str, Any] = {"model": ErrorEnvelope, "description": DESCRIPTIONS[status]}
        if status in HEADERS:
            doc["headers"] = HEADERS[status]
        out[status] = doc
    return out


# One event of a stream (what FastAPI declares for its own event streams, as OpenAPI 3.2's `itemSchema`).
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "description": "A JSON chunk, or a JSON error envelope; the last event is `[DONE]`.",
        },
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer", "minimum": 0},
    },
}

# Completions and chat completions: a JSON body, or an SSE stream (whose error events are envelopes
# too); refusals of the gateway, and of the replica passed through (4xx, 429, 503, 504; any other
# failure of the replica is 502).
COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion; with `stream: true` a `text/event-stream` of chunks, ending with "
        "`data: [DONE]` (an error after the start is an event holding the error envelope).",
        "content": {"text/event-stream": {"itemSchema": SSE_EVENT}},
    },
    **errors(*AUTHENTICATED, 400, 404, 413, 422, 502, 503, 504),
}


def _is_fastapi_validation_error(response: dict[str, Any]) -> bool:
    schema = response.get("content", {}).get("application/json", {}).get("schema", {})
    return bool(schema.get("$ref", "").endswith("/HTTPValidationError"))


def document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document (cached), without FastAPI's default 422 (see the module docstring)."""
    if app.openapi_schema is None:
        doc = get_openapi(
            title=app.title,
            version=app.version,
            openapi_version=app.openapi_version,
            description=app.description,
            routes=app.routes,
        )
        for operations in doc.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.get("responses", {})
                if "422" in responses and _is_fastapi_validation_error(responses["422"]):
                    del responses["422"]
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = doc
    return app.openapi_schema
