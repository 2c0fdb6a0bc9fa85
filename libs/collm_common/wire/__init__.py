"""The v1 wire schemas: every message that travels on NATS, declared once.

Messages are pydantic models encoded as msgpack maps (as JSON objects when a request's headers say
`Content-Type: application/json`). Within v1 only additive, optional fields may be added; unknown fields
are ignored (and counted) so an older reader keeps working beside a newer writer.
"""

from collm_common.wire.base import (
    CONTENT_TYPE_HEADER,
    JSON_CONTENT_TYPE,
    WireError,
    WireModel,
    decode,
    decode_json,
    decode_payload,
    encode,
    encode_json,
    encode_reply,
    wants_json,
)

__all__ = [
    "CONTENT_TYPE_HEADER",
    "JSON_CONTENT_TYPE",
    "WireError",
    "WireModel",
    "decode",
    "decode_json",
    "decode_payload",
    "encode",
    "encode_json",
    "encode_reply",
    "wants_json",
]
