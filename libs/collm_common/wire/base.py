"""Encoding and validation of wire messages (msgpack over NATS, JSON on request).

`encode(msg)` and `decode(cls, data)` are the only way bytes become messages and back. `decode` raises
`WireError` with a message fit for an error reply when the payload is not msgpack, not a map, carries a
schema version this reader does not know, or fails validation; it never raises anything else.

A payload whose headers say `Content-Type: application/json` (what an operator types with the NATS CLI)
is JSON: `decode_json` applies the same checks and the same schemas and raises the same `WireError`s,
and `decode_payload` picks the format from the headers. `encode_reply` answers in the request's format:
JSON, with that header, to a JSON request; msgpack otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import msgpack
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

SCHEMA_VERSION = 1

# Payloads above this are refused before decoding (NATS itself caps messages at 1 MiB by default).
MAX_PAYLOAD_BYTES = 1 << 20

CONTENT_TYPE_HEADER = "Content-Type"
JSON_CONTENT_TYPE = "application/json"
_EMPTY_MSGPACK_MAP = b"\x80"

WIRE_REJECTED = Counter(
    "collm_wire_rejected_messages_total", "Wire messages refused on decode", ["schema", "reason"]
)
WIRE_UNKNOWN_FIELDS = Counter(
    "collm_wire_unknown_fields_total", "Wire messages that carried fields this reader ignores", ["schema"]
)


class WireError(ValueError):
    """A payload that cannot be accepted; `code` is an HTTP-like status for error replies."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code


class WireModel(BaseModel):
    """Base of every wire message. `v` is the schema version of the family (`collm.v1`)."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)
    schema_name: ClassVar[str] = ""

    v: int = SCHEMA_VERSION

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.schema_name = f"collm.v{SCHEMA_VERSION}.{cls.__name__}"

    def subject_error(self, subject: str) -> str | None:
        """Why this message may not arrive on `subject`, or None when it may. A message that names its
        sender in its subject (a replica's telemetry) refuses any other subject, so the sender a reader
        sees is the one that NATS let publish there (deploy/nats/auth.conf: each replica its own)."""
        return None


T = TypeVar("T")


def encode(msg: BaseModel) -> bytes:
    """msgpack bytes of a wire message (None fields are kept so readers see explicit nulls)."""
    return msgpack.packb(msg.model_dump(mode="python"), use_bin_type=True)


def encode_json(msg: BaseModel) -> bytes:
    """UTF-8 JSON of a wire message (None fields kept; a NaN or infinite float becomes null)."""
    return msg.model_dump_json().encode()


def wants_json(headers: Mapping[str, str] | None) -> bool:
    """Whether `headers` declare a JSON payload: `Content-Type: application/json`, the header's name in
    any case, parameters such as `; charset=utf-8` allowed."""
    for key, value in (headers or {}).items():
        if key.lower() == CONTENT_TYPE_HEADER.lower():
            return value.split(";", 1)[0].strip().lower() == JSON_CONTENT_TYPE
    return False


def encode_reply(
    msg: BaseModel, request_headers: Mapping[str, str] | None
) -> tuple[bytes, dict[str, str] | None]:
    """Body and headers of a reply in its request's format: JSON and `Content-Type: application/json`
    when the request declared JSON (`wants_json`), else msgpack and no headers."""
    if wants_json(request_headers):
        return encode_json(msg), {CONTENT_TYPE_HEADER: JSON_CONTENT_TYPE}
    return encode(msg), None


def decode_payload(target: type[T] | TypeAdapter[T], data: bytes, headers: Mapping[str, str] | None) -> T:
    """Validate `data` as `target` in the format its `headers` declare: JSON when `wants_json`, else
    msgpack. An empty payload (in JSON, one of only whitespace) is the empty message: every field at its
    default, so a schema with required fields refuses it."""
    if wants_json(headers):
        return decode_json(target, data if data.strip() else b"{}")
    return decode(target, data or _EMPTY_MSGPACK_MAP)


def _schema_label(target: Any) -> str:
    return getattr(target, "schema_name", None) or str(target)


def _check_size(data: bytes, label: str) -> None:
    if len(data) > MAX_PAYLOAD_BYTES:
        WIRE_REJECTED.labels(label, "oversized").inc()
        raise WireError(f"payload of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}", code=413)


def decode(target: type[T] | TypeAdapter[T], data: bytes) -> T:
    """Validate `data` as `target` (a WireModel class or a TypeAdapter over a union of them)."""
    label = _schema_label(target)
    _check_size(data, label)
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        WIRE_REJECTED.labels(label, "malformed").inc()
        raise WireError(f"malformed msgpack for {label}: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        WIRE_REJECTED.labels(label, "not_a_map").inc()
        raise WireError(f"{label} must be a msgpack map, got {type(obj).__name__}")
    return _validate(target, obj, label)


def decode_json(target: type[T] | TypeAdapter[T], data: bytes) -> T:
    """Validate JSON `data` as `target`, with the checks of `decode` (size, an object, the schema version,
    the schema); a parse error names its line and column."""
    label = _schema_label(target)
    _check_size(data, label)
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as exc:
        WIRE_REJECTED.labels(label, "malformed").inc()
        where = f"line {exc.lineno} column {exc.colno}"
        raise WireError(f"malformed JSON for {label}: {exc.msg} at {where}") from None
    except ValueError as exc:  # bytes that are no Unicode text
        WIRE_REJECTED.labels(label, "malformed").inc()
        raise WireError(f"malformed JSON for {label}: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        WIRE_REJECTED.labels(label, "not_a_map").inc()
        raise WireError(f"{label} must be a JSON object, got {_json_kind(obj)}")
    return _validate(target, obj, label)


def _json_kind(obj: Any) -> str:
    if isinstance(obj, list):
        return "an array"
    if isinstance(obj, str):
        return "a string"
    if isinstance(obj, bool):
        return "a boolean"
    if isinstance(obj, int | float):
        return "a number"
    return "null"


def _validate(target: type[T] | TypeAdapter[T], obj: dict[Any, Any], label: str) -> T:
    """The schema-version check and `target`'s validation of a decoded map (either format)."""
    version = obj.get("v", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        WIRE_REJECTED.labels(label, "version").inc()
        raise WireError(f"unsupported schema version {version!r} for {label} (this reader speaks v1)")
    try:
        if isinstance(target, TypeAdapter):
            msg = target.validate_python(obj)
        else:
            msg = target.model_validate(obj)  # type: ignore[attr-defined]
    except ValidationError as exc:
        WIRE_REJECTED.labels(label, "invalid").inc()
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "message"
        raise WireError(f"invalid {label}: {where}: {first.get('msg')}") from None
    if isinstance(msg, BaseModel):
        known = set(type(msg).model_fields)
        if set(obj) - known:
            WIRE_UNKNOWN_FIELDS.labels(label).inc()
    return msg
