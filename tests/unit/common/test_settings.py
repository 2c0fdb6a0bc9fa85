from pathlib import Path

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


def test_secrets_come_from_files_in_the_secrets_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "collm_nats_password").write_text("nats-secret\n")
    (tmp_path / "collm_redis_password").write_text("p@ss/word\n")
    monkeypatch.setenv("COLLM_REDIS_URL", "redis://collm-gateway@redis:6379/0")
    monkeypatch.delenv("COLLM_NATS_PASSWORD", raising=False)
    assert CommonSettings().nats_password is None  # no secrets dir: no files read
    monkeypatch.setenv("COLLM_SECRETS_DIR", str(tmp_path))
    s = CommonSettings()
    assert s.nats_password == "nats-secret"
    # The Redis password goes into the URL (quoted), and redis-py reads it back as it was.
    assert s.redis_url == "redis://collm-gateway:p%40ss%2Fword@redis:6379/0"
    from redis.connection import parse_url

    assert parse_url(s.redis_url)["password"] == "p@ss/word"
    # A URL built from these settings passes through them again unchanged (the `collm` CLI does that).
    assert CommonSettings(redis_url=s.redis_url).redis_url == s.redis_url
    monkeypatch.setenv("COLLM_NATS_PASSWORD", "from-env")
    assert CommonSettings().nats_password == "from-env", "a variable that is set wins over the file"


def test_a_url_with_another_redis_password_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLLM_REDIS_URL", "redis://u:one@redis:6379/0")
    monkeypatch.setenv("COLLM_REDIS_PASSWORD", "two")
    with pytest.raises(ValidationError, match="give one"):
        CommonSettings()
