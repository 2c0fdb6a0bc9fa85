"""A NATS cluster node lost under load: the stack on a three-node JetStream cluster (R3 streams) keeps
serving, storing samples and running a federated round while one node is down, and the node rejoins.

`nats_node_loss` finds the node that holds the gateway's NATS connection (the nodes' /connz), then,
with closed-loop completions (streamed and plain) and sample uploads running, SIGKILLs it. While it is
down a federated round runs to its end; then the node starts again (same port and store) and must
rejoin: three peers, and every stream's replicas current. Every accepted sample (HTTP 200 with its
stream sequence) must be in the samples stream under its id and reach its replica's local data, and no
upload may be refused (the gateway retries past the stream's leader election). A completion may fail,
with a clear error, only if it was in flight at the kill or sent within `RECONNECT_WINDOW_S` after it:
core NATS messages through the lost node (a token chunk, an acceptance) are gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import nats.errors
import nats.js.errors

from collm_common import subjects
from collm_common.bus import Bus
from collm_common.streams import STREAMS

from .harness import (
    CLIENT_TIMEOUT_S,
    GATEWAY_STALE_S,
    FaultStack,
    background_load,
    replica_status,
    wait_for,
)
from .report import FaultReport
from .rounds import RoundWatch, coordinator_stopped, ensure_adapter, open_round, verify_versions

ADMIN_KEY = "cluster-fault-admin"  # the gateway's COLLM_ADMIN_KEY in this stack (/v1/samples is admin)
# The gateway's connection moves to another node within about this long after its node dies (nats-py's
# reconnect wait is 0.5 s). A request can fail only if it was in flight at the kill or sent before the
# victim's clients had reconnected and the replicas' telemetry was fresh again: within this window, or
# within the measured reconnection plus the gateway's staleness limit on a machine too busy for it.
RECONNECT_WINDOW_S = 2.0
GATEWAY_CONNECTION = subjects.SERVICE_GATEWAY  # the gateway NATS connection name starts with it


@dataclass
class SampleLoad:
    """Samples uploaded one per request, alternating replicas: what the gateway accepted (id ->
    (stream, seq, replica)) and what it refused, with the envelope's code."""

    accepted: dict[str, tuple[str, int, str]] = field(default_factory=dict)
    refused: list[tuple[int, str, str]] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)


async def upload_samples(
    fs: FaultStack, stop: asyncio.Event, load: SampleLoad, every_s: float = 0.05
) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    i = 0
    async with httpx.AsyncClient(timeout=30.0) as http:
        while not stop.is_set():
            rid = fs.replicas[i % len(fs.replicas)]
            sid = f"cl-{uuid.uuid4().hex[:12]}"
            body = {
                "samples": [{"replica_id": rid, "prompt": f"q {i}", "response": f"a {i}", "sample_id": sid}]
            }
            try:
                r = await http.post(f"{fs.gateway_url}/v1/samples", json=body, headers=headers)
            except httpx.HTTPError as exc:
                load.lost.append(f"{sid}: {type(exc).__name__}")
            else:
                if r.status_code == 200:
                    ack = r.json()["data"][0]
                    load.accepted[sid] = (ack["stream"], int(ack["seq"]), rid)
                else:
                    err = r.json().get("error", {}) if "json" in r.headers.get("content-type", "") else {}
                    load.refused.append((r.status_code, str(err.get("code")), str(err.get("message"))[:200]))
            i += 1
            await asyncio.sleep(every_s)


async def connections_by_node(fs: FaultStack, skip: int | None = None) -> list[list[str]]:
    """The client connection names on each node (its /connz); none for node `skip`."""
    assert fs.nats_cluster is not None
    out = []
    async with httpx.AsyncClient(timeout=2.0) as http:
        for i, port in enumerate(fs.nats_cluster.http_ports):
            if i == skip:
                out.append([])
                continue
            r = await http.get(f"http://127.0.0.1:{port}/connz", params={"limit": 1024})
            out.append(sorted(c.get("name", "") for c in r.json().get("connections", [])))
    return out


async def moved_off(fs: FaultStack, names: list[str], victim: int) -> bool:
    """Every connection in `names` (those the victim node held) is on another node again."""
    elsewhere = {n for conns in await connections_by_node(fs, skip=victim) for n in conns}
    return set(names) <= elsewhere


async def cluster_current(bus: Bus, size: int) -> dict[str, Any] | None:
    """Each stream's leader and peers when every stream has `size` peers, all current and online;
    else None, also while the JetStream API does not answer (a stream-info request can time out, or
    find no responder, while the restarted node rejoins the cluster)."""
    out = {}
    for name in STREAMS:
        try:
            info = await bus.js.stream_info(name)
        except (
            nats.errors.TimeoutError,
            nats.errors.NoRespondersError,
            nats.js.errors.ServiceUnavailableError,
        ):
            return None
        c = info.cluster
        if c is None or c.leader is None:
            return None
        peers = c.replicas or []
        if len(peers) != size - 1 or not all(p.current and not p.offline for p in peers):
            return None
        out[name] = {"leader": c.leader, "peers": sorted(p.name for p in peers)}
    return out


async def stream_leaders(bus: Bus) -> dict[str, str | None]:
    out = {}
    for name in STREAMS:
        c = (await bus.js.stream_info(name)).cluster
        out[name] = c.leader if c else None
    return out


async def samples_in_stream(bus: Bus, accepted: dict[str, tuple[str, int, str]]) -> list[str]:
    """Ids of accepted samples that the stream does not hold at their acknowledged sequence."""
    missing = []
    for sid, (stream, seq, _rid) in accepted.items():
        try:
            msg = await bus.js.get_msg(stream, seq)
        except Exception:  # noqa: BLE001 - counted as missing, with its id
            missing.append(sid)
            continue
        if (msg.headers or {}).get("Nats-Msg-Id") != sid:
            missing.append(sid)
    return missing


async def nats_node_loss(
    fs: FaultStack, adapter: str = "clusterfault", before_s: float = 2.0, after_s: float = 2.0
) -> FaultReport:
    report = FaultReport("nats_node_loss")
    await fs.ensure_healthy()
    cluster = fs.nats_cluster
    assert cluster is not None, "nats_node_loss needs a FaultStack with nats_nodes=3"
    size = len(cluster.nodes)
    conns = await connections_by_node(fs)
    victim = next(i for i, names in enumerate(conns) if any(n.startswith(GATEWAY_CONNECTION) for n in names))
    report.details["victim"] = f"n{victim}"
    report.details["connections_on_victim"] = conns[victim]
    async with fs.bus("fault-cluster") as bus, fs.store() as store:
        report.details["stream_leaders_before"] = await stream_leaders(bus)
        samples0 = {
            rid: (st.local_samples if (st := await replica_status(bus, rid)) else 0) for rid in fs.replicas
        }
        async with coordinator_stopped(fs, bus):
            base = await ensure_adapter(fs, bus, store, adapter)
            watch = await RoundWatch().attach(bus)
            stop_samples = asyncio.Event()
            samples = SampleLoad()
            uploader = asyncio.create_task(upload_samples(fs, stop_samples, samples))
            try:
                async with background_load(fs, concurrency=2, max_tokens=16) as outcomes:
                    await asyncio.sleep(before_s)
                    on_victim = (await connections_by_node(fs))[victim]
                    t_down = time.monotonic()
                    await asyncio.to_thread(cluster.nodes[victim].kill)
                    # A federated round, opened once the victim's clients (the stack's services and this
                    # test's own connection) have reconnected elsewhere, and finished while it is down:
                    # a request sent while its sender reconnects can lose its reply, as on any NATS.
                    await wait_for(
                        lambda: moved_off(fs, on_victim, victim), 30, "clients reconnected elsewhere", 0.2
                    )
                    report.details["reconnected_s"] = round(time.monotonic() - t_down, 2)
                    opened = await open_round(
                        bus, adapter, base, dict.fromkeys(fs.replicas, 64), len(fs.replicas), 60
                    )
                    t_final, final = await wait_for(
                        lambda: watch.final(opened.round_id), 90, f"round {opened.round_id} to end"
                    )
                    await asyncio.sleep(after_s)
                    # The node stays down until a request sent after the kill is answered: a client whose
                    # request was in flight through the killed node waits out its timeout first (20 s),
                    # longer than a quick round.
                    with contextlib.suppress(AssertionError):
                        await wait_for(
                            lambda: any(o.kind == "ok" and o.sent_s >= t_down for o in outcomes),
                            2 * CLIENT_TIMEOUT_S,
                            "a request sent after the kill answered",
                            0.2,
                        )
                    t_up0 = time.monotonic()
                    await asyncio.to_thread(cluster.nodes[victim].restart)
                    current = None
                    with contextlib.suppress(AssertionError):
                        current = await wait_for(
                            lambda: cluster_current(bus, size), 30, "streams current on 3 nodes", 0.2
                        )
                    t_current = time.monotonic()
                    await asyncio.sleep(after_s)  # load keeps running on the rejoined cluster
            finally:
                stop_samples.set()
                await uploader
        after = await verify_versions(store, adapter)

        async def consumed() -> bool:
            for rid in fs.replicas:
                st = await replica_status(bus, rid)
                want = samples0[rid] + sum(1 for *_, r in samples.accepted.values() if r == rid)
                if st is None or st.local_samples < want:
                    return False
            return True

        all_consumed = True
        try:
            await wait_for(consumed, 30, "every accepted sample in its replica's local data", 0.2)
        except AssertionError:
            all_consumed = False
        samples1 = {
            rid: (st.local_samples if (st := await replica_status(bus, rid)) else 0) for rid in fs.replicas
        }
        missing = await samples_in_stream(bus, samples.accepted)
        conns_after = await connections_by_node(fs)
    report.add_outcomes(outcomes)
    during = [o for o in outcomes if t_down <= o.sent_s < t_up0]
    report.recovery_s = round(t_current - t_up0, 3) if current else None
    report.recovery_what = "node restarted -> every stream's 3 replicas current"
    report.details.update(
        node_down_s=round(t_up0 - t_down, 3),
        requests_while_down={"sent": len(during), "ok": sum(o.kind == "ok" for o in during)},
        round={
            "round_id": opened.round_id,
            "state": final.state,
            "reason": final.reason,
            "new_version": final.new_version,
            "ended_while_down": t_final < t_up0,
            "s_after_node_loss": round(t_final - t_down, 3),
        },
        versions_broken=after["broken"],
        samples={
            "accepted": len(samples.accepted),
            "refused": samples.refused[:10],
            "refused_count": len(samples.refused),
            "no_answer": samples.lost[:10],
            "missing_in_stream": missing[:10],
            "local_samples_before": samples0,
            "local_samples_after": samples1,
        },
        streams_after=current,
        connections_after=[len(c) for c in conns_after],
    )
    failed = [o for o in outcomes if o.kind != "ok"]
    report.details["failed_requests"] = [
        {"sent_s": round(o.sent_s - t_down, 3), "ended_s": round(o.end_s - t_down, 3), "code": o.code}
        for o in failed
    ]  # seconds after the kill
    report.check("no request lost", report.lost == 0)
    window_s = max(RECONNECT_WINDOW_S, report.details["reconnected_s"] + GATEWAY_STALE_S)
    report.details["failure_window_s"] = round(window_s, 2)
    report.check(
        "a request fails only if in flight at the kill or sent before its clients had reconnected",
        all(o.end_s >= t_down and o.sent_s <= t_down + window_s for o in failed),
    )
    report.check("requests served while the node was down", any(o.kind == "ok" for o in during))
    report.check("no sample upload without an answer", not samples.lost)
    report.check("no sample refused", not samples.refused)
    report.check("every accepted sample in the stream under its id", not missing)
    report.check("every accepted sample in its replica's local data", all_consumed)
    report.check("samples accepted while the node was down", len(samples.accepted) > 0)
    report.check(
        "the round published while the node was down", final.state == "published" and t_final < t_up0
    )
    report.check("every stored version verifies", not after["broken"])
    report.check("the node rejoined: 3 peers, every stream current", current is not None)
    report.check("no process died", not fs.failed_children())
    return report
