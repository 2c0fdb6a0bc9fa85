"""The wire codec's JSON side: the format chosen by headers, the same schemas and the same errors."""

import json
import math

import msgpack
import pytest

from collm_common.wire import (
    JSON_CONTENT_TYPE,
    WireError,
    decode,
    decode_json,
    decode_payload,
    encode,
    encode_json,
    encode_reply,
    wants_json,
)
from collm_common.wire.admin import ListRounds, StatusRequest
from collm_common.wire.control import CONTROL_COMMAND, ControlReply, SetFineTuneShare, StartTraining
from collm_common.wire.telemetry import ReplicaTelemetry

from .test_wire import SAMPLES

pytestmark = pytest.mark.unit

JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (None, False),
        ({}, False),
        ({"traceparent": "00-x"}, False),
        ({"Content-Type": "application/json"}, True),
        ({"content-type": "application/json"}, True),  # header names in any case
        ({"CONTENT-TYPE": " Application/JSON ; charset=utf-8"}, True),
        ({"Content-Type": "application/msgpack"}, False),
        ({"Content-Type": "text/plain"}, False),
        ({"Content-Type": "application/jsonx"}, False),
    ],
)
def test_wants_json_reads_the_content_type(headers, expected) -> None:
    assert wants_json(headers) is expected


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_json_round_trip(msg) -> None:
    assert decode_json(type(msg), encode_json(msg)) == msg


def test_payload_format_follows_the_headers() -> None:
    cmd = SetFineTuneShare(share=0.25, ttl_s=30, reason="operator")
    assert decode_payload(CONTROL_COMMAND, encode(cmd), None) == cmd
    assert decode_payload(CONTROL_COMMAND, encode(cmd), {"traceparent": "x"}) == cmd
    typed = b'{"op": "set_share", "share": 0.25, "ttl_s": 30, "reason": "operator"}'
    assert decode_payload(CONTROL_COMMAND, typed, JSON) == cmd
    # msgpack bytes that claim to be JSON are malformed JSON, and JSON without the header malformed msgpack
    with pytest.raises(WireError, match="malformed JSON"):
        decode_payload(CONTROL_COMMAND, encode(cmd), JSON)
    with pytest.raises(WireError, match="malformed msgpack"):
        decode_payload(CONTROL_COMMAND, typed, None)


def test_union_chosen_by_op_in_json() -> None:
    got = decode_json(CONTROL_COMMAND, b'{"op": "start_training", "adapter": "ops", "token_budget": 64}')
    assert isinstance(got, StartTraining) and got.adapter == "ops" and got.token_budget == 64
    with pytest.raises(WireError, match="invalid"):
        decode_json(CONTROL_COMMAND, b'{"op": "explode"}')


def test_empty_payload_is_the_empty_message() -> None:
    assert decode_payload(StatusRequest, b"", None) == StatusRequest()
    assert decode_payload(StatusRequest, b"", JSON) == StatusRequest()
    assert decode_payload(StatusRequest, b" \n", JSON) == StatusRequest()
    assert decode_payload(ListRounds, b"{}", JSON) == ListRounds()
    # ... which a schema with required fields refuses, naming the field
    with pytest.raises(WireError, match="invalid collm.v1.ReplicaTelemetry: replica_id"):
        decode_payload(ReplicaTelemetry, b"", JSON)
    with pytest.raises(WireError, match="invalid collm.v1.ReplicaTelemetry: replica_id"):
        decode_payload(ReplicaTelemetry, b"", None)
    # `decode` itself still refuses an empty payload
    with pytest.raises(WireError, match="malformed msgpack"):
        decode(StatusRequest, b"")


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (
            b'{"limit": 5',
            "malformed JSON for collm.v1.ListRounds: Expecting ',' delimiter at line 1 column 12",
        ),
        (b"\xc1\xff", "malformed JSON for collm.v1.ListRounds"),
        (b"[1, 2]", "collm.v1.ListRounds must be a JSON object, got an array"),
        (b'"limit"', "must be a JSON object, got a string"),
        (b"5", "must be a JSON object, got a number"),
        (b"null", "must be a JSON object, got null"),
        (b'{"limit": 0}', "invalid collm.v1.ListRounds: limit: Input should be greater than or equal to 1"),
        (b'{"limit": "many"}', "invalid collm.v1.ListRounds: limit"),
        (b'{"v": 2}', "unsupported schema version 2 for collm.v1.ListRounds"),
    ],
)
def test_bad_json_is_a_wire_error_with_a_reason(data: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match) as err:
        decode_payload(ListRounds, data, JSON)
    assert err.value.code == 400


def test_json_and_msgpack_refuse_the_same_message_alike() -> None:
    bad = {"op": "set_share", "share": 1.5}
    errors = []
    for data, headers in ((msgpack.packb(bad), None), (json.dumps(bad).encode(), JSON)):
        with pytest.raises(WireError) as err:
            decode_payload(CONTROL_COMMAND, data, headers)
        errors.append((err.value.code, str(err.value)))
    assert errors[0] == errors[1]
    assert "share" in errors[0][1]


def test_oversized_json_refused() -> None:
    data = b'{"reason": "' + b"x" * (1 << 20) + b'"}'
    with pytest.raises(WireError) as err:
        decode_payload(SetFineTuneShare, data, JSON)
    assert err.value.code == 413


def test_unknown_json_fields_are_ignored() -> None:
    got = decode_json(ListRounds, b'{"limit": 3, "future": true}')
    assert got == ListRounds(limit=3)


def test_reply_follows_the_request_format() -> None:
    reply = ControlReply(ok=True, message="share 0.20 for 30s")
    body, headers = encode_reply(reply, JSON)
    assert headers == {"Content-Type": JSON_CONTENT_TYPE}
    assert json.loads(body) == reply.model_dump(mode="json")
    assert decode_json(ControlReply, body) == reply
    body, headers = encode_reply(reply, {"traceparent": "x"})
    assert headers is None and decode(ControlReply, body) == reply


def test_json_reply_is_valid_json_with_non_finite_floats() -> None:
    tel = ReplicaTelemetry(replica_id="r0", ts_unix_s=1.0, interval_s=1.0, model="m", ttft_ms_p99=math.inf)
    doc = json.loads(encode_json(tel), parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert doc["ttft_ms_p99"] is None and doc["replica_id"] == "r0" and doc["v"] == 1
