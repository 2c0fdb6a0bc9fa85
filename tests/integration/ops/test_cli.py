"""The `collm` command (the installed entry point, as a subprocess) against the running stack."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from typing import Any

import pytest

from collm_common.store import AdapterStore
from collm_common.wire.rounds import RoundOutcome

from .conftest import ADAPTER, COLLM, OpsStack, wait_until

pytestmark = pytest.mark.integration


def ok(proc: subprocess.CompletedProcess[bytes]) -> str:
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return proc.stdout.decode()


def test_status_once_json_shows_every_replica_and_the_coordinators_decisions(
    ops: OpsStack, ops_round: RoundOutcome
) -> None:
    doc = json.loads(ok(ops.collm("status", "--once", "--json")))
    replicas = {r["replica_id"]: r for r in doc["replicas"]}
    assert set(replicas) == {"r0", "r1"} and doc["replica_errors"] == {} and doc["errors"] == {}
    for r in replicas.values():
        assert r["model"] == "tiny" and r["max_batch"] >= 1
        assert r["round_role"] in ("idle", "participant", "done")
        assert 0.0 <= r["ft_share"] <= 1.0 and r["ft_share_source"] in ("coordinator", "local_default")
        assert any(a["name"] == ADAPTER and a["version_id"].startswith(f"{ADAPTER}@v") for a in r["adapters"])
    coord = doc["coordinator"]
    assert coord["policy"] == "collm" and set(coord["live"]) == {"r0", "r1"}
    assert {d["replica_id"] for d in coord["fast"]["replicas"]} == {"r0", "r1"}
    assert all(d["reason"] and d["reason_code"] for d in coord["fast"]["replicas"])
    assert coord["slow"] is not None, "the coordinator has planned rounds"
    agg = doc["aggregator"]
    assert agg["last_round_id"] >= ops_round.round_id and sum(agg["rounds_by_state"].values()) >= 1
    gw = doc["gateway"]
    assert {r["replica_id"] for r in gw["replicas"] if r["fresh"]} == {"r0", "r1"}


def test_status_table_has_a_row_per_replica_and_the_decisions(ops: OpsStack, ops_round: RoundOutcome) -> None:
    text = ok(ops.collm("status", "--once"))
    header = next(line for line in text.splitlines() if line.startswith("REPLICA"))
    for column in ("LOAD", "QUEUE", "TTFT p99", "TPOT p99", "SLO", "FT SHARE", "ROUND", "ADAPTERS"):
        assert column in header
    rows = [line for line in text.splitlines() if line.startswith(("r0 ", "r1 "))]
    assert len(rows) == 2 and all(f"{ADAPTER}@v" in row for row in rows)
    assert "coordinator: policy collm" in text and "coordinator decisions:" in text
    assert "fast decision at" in text and "slow decision at" in text
    assert "aggregator: strategy product_svd" in text


def test_status_refreshes_until_interrupted(ops: OpsStack) -> None:
    proc = subprocess.Popen(
        [str(COLLM), "status", "--interval", "0.3", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**ops.env(), "PYTHONFAULTHANDLER": "1"},
        # As from a terminal: a test run started in the background (`make test &`) ignores SIGINT, and an
        # ignored signal stays ignored across exec, so Ctrl-C would never reach the command.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None
        frames = [json.loads(proc.stdout.readline()) for _ in range(3)]
        assert frames[0]["ts_unix_s"] < frames[1]["ts_unix_s"] < frames[2]["ts_unix_s"]
        assert all({r["replica_id"] for r in f["replicas"]} == {"r0", "r1"} for f in frames)
    finally:
        proc.send_signal(signal.SIGINT)
        # Keep reading until it exits: frames it writes meanwhile must not fill the pipe and block it.
        try:
            _out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler prints where every thread is stuck
            _out, err = proc.communicate(timeout=10)
            pytest.fail(f"collm status still running 10 s after SIGINT; its threads:\n{err.decode()[-8000:]}")
    assert proc.returncode == 0, err.decode()


async def store_versions(ops: OpsStack) -> tuple[int | None, dict[int, str]]:
    store = AdapterStore.from_url(ops.redis_url, ops.prefix)
    try:
        return await store.current(ADAPTER), {v.version: v.sha256 for v in await store.list_versions(ADAPTER)}
    finally:
        await store.close()


def test_adapters_list_and_versions_match_the_store(ops: OpsStack, ops_round: RoundOutcome) -> None:
    current, versions = asyncio.run(store_versions(ops))
    listed = {a["name"]: a for a in json.loads(ok(ops.collm("adapters", "list", "--json")))}
    assert listed[ADAPTER]["current"] >= (current or 0) and listed[ADAPTER]["versions"] >= len(versions)
    rows = json.loads(ok(ops.collm("adapters", "versions", ADAPTER, "--json")))
    by_version = {r["version"]: r for r in rows}
    assert all(by_version[v]["sha256"] == sha for v, sha in versions.items()), "immutable versions"
    assert sum(r["current"] for r in rows) == 1
    assert by_version[1]["source"] == "create"
    if ops_round.new_version is not None:
        published = by_version[ops_round.new_version]
        assert published["source"] == "round" and published["round_id"] == ops_round.round_id
        assert published["parent"] == ops_round.base_version
    text = ok(ops.collm("adapters", "list"))
    assert text.splitlines()[0].split()[:3] == ["ADAPTER", "CURRENT", "VERSIONS"] and f"{ADAPTER}@v" in text
    text = ok(ops.collm("adapters", "versions", ADAPTER))
    assert f"{ADAPTER}@v1" in text and "* " in text


def test_adapters_rollback_goes_through_the_aggregator(ops: OpsStack, ops_round: RoundOutcome) -> None:
    _, before = asyncio.run(store_versions(ops))
    info = json.loads(ok(ops.collm("adapters", "rollback", ADAPTER, "1", "--reason", "ops test", "--json")))
    assert info["version"] > max(before) and info["source"] == "rollback" and info["parent"] == 1
    assert info["sha256"] == before[1], "a rollback republishes v1's content as a new version"
    current, after = asyncio.run(store_versions(ops))
    assert {v: after[v] for v in before} == before, "no version was changed"
    assert current is not None and current >= info["version"]

    def serving() -> bool:
        doc = json.loads(ok(ops.collm("status", "--once", "--json")))
        return all(
            any(a["name"] == ADAPTER and a["version"] >= info["version"] for a in r["adapters"])
            for r in doc["replicas"]
        )

    wait_until(serving, 30, f"both replicas serving {info['version_id']} or newer")


def test_rounds_list_and_show(ops: OpsStack, ops_round: RoundOutcome) -> None:
    rounds = json.loads(ok(ops.collm("rounds", "list", "--adapter", ADAPTER, "--json")))["rounds"]
    mine = next(r for r in rounds if r["round_id"] == ops_round.round_id)
    assert mine["state"] == ops_round.state and sorted(mine["participants"]) == ["r0", "r1"]
    assert mine["policy"] == "collm", "planned by the coordinator"
    detail = json.loads(ok(ops.collm("rounds", "show", str(ops_round.round_id), "--json")))
    assert detail["outcome"]["round_id"] == ops_round.round_id
    assert sorted(p["replica_id"] for p in detail["plan"]["participants"]) == ["r0", "r1"]
    if ops_round.state == "published":
        assert sorted(u["update"]["replica_id"] for u in detail["updates"]) == ["r0", "r1"]
        assert detail["evals"]
    text = ok(ops.collm("rounds", "show", str(ops_round.round_id)))
    assert f"round {ops_round.round_id}: {ADAPTER}" in text and "PARTICIPANT" in text
    text = ok(ops.collm("rounds", "list"))
    assert text.splitlines()[0].split()[:3] == ["ROUND", "ADAPTER", "STATE"]


def test_micro_ls_lists_every_service(ops: OpsStack) -> None:
    # Answers gathered for 3 s, not the default half second: a replica busy on a loaded machine answers late.
    found: list[dict[str, Any]] = json.loads(ok(ops.collm("micro", "ls", "--json", "--timeout", "3")))
    assert {r["name"] for r in found} == {
        "collm-gateway",
        "collm-replica",
        "collm-coordinator",
        "collm-aggregator",
    }
    assert sorted(r["metadata"]["replica_id"] for r in found if r["name"] == "collm-replica") == ["r0", "r1"]


def test_errors_are_clear_and_exit_1(ops: OpsStack) -> None:
    proc = ops.collm("adapters", "versions", "no-such-adapter")
    assert proc.returncode == 1 and b"no-such-adapter" in proc.stderr
    proc = ops.collm("rounds", "show", "99999")
    assert proc.returncode == 1 and b"error:" in proc.stderr
    proc = ops.collm("adapters", "rollback", ADAPTER, "999")
    assert proc.returncode == 1 and b"error:" in proc.stderr


def test_health_probes_answer_like_the_compose_checks(ops: OpsStack) -> None:
    assert ops.collm("health", "micro", "collm-replica", "--meta", "replica_id=r1").returncode == 0
    assert ops.collm("health", "micro", "collm-replica", "--meta", "replica_id=r9").returncode == 1
    assert ops.collm("health", "micro", "collm-coordinator").returncode == 0
    assert ops.collm("health", "http", f"{ops.stack.gateway_url}/readyz").returncode == 0
    start = time.monotonic()
    assert ops.collm("health", "http", "http://127.0.0.1:9/readyz").returncode == 1
    assert time.monotonic() - start < 30
