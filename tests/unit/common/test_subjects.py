import pytest

from collm_common import subjects

pytestmark = pytest.mark.unit


def test_subjects_are_versioned_and_built_from_tokens() -> None:
    assert subjects.replica("r0", "generate") == "collm.v1.replica.r0.generate"
    assert subjects.telemetry("r-1") == "collm.v1.telemetry.replica.r-1"
    assert subjects.telemetry_all() == "collm.v1.telemetry.replica.*"
    assert subjects.update(3, "r2") == "collm.v1.updates.3.r2"
    assert subjects.round_event(7, "published") == "collm.v1.rounds.7.published"
    assert subjects.adapter_published("medical") == "collm.v1.adapters.medical.published"
    assert subjects.samples_all() == "collm.v1.samples.>"


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "a*", ">", "x" * 65, "é"])
def test_tokens_that_would_change_the_subject_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid"):
        subjects.replica(bad, "generate")


def test_unknown_replica_verb() -> None:
    with pytest.raises(ValueError, match="unknown replica verb"):
        subjects.replica("r0", "explode")


def test_service_names() -> None:
    assert subjects.SERVICE_NAMES == (
        "collm-gateway",
        "collm-replica",
        "collm-coordinator",
        "collm-aggregator",
    )
