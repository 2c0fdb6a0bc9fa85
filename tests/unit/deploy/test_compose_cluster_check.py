"""The compose check's cluster mode (deploy/compose_cluster.py), its pure parts: what the NATS nodes'
monitoring endpoints and the Sentinels say, which node is stopped, how each answer of the load is
counted, and the steps the mode runs. The payloads have the shapes nats-server 2.15 answers with."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
sys.path.insert(0, str(DEPLOY))

import compose_check as cc  # noqa: E402
import compose_cluster as cl  # noqa: E402

pytestmark = pytest.mark.unit


def peer(name: str, current: bool = True) -> dict[str, Any]:
    return {"name": name, "current": current, "active": 1_000_000, "peer": name.upper()}


def meta(leader: str, peers: list[dict[str, Any]], size: int = 3) -> dict[str, Any]:
    return {"meta_cluster": {"name": "collm", "leader": leader, "replicas": peers, "cluster_size": size}}


def stream(name: str, leader: str, peers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "cluster": {"name": "collm", "leader": leader, "replicas": peers}}


def jsz(*streams: dict[str, Any]) -> dict[str, Any]:
    return {"account_details": [{"name": "COLLM", "stream_detail": list(streams)}]}


def test_route_peers_are_names_not_the_pool_of_routes() -> None:
    routez = {"num_routes": 6, "routes": [{"remote_name": n} for n in ("nats-2", "nats-3") * 3]}
    assert cl.route_peers(routez) == {"nats-2", "nats-3"}
    assert cl.route_peers({"num_routes": 0, "routes": None}) == set()


def test_meta_group_current_only_in_its_leaders_view() -> None:
    views = {
        "nats-1": meta("nats-2", [peer("nats-2"), peer("nats-3", current=False)]),
        "nats-2": meta("nats-2", [peer("nats-1"), peer("nats-3")]),
        "nats-3": meta("nats-2", [peer("nats-1", current=False), peer("nats-2")]),
    }
    assert cl.meta_current(views, 3) == "nats-2"
    views["nats-2"] = meta("nats-2", [peer("nats-1"), peer("nats-3", current=False)])
    assert cl.meta_current(views, 3) is None
    # The leader not among the nodes asked (it is the stopped one): nothing is known yet.
    assert cl.meta_current({"nats-1": meta("nats-3", [peer("nats-3")])}, 3) is None
    assert cl.meta_current({"nats-1": meta("nats-1", [peer("nats-2")], size=2)}, 3) is None


def test_streams_current_from_each_leaders_view() -> None:
    views = {
        "nats-1": jsz(
            stream("COLLM_SAMPLES", "nats-3", [peer("nats-2", False), peer("nats-3")]),
            stream("COLLM_UPDATES", "nats-1", [peer("nats-2"), peer("nats-3")]),
        ),
        "nats-3": jsz(stream("COLLM_SAMPLES", "nats-3", [peer("nats-1"), peer("nats-2")])),
    }
    assert cl.streams_current(views, 3, cl.STREAMS) == {"COLLM_SAMPLES": "nats-3", "COLLM_UPDATES": "nats-1"}
    lagging = {
        **views,
        "nats-3": jsz(stream("COLLM_SAMPLES", "nats-3", [peer("nats-1"), peer("nats-2", False)])),
    }
    assert cl.streams_current(lagging, 3, cl.STREAMS) is None
    two_peers = {"nats-1": jsz(stream("COLLM_SAMPLES", "nats-1", [peer("nats-2")]))}
    assert cl.streams_current(two_peers, 3, ("COLLM_SAMPLES",)) is None
    assert cl.streams_current({"nats-1": jsz()}, 3, ("COLLM_SAMPLES",)) is None  # not created yet


def test_the_node_stopped_holds_the_gateway_else_the_most_connections() -> None:
    conns = {
        "nats": ["collm-gateway-gw0", "collm-replica-r0"],
        "nats-2": ["collm-aggregator", "collm-replica-r1", "collm-coordinator"],
        "nats-3": ["collm-replica-r2"],
    }
    assert cl.pick_victim(conns, cl.VICTIMS) == "nats-2"  # `nats` is never a candidate
    conns["nats-3"].append("collm-gateway-gw0")
    assert cl.pick_victim(conns, cl.VICTIMS) == "nats-3"


def test_service_connections_leave_out_the_health_probes() -> None:
    connz = {
        "connections": [{"name": "collm-replica-r0"}, {"cid": 9}, {"name": ""}, {"name": "collm-gateway-gw0"}]
    }
    assert cl.service_connections(connz) == ["collm-gateway-gw0", "collm-replica-r0"]


LOG = [
    "nats-2-1  | [1] [ERR] Error trying to connect to route (attempt 1): lookup nats-3",
    'gateway-1  | {"level": "WARNING", "msg": "nats: Permissions Violation for Publish to x.y"}',
    "nats-1  | [1] [ERR] 172.18.0.9:4222 - cid:7 - authorization violation",
    'coordinator-1  | {"level": "ERROR", "logger": "opentelemetry.exporter", "msg": "Failed"}',
    'aggregator-1  | {"level": "ERROR", "logger": "collm_aggregator", "msg": "round 3 failed"}',
    "redis-1  | -NOPERM this user has no permissions to run the 'role' command",
    'replica-0-1  | {"level": "WARNING", "msg": "nats: Permissions Violation for Publish to '
    '\\"collm.v1.adapters.customer_support.published\\""}',
    'replica-2-1  | {"msg": "nats: Permissions Violation for Publish to '
    '\\"$JS.API.STREAM.CREATE.COLLM_SAMPLES\\""}',
    'replica-0-1  | {"level": "INFO", "msg": "nats reconnected"}',
    'nats-2-1  | [ERR] 172.18.0.14:40712 - cid:35 - "collm-replica-r0" - "$G/user:replica-r0" - Publish '
    'Violation - Subject "collm.v1.adapters.customer_support.published"',
    'nats-3-1  | [ERR] 172.18.0.2:4711 - cid:9 - "collm-gateway" - Subscription Violation - Subject "x.>"',
]


def test_log_problems_sorts_refusals_from_errors() -> None:
    got = cl.log_problems("\n".join(LOG))
    assert {k: len(v) for k, v in got.items()} == {
        "refused": 4,
        "documented refusal": 3,
        "nats [ERR]": 1,
        "service ERROR": 1,
    }
    assert "round 3 failed" in got["service ERROR"][0]


def test_sentinel_replies_in_blocks() -> None:
    master = "name\ncollm\nip\nredis\nport\n6379\nnum-slaves\n1\nnum-other-sentinels\n2\nquorum\n2\n"
    got = cl.sentinel_blocks(master)
    assert len(got) == 1 and got[0]["ip"] == "redis" and got[0]["num-other-sentinels"] == "2"
    replicas = (
        "name\nredis:6379\nip\nredis\nflags\nslave\nmaster-link-status\nok\n"
        "name\nredis-replica:6379\nip\nredis-replica\nrunid\n\nflags\ns_down,slave,disconnected\n"
    )
    got = cl.sentinel_blocks(replicas)
    assert [b["ip"] for b in got] == ["redis", "redis-replica"]
    assert got[1]["runid"] == "" and got[1]["flags"] == "s_down,slave,disconnected"  # an empty value
    assert cl.sentinel_blocks("") == []


def sse(*events: dict[str, Any] | str) -> str:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)


CHUNK = {"choices": [{"delta": {"content": "Blue"}, "finish_reason": None}]}
LAST = {"choices": [{"delta": {}, "finish_reason": "length"}]}
ERROR = {"error": {"message": "lost a token chunk", "type": "server_error", "code": "replica_protocol_error"}}


@pytest.mark.parametrize(
    ("status", "raw", "stream", "kind"),
    [
        (
            200,
            json.dumps({"choices": [{"message": {"content": "Blue"}, "finish_reason": "stop"}]}),
            False,
            "ok",
        ),
        (200, sse(CHUNK, LAST, "[DONE]"), True, "ok"),
        (503, json.dumps(ERROR), False, "retryable"),
        (429, json.dumps(ERROR), True, "retryable"),
        (200, sse(CHUNK, ERROR, "[DONE]"), True, "retryable"),
        (400, json.dumps(ERROR), False, "error"),
        (502, "<html>Bad Gateway</html>", False, "lost"),
        (200, sse(CHUNK), True, "lost"),  # cut off: no [DONE]
        (200, sse(CHUNK, "[DONE]"), True, "lost"),  # no finish_reason
        (200, json.dumps({"choices": [{"message": {}, "finish_reason": None}]}), False, "lost"),
        (200, "not json", False, "lost"),
    ],
)
def test_every_answer_is_classified(status: int, raw: str, stream: bool, kind: str) -> None:
    assert cl.classify(status, raw, stream)[0] == kind


def test_tally_counts_the_requests_sent_in_a_window() -> None:
    outs = [
        cl.Outcome(1.0, 2.0, True, "ok"),
        cl.Outcome(5.0, 6.0, False, "retryable", "503 no_replica"),
        cl.Outcome(6.0, 7.0, True, "ok"),
        cl.Outcome(9.0, 9.5, False, "lost", "ReadTimeout"),
    ]
    assert cl.tally(outs) == {"sent": 4, "ok": 2, "retryable": 1, "error": 0, "lost": 1}
    assert cl.tally(outs, 5.0, 9.0) == {"sent": 2, "ok": 1, "retryable": 1, "error": 0, "lost": 0}


def test_setup_points_the_run_at_the_overlay(tmp_path: Path) -> None:
    run = cc.Run(argparse.Namespace(), tmp=tmp_path)  # (its default is a fresh temporary directory)
    steps = [name for name, _ in cl.setup(run)]
    assert run.project == "collm-check-cluster"
    assert [f.name for f in run.files] == ["docker-compose.yml", "docker-compose.cluster.yml"]
    assert {"nats-2", "nats-3", "redis-replica", "redis-sentinel-3", "replica-2"} <= set(run.services)
    assert (
        steps.index("docker compose up -d, health checks")
        < steps.index(steps[-6])
        < steps.index("federated round")
    )
    assert run.before_down == [cl.keep_logs]
    assert steps[-3].startswith("NATS node stopped") and steps[-2].startswith("Redis primary stopped")
    assert steps[-1].startswith("logs:")
    assert "replica killed, restarted by the policy" not in steps
    # Every service the overlay defines (the GPU replicas aside) is started and waited for.
    text = cl.OVERLAY.read_text()
    for svc in run.services:
        assert f"\n  {svc}:\n" in text or svc in ("replica-0", "replica-1") or svc in cc.STARTED
    # configure_stack writes a secret file for every secret of both files.
    assert "REPLICA_2_METRICS_PORT" in cc.PORT_VARS and "${REPLICA_2_METRICS_PORT" in text
