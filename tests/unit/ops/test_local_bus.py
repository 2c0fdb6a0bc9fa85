"""The closed local bus (collm_ops.local_bus): the users of deploy/nats/auth.conf with this run directory's
passwords, private files, passwords kept across runs, and each child of the launcher logged in as its
own user (collm_ops.launcher.Stack.child_envs), without starting anything."""

from __future__ import annotations

import io
import json
import os
import re
import stat
from pathlib import Path

import pytest

from collm_ops import local_bus, nats_auth
from collm_ops.launcher import ReplicaSpec, Stack, StackConfig

pytestmark = pytest.mark.unit


def test_the_server_config_has_the_users_and_permissions_of_deploy_nats() -> None:
    ids = ("r0", "r1", "r2")
    users = nats_auth.users(ids)
    passwords = {u.name: local_bus.new_password() for u in users}
    text = local_bus.server_config(passwords, ids, nats_auth.AGGREGATOR_CONSUMER)
    # deploy/nats/auth.conf's block (variables for passwords) is this one with each variable in place
    # of its password: the same users, the same subject permissions.
    shipped = nats_auth.render_authorization(users)
    block = text[text.index("authorization {") :]
    for u in users:
        block = block.replace(f'password: "{passwords[u.name]}"', f"password: ${u.password_var}")
    assert block == shipped
    assert "$NATS_PASSWORD" not in text[text.index("authorization {") :]
    # Replica r1 may publish its own telemetry and no other.
    r1 = next(u for u in users if u.name == "replica-r1")
    assert "collm.v1.telemetry.replica.r1" in r1.publish
    assert not any(s.startswith("collm.v1.telemetry.") and s.endswith(("r0", "r2", "*")) for s in r1.publish)


def test_passwords_are_kept_completed_and_renewed_when_malformed() -> None:
    made = iter(["pnew1aaaaaaaaaaaaaaaa", "pnew2aaaaaaaaaaaaaaaa"])
    good = local_bus.new_password()
    out = local_bus.complete_passwords(
        {"gateway": good, "coordinator": "bad pw", "replica-r9": good}, ["gateway", "coordinator", "admin"],
        lambda: next(made),
    )  # fmt: skip
    assert out == {
        "gateway": good,
        "coordinator": "pnew1aaaaaaaaaaaaaaaa",
        "admin": "pnew2aaaaaaaaaaaaaaaa",
        "replica-r9": good,  # a replica not started this time keeps its login
    }
    assert re.fullmatch(r"p[0-9a-f]{32}", local_bus.new_password())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_prepare_writes_private_files_and_keeps_passwords_across_runs(tmp_path: Path) -> None:
    first = local_bus.prepare(tmp_path, ["r0"], "nats://127.0.0.1:4999")
    d = tmp_path / local_bus.DIR_NAME
    assert first.directory == d and mode(d) == 0o700
    files = sorted(p.name for p in d.iterdir())
    assert files == ["credentials.json", "nats.conf", "operator.env"]
    assert all(mode(d / f) == 0o600 for f in files)
    assert set(first.passwords) == {u.name for u in nats_auth.users(["r0"])}
    assert json.loads((d / "credentials.json").read_text()) == first.passwords

    second = local_bus.prepare(tmp_path, ["r0", "r1"], "nats://127.0.0.1:4999")
    assert {k: second.passwords[k] for k in first.passwords} == first.passwords
    assert "replica-r1" in second.passwords and "user: replica-r1" in second.config_path.read_text()
    assert all(mode(d / f) == 0o600 for f in files)

    env = dict(
        line.removeprefix("export ").split("=", 1)
        for line in second.operator_env_path.read_text().splitlines()
        if line.startswith("export ")
    )
    admin = second.passwords["admin"]
    assert env == {
        "NATS_URL": "nats://127.0.0.1:4999",
        "NATS_USER": "admin",
        "NATS_PASSWORD": admin,
        "COLLM_NATS_URL": "nats://127.0.0.1:4999",
        "COLLM_NATS_USER": "admin",
        "COLLM_NATS_PASSWORD": admin,
    }


def test_each_child_logs_in_as_its_own_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("COLLM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("COLLM_NATS_USER", "admin")  # an operator's sourced login is not inherited
    monkeypatch.setenv("COLLM_NATS_PASSWORD", "operator-secret")
    log = io.StringIO()
    cfg = StackConfig(
        nats_url="nats://127.0.0.1:4333",
        replicas=[ReplicaSpec("r0", env={"COLLM_NATS_USER": "gateway"}), ReplicaSpec("r1")],
        run_dir=tmp_path,
    )
    stack = Stack(cfg, log_sink=log)
    stack.local_bus = local_bus.prepare(tmp_path, ["r0", "r1"], cfg.nats_url)
    envs = {name: env for name, _module, env in stack.child_envs()}
    want = {
        "aggregator": "aggregator",
        "coordinator": "coordinator",
        "replica-r0": "replica-r0",
        "replica-r1": "replica-r1",
        "gateway": "gateway",
    }
    assert {n: e["COLLM_NATS_USER"] for n, e in envs.items()} == want
    pw = stack.local_bus.passwords
    assert all(e["COLLM_NATS_PASSWORD"] == pw[want[n]] for n, e in envs.items())
    assert stack.nats_login == ("admin", pw["admin"])
    s = stack.operator_settings()
    assert (s.nats_user, s.nats_password, s.nats_url) == ("admin", pw["admin"], cfg.nats_url)
    assert not any(p in log.getvalue() for p in pw.values())


def test_without_a_local_bus_children_keep_the_configured_login(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in [k for k in os.environ if k.startswith("COLLM_")]:
        monkeypatch.delenv(key)
    cfg = StackConfig(
        replicas=[ReplicaSpec("r0", env={"COLLM_NATS_USER": "replica-r0", "COLLM_NATS_PASSWORD": "y"})],
        run_dir=tmp_path,
        nats_user="ops",
        nats_password="x",
    )
    stack = Stack(cfg)
    envs = {name: env for name, _module, env in stack.child_envs()}
    assert stack.local_bus is None and stack.nats_login == ("ops", "x")
    assert envs["replica-r0"]["COLLM_NATS_USER"] == "replica-r0"
    assert envs["replica-r0"]["COLLM_NATS_PASSWORD"] == "y"
    assert not any("COLLM_NATS_USER" in envs[n] for n in ("aggregator", "coordinator", "gateway"))


def test_collm_up_closes_its_own_bus_unless_told_open(tmp_path: Path) -> None:
    from collm_ops.cli import build_parser, stack_config

    base = ["up", "--no-demo", "--run-dir", str(tmp_path)]
    assert stack_config(build_parser().parse_args(base)).closed_bus is True
    assert stack_config(build_parser().parse_args([*base, "--open-bus"])).closed_bus is False


def test_collm_up_divides_the_cpus_among_its_replicas_unless_told_the_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from collm_ops import cli
    from collm_ops.stack_config import default_torch_threads

    assert [default_torch_threads(n, 2) for n in (1, 2, 3)] == [2, 1, 1]
    assert default_torch_threads(2, 16) == 8
    monkeypatch.setattr(cli, "usable_cpus", lambda: 4)
    base = ["up", "--no-demo", "--run-dir", str(tmp_path)]
    assert cli.stack_config(cli.build_parser().parse_args([*base, "--replicas", "1"])).torch_threads == 4
    assert cli.stack_config(cli.build_parser().parse_args([*base, "--replicas", "2"])).torch_threads == 2
    told = [*base, "--replicas", "1", "--torch-threads", "1"]
    assert cli.stack_config(cli.build_parser().parse_args(told)).torch_threads == 1
