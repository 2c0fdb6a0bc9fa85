"""Errors as the OpenAI error envelope, and the mapping from everything below the gateway to HTTP.

Every refusal the gateway sends, before or during a stream, is `{"error": {"message", "type", "param",
"code"}}` with a status that says whose fault it is: 4xx for the request (never a 5xx for bad input),
429/503 with `Retry-After` when capacity is short, 504 when time ran out, 502 when a replica broke the
protocol. The functions here are pure so the mapping is tested without a server.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# OpenAI's `type` strings (and two of ours for the 5xx cases OpenAI folds into server_error).
TYPE_BY_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

# Statuses a replica may answer that mean "not now, try elsewhere" (before it accepted the request).
RETRYABLE_REFUSALS = frozenset({429, 503})


class APIError(Exception):
    """An error that becomes an HTTP status plus the OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or TYPE_BY_STATUS.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return envelope(self.message, self.type, self.param, self.code)

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, type={self.type!r}, code={self.code!r})"


def envelope(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# --- constructors for the gateway's own refusals ------------------------------------------------------
def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str, why: str = "") -> APIError:
    detail = f": {why}" if why else ""
    return APIError(
        404,
        f"The model {model!r} does not exist{detail}. GET /v1/models lists the models served here.",
        param="model",
        code="model_not_found",
    )


def no_replica(retry_after_s: int, why: str = "no replica is available") -> APIError:
    return APIError(
        503,
        f"{why}; retry after {retry_after_s} s",
        code="no_replica_available",
        headers={"Retry-After": str(retry_after_s)},
    )


def unavailable(message: str, retry_after_s: int, code: str) -> APIError:
    """503 for a dependency that is down for now (the adapter store), with `Retry-After`."""
    return APIError(503, message, code=code, headers={"Retry-After": str(retry_after_s)})


def queues_full(retry_after_s: int, tried: int) -> APIError:
    return APIError(
        429,
        f"every replica tried ({tried}) has a full queue; retry after {retry_after_s} s",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def too_large_to_send(size: int, max_payload: int) -> APIError:
    """413 for a request that passed the body limit but does not fit in one NATS message once packed
    for a replica (msgpack, the gateway's own fields, the trace headers)."""
    return APIError(
        413,
        f"the request is {size} bytes once packed for a replica, more than the {max_payload} bytes one "
        "message to a replica can carry: send a shorter prompt",
        code="request_too_large",
    )


def timeout(message: str) -> APIError:
    return APIError(504, message, code="timeout")


def protocol_error(message: str) -> APIError:
    return APIError(502, message, code="replica_protocol_error")


# --- mapping what comes from below ------------------------------------------------------------------------
def from_replica(
    code: int,
    message: str,
    type_: str | None = None,
    param: str | None = None,
    retry_after_s: int = 1,
    error_code: str | None = None,
) -> APIError:
    """A replica's refusal (`GenerateError` or an error reply) as the client should see it.

    4xx pass through with the replica's message, `param` and OpenAI `error_code` (a too-long prompt is
    `context_length_exceeded`, its message OpenAI's and vLLM's "This model's maximum context length is
    ..."); 429 and 503 get `Retry-After`; 504 stays a timeout; any other failure inside the replica is
    its fault, not the client's, and becomes 502 so it can never read as bad input.
    """
    headers: dict[str, str] = {}
    if code in (429, 503):
        headers["Retry-After"] = str(retry_after_s)
    if 400 <= code < 500 or code in (503, 504):
        status = code
    else:
        status = 502
        message = f"replica failed: {message}"
    errcode = (error_code if status < 500 else None) or {
        404: "model_not_found",
        413: "request_too_large",
        429: "queue_full",
        503: "replica_unavailable",
        504: "timeout",
    }.get(status)
    known_type = type_ if type_ and type_ not in ("server_error",) else None
    return APIError(status, message, type_=known_type, param=param, code=errcode, headers=headers)


def from_validation(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """FastAPI/pydantic validation errors as one 400 naming the first offending field."""
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = ctx.get("error") if isinstance(ctx, Mapping) else None
        return bad_request(f"request body is not valid JSON: {detail or 'decode error'}", code="invalid_json")
    shared, full = _shared_location(errors), _location(first)
    param = ".".join(shared) or None
    msg = str(first.get("msg", "invalid value"))
    if kind == "missing":
        return bad_request(f"missing required field {param!r}", param=param, code="missing_field")
    if shared and len(shared) < len(full):
        msg = f"no accepted form of this field fits ({'.'.join(full)}: {msg})"
    where = f"{param}: " if param else ""
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return bad_request(f"{where}{msg}{more}", param=param)


def _location(error: Mapping[str, Any]) -> list[str]:
    return [str(p) for p in error.get("loc", ()) if p != "body"]


def _shared_location(errors: Sequence[Mapping[str, Any]]) -> list[str]:
    """Where the first problem is: its location, cut to what it shares with every other problem in the
    same top-level field. A value that fits none of a union's forms (`prompt`, `stop`, a message's
    `content`) yields one problem per form, each located under the form's name (`prompt.list[int].0`);
    their shared part (`prompt`) is the field at fault."""
    loc = _location(errors[0])
    for other in errors[1:]:
        theirs = _location(other)
        if not loc or not theirs or theirs[0] != loc[0]:
            continue
        n = 0
        while n < min(len(loc), len(theirs)) and loc[n] == theirs[n]:
            n += 1
        loc = loc[:n]
    return loc


def from_http_status(status: int, detail: str | None) -> APIError:
    """Starlette's own HTTP errors (404 route, 405 method, 413 body) in the envelope."""
    text = detail or "error"
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    if status == 413:
        text = f"request body is too large ({text})"
    return APIError(status, text, code=code)
