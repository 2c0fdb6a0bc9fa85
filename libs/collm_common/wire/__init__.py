"""The v1 wire schemas: every message that travels on NATS, declared once.

Messages are pydantic models encoded as msgpack maps. Within v1 only additive, optional fields may be
added; unknown fields are ignored (and counted) so an older reader keeps working beside a newer writer.
"""

from collm_common.wire.base import WireError, WireModel, decode, encode

__all__ = ["WireError", "WireModel", "decode", "encode"]
