import msgpack
import pytest

from collm_common.bus import message_size
from collm_common.wire import WireError, decode, encode
from collm_common.wire.adapters import AdapterPublished, TrainingSample
from collm_common.wire.control import CONTROL_COMMAND, RoutingWeights, SetFineTuneShare, StartTraining
from collm_common.wire.inference import (
    GENERATE_EVENT,
    Accepted,
    ChatMessage,
    Finished,
    GenerateError,
    GenerateRequest,
    SamplingParams,
    SloTargets,
    TokenChunk,
)
from collm_common.wire.rounds import LocalUpdate, ParticipantPlan, RoundOutcome, RoundPlan
from collm_common.wire.telemetry import ReplicaTelemetry, ResidentAdapter, TrainingJobStatus

pytestmark = pytest.mark.unit

SAMPLES = [
    GenerateRequest(
        request_id="r1",
        messages=[ChatMessage(role="user", content="hi")],
        adapter="medical",
        adapter_version=3,
        sampling=SamplingParams(max_tokens=5, temperature=0.0, stop=["\n"]),
        slo=SloTargets(ttft_ms=500, tpot_ms=80),
    ),
    ReplicaTelemetry(
        replica_id="r0",
        ts_unix_s=1.0,
        interval_s=1.0,
        model="m",
        adapters=[ResidentAdapter(name="a", version_id="a@v1", version=1)],
        training_jobs=[TrainingJobStatus(adapter="a", state="running", base_version_id="a@v1")],
    ),
    RoutingWeights(ts_unix_s=1.0, ttl_s=5.0, weights={"r0": 0.5, "r1": 0.5}),
    RoundPlan(
        round_id=1,
        adapter="a",
        base_version=1,
        participants=[ParticipantPlan(replica_id="r0", token_budget=100)],
        quorum=1,
        opened_unix_s=0.0,
        deadline_unix_s=10.0,
    ),
    LocalUpdate(
        round_id=1,
        adapter="a",
        replica_id="r0",
        base_version=1,
        blob_key="k",
        sha256="s",
        num_samples=3,
        num_tokens=9,
    ),
    RoundOutcome(round_id=1, adapter="a", state="published", base_version=1, new_version=2),
    AdapterPublished(name="a", version=2, version_id="a@v2", sha256="x", base_model="m", source="round"),
    TrainingSample(sample_id="s1", replica_id="r0", prompt="p", response="r"),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg) -> None:
    assert decode(type(msg), encode(msg)) == msg


def test_event_union_round_trip() -> None:
    events = [
        Accepted(request_id="r", replica_id="r0", adapter_version_id="base", prompt_tokens=3),
        TokenChunk(request_id="r", seq=0, token_ids=[1], text="a"),
        Finished(
            request_id="r",
            seq=1,
            finish_reason="stop",
            prompt_tokens=3,
            completion_tokens=1,
            adapter_version_id="base",
            replica_id="r0",
        ),
        GenerateError(request_id="r", code=400, message="too long"),
    ]
    for ev in events:
        assert decode(GENERATE_EVENT, encode(ev)) == ev


def test_control_union() -> None:
    for cmd in (SetFineTuneShare(share=0.3), StartTraining(adapter="a", token_budget=10)):
        assert decode(CONTROL_COMMAND, encode(cmd)) == cmd


def test_malformed_msgpack_is_a_wire_error() -> None:
    with pytest.raises(WireError, match="malformed"):
        decode(GenerateRequest, b"\xc1\xff\x00")


def test_not_a_map() -> None:
    with pytest.raises(WireError, match="must be a msgpack map"):
        decode(GenerateRequest, msgpack.packb([1, 2, 3]))


def test_wrong_schema_version() -> None:
    raw = msgpack.packb({"v": 2, "request_id": "x"})
    with pytest.raises(WireError, match="unsupported schema version 2"):
        decode(GenerateRequest, raw)


def test_invalid_field_names_the_field() -> None:
    raw = msgpack.packb({"request_id": "x", "sampling": {"max_tokens": 0}})
    with pytest.raises(WireError, match="sampling.max_tokens"):
        decode(GenerateRequest, raw)


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    raw = msgpack.packb({"request_id": "x", "prompt": "p", "future_field": 1})
    msg = decode(GenerateRequest, raw)
    assert msg.request_id == "x" and not hasattr(msg, "future_field")


def test_oversized_payload_refused_before_decoding() -> None:
    with pytest.raises(WireError) as err:
        decode(GenerateRequest, b"\x00" * ((1 << 20) + 1))
    assert err.value.code == 413


def test_unknown_union_kind() -> None:
    with pytest.raises(WireError, match="invalid"):
        decode(CONTROL_COMMAND, msgpack.packb({"op": "self_destruct"}))


def test_telemetry_is_accepted_only_on_its_replicas_own_subject() -> None:
    from collm_common import subjects

    t = ReplicaTelemetry(replica_id="r9", ts_unix_s=0.0, interval_s=1.0, model="m")
    assert t.subject_error(subjects.telemetry("r9")) is None
    why = t.subject_error(subjects.telemetry("r0"))
    assert why is not None and "r9" in why and subjects.telemetry("r0") in why
    # Messages that name no sender in their subject accept any.
    assert RoutingWeights(ts_unix_s=0.0, ttl_s=1.0, weights={}).subject_error("anything") is None


def test_message_size_counts_payload_and_the_header_block() -> None:
    assert message_size(b"abc", None) == 3
    assert message_size(b"abc", {}) == 3 + len(b"NATS/1.0\r\n\r\n")
    block = b"NATS/1.0\r\ntraceparent: 00-ab-cd-01\r\nk: v\r\n\r\n"
    assert message_size(b"abc", {"traceparent": "00-ab-cd-01", "k": "v"}) == 3 + len(block)
    assert message_size(b"", {"k": "é"}) == len("NATS/1.0\r\nk: é\r\n\r\n".encode())
