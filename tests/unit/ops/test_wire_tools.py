"""`collm wire decode` on what the NATS CLI prints: the payload plus one to three newlines."""

import msgpack
import pytest

from collm_common.wire import encode
from collm_common.wire.control import PolicyReply
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_ops.wire_tools import decode_bytes, encode_json, payload_of

pytestmark = pytest.mark.unit

TELEMETRY = ReplicaTelemetry(replica_id="r0", ts_unix_s=1.0, interval_s=1.0, model="tiny")
# msgpack that legitimately ends in 0x0a: its last value is the string "...\n" (and then the int 10).
ENDS_IN_NEWLINE = PolicyReply(policy="collm", previous="separate", policies=["collm", "line\n"])
ENDS_IN_TEN = msgpack.packb({"a": 10})

# What the CLI appends: `nats sub --raw` one newline; `nats req --raw` up to three (a body printed with
# Println, then one or two more); a Windows terminal may add carriage returns.
SUFFIXES = [b"", b"\n", b"\n\n", b"\n\n\n", b"\r\n", b" \n"]


def test_the_fixtures_end_in_0x0a() -> None:
    assert encode(ENDS_IN_NEWLINE).endswith(b"\n") and ENDS_IN_TEN.endswith(b"\n")


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_payload_of_drops_only_what_the_cli_added(suffix: bytes) -> None:
    for payload in (encode(TELEMETRY), encode(ENDS_IN_NEWLINE), ENDS_IN_TEN):
        assert payload_of(payload + suffix) == payload


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_decode_with_trailing_newlines(suffix: bytes) -> None:
    assert decode_bytes(encode(TELEMETRY) + suffix, "ReplicaTelemetry")["replica_id"] == "r0"
    doc = decode_bytes(encode(ENDS_IN_NEWLINE) + suffix, "PolicyReply")
    assert doc["policies"] == ["collm", "line\n"]
    assert decode_bytes(ENDS_IN_TEN + suffix) == {"a": 10}


def test_not_a_payload_is_left_as_it_is_and_refused() -> None:
    assert payload_of(b"\xc1\n") == b"\xc1\n"
    with pytest.raises(ValueError, match="malformed msgpack"):
        decode_bytes(b"\xc1\n", "ReplicaTelemetry")
    # A newline can complete a payload: [1, 10] is kept whole, a 3-item array with two is refused.
    assert decode_bytes(b"\x92\x01\n") == [1, 10]
    with pytest.raises(ValueError, match="not a msgpack payload"):
        decode_bytes(b"\x93\x01\n")
    with pytest.raises(ValueError, match="malformed msgpack"):
        decode_bytes(b'{"replica_id": "r0"}\n', "ReplicaTelemetry")  # JSON is not a msgpack payload


def test_nil_body_names_the_empty_reply() -> None:
    with pytest.raises(ValueError, match="nil body.*Nats-Service-Error"):
        decode_bytes(b"nil body\n\n", "CoordinatorStatus")


def test_encode_then_decode_as_printed() -> None:
    data = encode_json("SetFineTuneShare", '{"share": 0.2, "ttl_s": 30}')
    assert decode_bytes(data + b"\n\n\n", "control")["share"] == 0.2
