"""API keys (hashing, files, the CLI), the token bucket with an injected clock, and tenant filtering."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from collm_common.clock import VirtualClock
from collm_gateway import keys
from collm_gateway.auth import Authenticator, Principal, can_use_adapter
from collm_gateway.errors import APIError
from collm_gateway.keys import ApiKeySpec, hash_key, parse_keys, read_keys_file, write_keys_file
from collm_gateway.ratelimit import RateLimiter, TokenBucket, default_burst, retry_after_s
from collm_gateway.settings import GatewaySettings

pytestmark = pytest.mark.unit

ACME = "sk-acme-key"
OPS = "sk-ops-key"


def settings(**kw: object) -> GatewaySettings:
    return GatewaySettings(**kw)  # type: ignore[arg-type]


# --- hashing and key files ----------------------------------------------------------------------------------
def test_keys_are_sha256_hex_and_mappings_are_validated() -> None:
    assert hash_key("abc") == hashlib.sha256(b"abc").hexdigest()
    parsed = parse_keys({hash_key(ACME).upper(): {"tenant": "acme", "rate_limit_rps": 2}})
    assert parsed == {hash_key(ACME): ApiKeySpec(tenant="acme", rate_limit_rps=2)}
    with pytest.raises(ValueError, match="sha256"):
        parse_keys({ACME: {"tenant": "acme"}})  # a plain key is refused: keys are stored hashed
    with pytest.raises(ValueError):
        parse_keys({hash_key(ACME): {"tenant": "bad tenant!"}})
    with pytest.raises(ValueError):
        parse_keys({hash_key(ACME): {"admin": True, "unknown": 1}})
    with pytest.raises(ValueError):
        settings(api_keys={"0" * 63: {}})


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_key_file_round_trip_never_holds_the_key(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"keys{suffix}"
    write_keys_file(path, {hash_key(ACME): ApiKeySpec(tenant="acme", burst=3)})
    text = path.read_text()
    assert ACME not in text and hash_key(ACME) in text
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_keys_file(path) == {hash_key(ACME): ApiKeySpec(tenant="acme", burst=3)}
    if suffix == ".json":
        assert json.loads(text) == {hash_key(ACME): {"tenant": "acme", "burst": 3}}
    (tmp_path / "empty.yaml").write_text("")
    assert read_keys_file(tmp_path / "empty.yaml") == {}
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(ValueError, match="mapping"):
        read_keys_file(tmp_path / "list.yaml")


def test_cli_add_prints_the_key_once_and_stores_its_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.yaml"
    assert keys.main(["add", "--file", str(path), "--tenant", "acme", "--rate-limit-rps", "5"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith(keys.KEY_PREFIX) and len(key) > 40
    stored = read_keys_file(path)
    assert stored == {hash_key(key): ApiKeySpec(tenant="acme", rate_limit_rps=5)}
    assert key not in path.read_text()
    assert keys.main(["add", "--file", str(path), "--admin"]) == 0
    admin_key = capsys.readouterr().out.strip()
    assert admin_key != key and read_keys_file(path)[hash_key(admin_key)].admin
    assert keys.main(["hash", key]) == 0
    assert capsys.readouterr().out.strip() == hash_key(key)
    assert keys.main(["list", "--file", str(path)]) == 0
    listing = capsys.readouterr().out
    assert hash_key(key)[:12] in listing and key not in listing
    assert keys.main(["remove", "--file", str(path), hash_key(key)[:12]]) == 0
    assert set(read_keys_file(path)) == {hash_key(admin_key)}
    assert keys.main(["remove", "--file", str(path), "zz"]) == 1
    assert keys.main(["add", "--file", str(path), "--tenant", "no spaces"]) == 1
    assert set(read_keys_file(path)) == {hash_key(admin_key)}


# --- token bucket ---------------------------------------------------------------------------------------
def test_token_bucket_allows_a_burst_then_the_rate() -> None:
    b = TokenBucket.full(rate_per_s=2.0, burst=3, now_s=0.0)
    assert [b.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(0.0) == pytest.approx(0.5)  # one token every 0.5 s
    assert b.take(0.25) == pytest.approx(0.25)
    assert b.take(0.5) == 0.0
    assert b.take(0.5) > 0
    assert b.take(100.0) == 0.0 and b.tokens == pytest.approx(2.0)  # refill caps at burst
    # A clock stepping back never mints tokens: two left, then none until 100 s is passed again.
    assert b.take(50.0) == 0.0 and b.take(50.0) == 0.0
    assert b.take(50.0) > 0
    assert b.take(100.5) == 0.0
    with pytest.raises(ValueError):
        TokenBucket.full(0.0, 1, 0.0)


def test_rate_limiter_keeps_one_bucket_per_key_and_follows_changed_limits() -> None:
    lim = RateLimiter()
    assert lim.take("a", 1.0, 1, 0.0) == 0.0
    assert lim.take("a", 1.0, 1, 0.0) == pytest.approx(1.0)
    assert lim.take("b", 1.0, 1, 0.0) == 0.0  # another key has its own bucket
    # New limits for "a" do not hand it a fresh burst.
    assert lim.take("a", 1.0, 5, 0.1) > 0
    assert lim.take("a", 1.0, 5, 1.2) == 0.0
    lim.forget_except({"a"})
    assert lim.take("b", 1.0, 1, 0.1) == 0.0  # forgotten: starts full again
    assert default_burst(0.5) == 1 and default_burst(2.5) == 3
    assert retry_after_s(0.01) == 1 and retry_after_s(1.2) == 2


# --- authenticator --------------------------------------------------------------------------------------
def test_open_mode_accepts_any_key_and_every_adapter() -> None:
    auth = Authenticator(settings(), VirtualClock())
    assert not auth.keys_required and "open" in auth.describe()
    p = auth.authenticate("anything")
    assert p.open_access and not p.is_admin and p.key_id == hash_key("anything")[:12]
    assert auth.authenticate(None).open_access
    assert can_use_adapter(p, "acme") and can_use_adapter(p, None)
    with pytest.raises(APIError) as err:  # no admin key configured: admin endpoints are refused
        auth.require_admin(p)
    assert err.value.status == 403 and "no admin key is configured" in err.value.message


def test_open_mode_admin_endpoints_need_the_admin_key() -> None:
    auth = Authenticator(settings(admin_key=OPS), VirtualClock())
    assert not auth.keys_required
    assert auth.require_admin(auth.authenticate(OPS)).is_admin
    with pytest.raises(APIError) as err:
        auth.require_admin(auth.authenticate(None))
    assert err.value.status == 401 and err.value.headers["WWW-Authenticate"] == "Bearer"
    with pytest.raises(APIError) as err:
        auth.require_admin(auth.authenticate("guess"))
    assert err.value.status == 403


def test_an_empty_admin_key_is_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # compose's shipped `collm_admin_key` secret file is empty: no admin key, admin endpoints stay 403.
    (tmp_path / "collm_admin_key").write_text("\n")
    monkeypatch.setenv("COLLM_SECRETS_DIR", str(tmp_path))
    monkeypatch.delenv("COLLM_ADMIN_KEY", raising=False)
    auth = Authenticator(GatewaySettings(), VirtualClock())
    with pytest.raises(APIError) as err:
        auth.require_admin(auth.authenticate(""))
    assert err.value.status == 403
    (tmp_path / "collm_admin_key").write_text(OPS + "\n")
    auth = Authenticator(GatewaySettings(), VirtualClock())
    assert auth.require_admin(auth.authenticate(OPS)).is_admin


def test_keys_mode_maps_keys_to_tenants_and_refuses_the_rest() -> None:
    s = settings(
        api_keys={
            hash_key(ACME): {"tenant": "acme"},
            hash_key("sk-globex"): {"tenant": "globex", "rate_limit_rps": 1, "burst": 2},
        },
        admin_key=OPS,
        rate_limit_rps=100,
    )
    clock = VirtualClock()
    auth = Authenticator(s, clock)
    assert auth.keys_required and "required (2 keys" in auth.describe()
    acme = auth.authenticate(ACME)
    assert acme == Principal(tenant="acme", key_id=hash_key(ACME)[:12])
    for token, status in ((None, 401), ("sk-unknown", 401)):
        with pytest.raises(APIError) as err:
            auth.authenticate(token)
        assert err.value.status == status and err.value.body()["error"]["code"] == "invalid_api_key"
    with pytest.raises(APIError) as err:
        auth.require_admin(acme)
    assert err.value.status == 403
    admin = auth.authenticate(OPS)
    assert auth.require_admin(admin) is admin and admin.tenant is None
    # globex: its own limit (1/s, burst 2), then 429 with Retry-After
    auth.authenticate("sk-globex")
    auth.authenticate("sk-globex")
    with pytest.raises(APIError) as err:
        auth.authenticate("sk-globex")
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "1"
    assert err.value.body()["error"]["type"] == "rate_limit_error"
    clock.advance(1.0)
    assert auth.authenticate("sk-globex").tenant == "globex"
    # acme has no limit of its own: the default 100/s with a burst of 100
    for _ in range(100):
        auth.authenticate(ACME)
    with pytest.raises(APIError):
        auth.authenticate(ACME)


def test_keys_file_is_reloaded_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    with pytest.raises(ValueError, match="does not exist"):
        settings(api_keys_file=path)
    path.write_text("not: [valid")
    with pytest.raises(ValueError, match="YAML"):
        settings(api_keys_file=path)
    write_keys_file(path, {})
    clock = VirtualClock()
    auth = Authenticator(settings(api_keys_file=path, api_keys_reload_s=1.0), clock)
    assert auth.keys_required and not auth.admin_configured  # a named file turns keys on even empty
    with pytest.raises(APIError):
        auth.authenticate(ACME)
    write_keys_file(path, {hash_key(ACME): ApiKeySpec(tenant="acme"), hash_key(OPS): ApiKeySpec(admin=True)})
    with pytest.raises(APIError):
        auth.authenticate(ACME)  # not re-read before api_keys_reload_s
    clock.advance(1.0)
    assert auth.authenticate(ACME).tenant == "acme" and auth.admin_configured
    path.write_text("{not yaml: [")  # a broken edit keeps the last good keys
    clock.advance(1.0)
    assert auth.authenticate(ACME).tenant == "acme"


def test_tenant_filtering() -> None:
    acme = Principal(tenant="acme", key_id="k")
    nobody = Principal(key_id="k2")
    admin = Principal(is_admin=True, key_id="k3")
    assert can_use_adapter(acme, None) and can_use_adapter(acme, "acme")
    assert not can_use_adapter(acme, "globex")
    assert can_use_adapter(nobody, None) and not can_use_adapter(nobody, "acme")
    assert can_use_adapter(admin, "globex")
