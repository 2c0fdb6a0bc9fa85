import pytest
from pydantic import ValidationError

from collm_common.settings import CommonSettings

pytestmark = pytest.mark.unit


def test_defaults_and_env_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLLM_NATS_URL", "nats://10.0.0.1:4333")
    monkeypatch.setenv("COLLM_REDIS_PREFIX", "site-a")
    s = CommonSettings()
    assert s.nats_url == "nats://10.0.0.1:4333"
    assert s.redis_prefix == "site-a"
    assert s.redis_url.startswith("redis://")


@pytest.mark.parametrize(
    ("env", "value", "needle"),
    [
        ("COLLM_NATS_URL", "http://x:1", "nats://"),
        ("COLLM_REDIS_URL", "mysql://x", "redis://"),
        ("COLLM_REDIS_PREFIX", "bad prefix!", "pattern"),
        ("COLLM_LOG_LEVEL", "LOUD", "DEBUG"),
        ("COLLM_METRICS_PORT", "70000", "65535"),
    ],
)
def test_invalid_values_say_what_to_change(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, needle: str
) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ValidationError) as err:
        CommonSettings()
    assert needle in str(err.value)


def test_settings_are_frozen() -> None:
    s = CommonSettings()
    with pytest.raises(ValidationError):
        s.nats_url = "nats://other:1"  # type: ignore[misc]
