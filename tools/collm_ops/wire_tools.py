"""msgpack payloads for the NATS CLI: `collm wire encode|decode|types`.

CoLLM's messages are msgpack maps (`collm_common.wire`). Request/reply endpoints also take JSON with a
`Content-Type: application/json` header, so an operator rarely needs this module; events (telemetry,
decisions, rounds, publications) are msgpack only. `encode` turns JSON into the exact bytes a service
expects (validated against the v1 schema, so a typo fails here and not on the server); `decode` turns
what `nats req --raw` or `nats sub --raw` printed back into JSON:

    nats sub collm.v1.coordinator.decisions --count 1 --raw | collm wire decode CoordinatorDecisions

The NATS CLI prints each message followed by one to three newlines; `decode` drops trailing whitespace
bytes only when what it was given is not one msgpack value, and then only as many as leave one (a value
can itself end in 0x0a, which is kept). Type names are the schema
class names (`collm wire types` lists them with the subjects they travel on); `control` is the union of
every replica control command, chosen by its `"op"` field, and `tokenize` that of a replica's tokenize
requests.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
from pydantic import BaseModel, TypeAdapter, ValidationError

from collm_common import subjects
from collm_common.wire import WireModel, decode, encode
from collm_common.wire import adapters as w_adapters
from collm_common.wire import admin as w_admin
from collm_common.wire import control as w_control
from collm_common.wire import gateway as w_gateway
from collm_common.wire import inference as w_inference
from collm_common.wire import rounds as w_rounds
from collm_common.wire import telemetry as w_telemetry
from collm_common.wire import tokenize as w_tokenize

_MODULES = (w_inference, w_telemetry, w_control, w_rounds, w_admin, w_adapters, w_gateway, w_tokenize)

# Where each request type is sent / each event type is published (for `collm wire types`); upper-case
# tokens are placeholders (ID: a replica id, N: a round id, NAME: an adapter name).
WHERE: dict[str, str] = {
    "GenerateRequest": subjects.replica("ID", "generate"),
    "CancelRequest": subjects.replica("ID", "cancel"),
    "control": subjects.replica("ID", "control"),
    "EvaluateCandidate": subjects.replica("ID", "evaluate"),
    "tokenize": subjects.replica("ID", "tokenize"),
    "ReplicaTelemetry": subjects.telemetry("ID")
    + " (also the reply of "
    + subjects.replica("ID", "status")
    + ")",
    "RoutingWeights": subjects.routing_weights(),
    "CoordinatorDecisions": subjects.coordinator_decisions(),
    "CoordinatorStatusRequest": subjects.coordinator("status"),
    "SetPolicy": subjects.coordinator("policy"),
    "GatewayStatusRequest": subjects.gateway("status"),
    "RoundPlan": subjects.aggregator("open_round"),
    "StatusRequest": subjects.aggregator("status") + ", " + subjects.replica("ID", "status"),
    "ListRounds": subjects.aggregator("rounds"),
    "GetRound": subjects.aggregator("round"),
    "RollbackAdapter": subjects.aggregator("rollback"),
    "ImportAdapter": subjects.aggregator("import"),
    "RoundOutcome": subjects.subject("rounds", "N", "STATE"),
    "LocalUpdate": subjects.subject("updates", "N", "ID"),
    "TrainingSample": subjects.samples("ID"),
    "AdapterPublished": subjects.adapter_published("NAME"),
}


def _wire_types() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for module in _MODULES:
        for name, obj in vars(module).items():
            if isinstance(obj, type) and issubclass(obj, WireModel) and obj is not WireModel:
                found[name] = obj
    found["control"] = w_control.CONTROL_COMMAND
    found["GenerateEvent"] = w_inference.GENERATE_EVENT
    found["tokenize"] = w_tokenize.TOKENIZE_REQUEST
    return dict(sorted(found.items(), key=lambda kv: kv[0].lower()))


TYPES: dict[str, Any] = _wire_types()


def resolve(type_name: str) -> type[BaseModel] | TypeAdapter[Any]:
    """The schema called `type_name` (case-insensitive), or ValueError naming the known ones."""
    for name, target in TYPES.items():
        if name.lower() == type_name.lower():
            return target  # type: ignore[no-any-return]
    raise ValueError(f"unknown wire type {type_name!r}; `collm wire types` lists them")


def encode_json(type_name: str, text: str) -> bytes:
    """msgpack bytes of the message `text` (JSON object, may be empty) describes, validated first."""
    target = resolve(type_name)
    raw = json.loads(text) if text.strip() else {}
    if not isinstance(raw, dict):
        raise ValueError("the message must be a JSON object")
    try:
        if isinstance(target, TypeAdapter):
            msg = target.validate_python(raw)
        else:
            msg = target.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(f"not a valid {type_name}: {exc}") from None
    return encode(msg)


# What the NATS CLI may append to a message it prints (newlines; whitespace bytes in general).
_TRAILING_WHITESPACE = b" \t\r\n"
# What `nats req --raw` / `nats sub --raw` print for a message without a body (an error reply's, say).
_NIL_BODY = b"nil body"


def _one_value(data: bytes) -> bool:
    """Whether `data` is exactly one msgpack value (nothing missing, nothing after it)."""
    try:
        msgpack.unpackb(data, raw=True, strict_map_key=False)
    except Exception:  # noqa: BLE001 - msgpack raises several unrelated exception types
        return False
    return True


def payload_of(printed: bytes) -> bytes:
    """The msgpack payload in what the NATS CLI printed: `printed` itself when it is one msgpack value,
    else the longest prefix without trailing whitespace bytes that is one (at most one prefix can be: a
    complete value followed by more bytes is not one value), else `printed` unchanged."""
    if _one_value(printed):
        return printed
    end = len(printed)
    while end > 0 and printed[end - 1] in _TRAILING_WHITESPACE:
        end -= 1
        if _one_value(printed[:end]):
            return printed[:end]
    return printed


def decode_bytes(data: bytes, type_name: str | None = None) -> Any:
    """JSON-able content of a payload as printed by the NATS CLI (`payload_of`): validated as
    `type_name`, or the raw msgpack map when None. ValueError when it is no payload."""
    if data.strip() == _NIL_BODY:
        raise ValueError(
            "the NATS CLI printed `nil body`: the message had no payload (an error reply carries its "
            "error in headers: run `nats req` without --raw to see Nats-Service-Error)"
        )
    payload = payload_of(data)
    if type_name is None:
        try:
            return _jsonable(msgpack.unpackb(payload, raw=False, strict_map_key=False))
        except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated exception types
            raise ValueError(f"not a msgpack payload: {type(exc).__name__}") from None
    target = resolve(type_name)
    msg = decode(target, payload)
    return msg.model_dump(mode="json") if isinstance(msg, BaseModel) else msg


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, bytes):
        return {"bytes": len(obj)}
    return obj


def types_table() -> list[tuple[str, str]]:
    """(type name, where it travels) for every wire type."""
    return [(name, WHERE.get(name, "")) for name in TYPES]
