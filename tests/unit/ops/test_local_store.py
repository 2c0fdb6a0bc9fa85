"""The closed local store's files (`collm_ops.local_store`): the ACL users of deploy/redis/users.acl with
the run directory's passwords, and the operator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collm_ops import local_store

pytestmark = pytest.mark.unit


def test_render_acl_drops_comments_and_refuses_a_missing_value() -> None:
    template = "# a comment\n\nuser a on >${P} ~${X}:*\n"
    assert local_store.render_acl(template, {"P": "pw", "X": "collm"}) == "user a on >pw ~collm:*\n"
    with pytest.raises(ValueError, match="P is not set"):
        local_store.render_acl(template, {"X": "collm"})
    with pytest.raises(ValueError, match="P is not set"):
        local_store.render_acl(template, {"P": "a b", "X": "collm"})


def test_prepare_writes_every_compose_user_and_the_operator_and_keeps_passwords(tmp_path: Path) -> None:
    url = "redis://127.0.0.1:6390/0"
    store = local_store.prepare(tmp_path, url, "pfx")
    acl = store.acl_path.read_text()
    users = {line.split()[1] for line in acl.splitlines()}
    assert users == {*local_store.PASSWORD_VARS, local_store.OPERATOR_USER}
    assert "~pfx:*" in acl and "${" not in acl and "#" not in acl
    assert f"user collm-admin on >{store.passwords['collm-admin']} ~* &* +@all" in acl
    for path in (store.acl_path, store.operator_env_path, store.directory / local_store.CREDENTIALS_FILE):
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert store.directory.stat().st_mode & 0o777 == 0o700
    assert store.service_env("coordinator") == {
        "COLLM_REDIS_URL": "redis://collm-reader@127.0.0.1:6390/0",
        "COLLM_REDIS_PASSWORD": store.passwords["collm-reader"],
    }
    assert (
        "export COLLM_REDIS_URL=redis://collm-admin@127.0.0.1:6390/0\n" in store.operator_env_path.read_text()
    )
    again = local_store.prepare(tmp_path, url, "pfx")
    assert again.passwords == store.passwords
    assert (
        json.loads((tmp_path / local_store.DIR_NAME / local_store.CREDENTIALS_FILE).read_text())
        == store.passwords
    )
