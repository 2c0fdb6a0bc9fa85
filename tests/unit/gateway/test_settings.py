import pytest
from pydantic import ValidationError

from collm_gateway.settings import GatewaySettings

pytestmark = pytest.mark.unit


def test_env_and_per_model_slo_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLLM_PORT", "8123")
    monkeypatch.setenv("COLLM_BASE_MODEL", "tiny")
    monkeypatch.setenv("COLLM_SLO_DEFAULTS", '{"medical": {"ttft_ms": 500}}')
    s = GatewaySettings()
    assert s.port == 8123 and s.base_model == "tiny"
    med = s.slo_for("medical")
    assert (med.ttft_ms, med.tpot_ms) == (500.0, s.slo_tpot_ms)
    assert s.slo_for("tiny").ttft_ms == s.slo_ttft_ms


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("COLLM_DEFAULT_MAX_TOKENS", "99999"),
        ("COLLM_GATEWAY_ID", "bad id"),
        ("COLLM_FIRST_EVENT_TIMEOUT_S", "0"),
        ("COLLM_SLO_DEFAULTS", '{"m": {"ttft": 1}}'),
        ("COLLM_WEIGHTS_HOLD_FRAC", "1.5"),
    ],
)
def test_invalid_settings_are_refused(monkeypatch: pytest.MonkeyPatch, env: str, value: str) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ValidationError):
        GatewaySettings()


def test_every_field_is_documented() -> None:
    for name, f in GatewaySettings.model_fields.items():
        assert f.description, f"{name} has no description"


def test_bearer_token_parsing_and_key_ids() -> None:
    from collm_gateway.auth import bearer_token, key_id

    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None
    assert key_id("abc") == key_id("abc") and len(key_id("abc")) == 12 and "abc" not in key_id("abc")
