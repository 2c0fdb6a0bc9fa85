"""Error envelope and the mapping of replica refusals, validation errors and HTTP errors to statuses."""

import pytest

from collm_gateway import errors
from collm_gateway.errors import APIError

pytestmark = pytest.mark.unit


def test_envelope_shape() -> None:
    err = errors.bad_request("max_tokens must be positive", "max_tokens")
    assert err.status == 400
    assert err.body() == {
        "error": {
            "message": "max_tokens must be positive",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "invalid_value",
        }
    }


@pytest.mark.parametrize(
    ("code", "status", "type_", "retry_after"),
    [
        (400, 400, "invalid_request_error", False),
        (404, 404, "not_found_error", False),
        (413, 413, "invalid_request_error", False),
        (429, 429, "rate_limit_error", True),
        (503, 503, "service_unavailable_error", True),
        (504, 504, "timeout_error", False),
        (500, 502, "server_error", False),
        (507, 502, "server_error", False),
    ],
)
def test_replica_refusals_map_to_statuses(code: int, status: int, type_: str, retry_after: bool) -> None:
    err = errors.from_replica(code, "boom", retry_after_s=3)
    assert err.status == status
    assert err.type == type_
    assert ("Retry-After" in err.headers) is retry_after
    if retry_after:
        assert err.headers["Retry-After"] == "3"
    if status == 502:
        assert "replica failed" in err.message


def test_replica_prompt_too_long_keeps_its_message_and_param() -> None:
    err = errors.from_replica(
        400, "prompt is 9000 tokens, the limit is 2048", "invalid_request_error", "messages"
    )
    assert err.status == 400 and "9000" in err.message and "2048" in err.message
    assert err.param == "messages"


def test_a_replicas_openai_error_code_reaches_the_envelope_of_a_4xx_only() -> None:
    msg = "This model's maximum context length is 2048 tokens. However, you requested 9005 tokens"
    err = errors.from_replica(
        400, msg, "invalid_request_error", "prompt", error_code="context_length_exceeded"
    )
    assert err.body() == {
        "error": {
            "message": msg,
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "context_length_exceeded",
        }
    }
    assert errors.from_replica(429, "full", error_code="odd").code == "odd"
    assert errors.from_replica(500, "boom", error_code="odd").code is None  # a 502: the replica's fault


def test_no_replica_and_queue_full_carry_retry_after() -> None:
    assert errors.no_replica(2).headers == {"Retry-After": "2"}
    assert errors.no_replica(2).status == 503
    q = errors.queues_full(5, tried=3)
    assert q.status == 429 and q.headers == {"Retry-After": "5"} and "3" in q.message


def test_validation_errors_become_400_naming_the_field() -> None:
    err = errors.from_validation(
        [{"type": "greater_than_equal", "loc": ("body", "max_tokens"), "msg": "Input should be >= 1"}]
    )
    assert err.status == 400 and err.param == "max_tokens" and "max_tokens" in err.message
    missing = errors.from_validation(
        [{"type": "missing", "loc": ("body", "messages"), "msg": "Field required"}]
    )
    assert missing.status == 400 and missing.code == "missing_field" and missing.param == "messages"
    nested = errors.from_validation(
        [
            {"type": "literal_error", "loc": ("body", "messages", 0, "role"), "msg": "bad role"},
            {"type": "x", "loc": ("body", "y"), "msg": "z"},
        ]
    )
    assert nested.param == "messages.0.role" and "1 more" in nested.message


def test_a_value_that_fits_no_form_of_a_union_names_the_field() -> None:
    err = errors.from_validation(
        [
            {
                "type": "string_type",
                "loc": ("body", "prompt", "str"),
                "msg": "Input should be a valid string",
            },
            {"type": "string_type", "loc": ("body", "prompt", "list[str]", 0), "msg": "m"},
            {"type": "int_type", "loc": ("body", "prompt", "list[int]", 0), "msg": "m"},
        ]
    )
    assert err.status == 400 and err.param == "prompt"
    assert err.message.startswith("prompt: no accepted form of this field fits (prompt.str: ")


def test_invalid_json_is_a_400_with_its_own_code() -> None:
    err = errors.from_validation(
        [
            {
                "type": "json_invalid",
                "loc": ("body", 3),
                "msg": "JSON decode error",
                "ctx": {"error": "Expecting value"},
            }
        ]
    )
    assert err.status == 400 and err.code == "invalid_json" and "Expecting value" in err.message


def test_http_errors_keep_their_status() -> None:
    assert errors.from_http_status(404, "Not Found").status == 404
    big = errors.from_http_status(413, "Content Too Large")
    assert big.status == 413 and big.code == "request_too_large"


def test_default_types_never_call_a_4xx_a_server_error() -> None:
    for status in range(400, 430):
        assert APIError(status, "x").type != "server_error"
    assert APIError(500, "x").type == "server_error"
