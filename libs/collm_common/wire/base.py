"""Encoding and validation of wire messages (msgpack over NATS).

`encode(msg)` and `decode(cls, data)` are the only way bytes become messages and back. `decode` raises
`WireError` with a message fit for an error reply when the payload is not msgpack, not a map, carries a
schema version this reader does not know, or fails validation; it never raises anything else.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import msgpack
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

SCHEMA_VERSION = 1

# Payloads above this are refused before decoding (NATS itself caps messages at 1 MiB by default).
MAX_PAYLOAD_BYTES = 1 << 20

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


T = TypeVar("T")


def encode(msg: BaseModel) -> bytes:
    """msgpack bytes of a wire message (None fields are kept so readers see explicit nulls)."""
    return msgpack.packb(msg.model_dump(mode="python"), use_bin_type=True)


def _schema_label(target: Any) -> str:
    return getattr(target, "schema_name", None) or str(target)


def decode(target: type[T] | TypeAdapter[T], data: bytes) -> T:
    """Validate `data` as `target` (a WireModel class or a TypeAdapter over a union of them)."""
    label = _schema_label(target)
    if len(data) > MAX_PAYLOAD_BYTES:
        WIRE_REJECTED.labels(label, "oversized").inc()
        raise WireError(f"payload of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}", code=413)
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        WIRE_REJECTED.labels(label, "malformed").inc()
        raise WireError(f"malformed msgpack for {label}: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        WIRE_REJECTED.labels(label, "not_a_map").inc()
        raise WireError(f"{label} must be a msgpack map, got {type(obj).__name__}")
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
