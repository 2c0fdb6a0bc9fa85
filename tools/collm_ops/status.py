"""`collm status`: one view of the cluster, built from what the services themselves answer.

`gather_status(bus)` asks, concurrently and each with a timeout, the coordinator, aggregator and gateway
for their status endpoints, and for its telemetry (`subjects.replica(id, "status")`) every replica that
answers `$SRV.PING.collm-replica` or that the gateway sees fresh or the coordinator live (a replica busy
enough to answer the ping late still has its row, or its error). A service that does not answer is
reported as such (its error kept), never fatal: the view of a half-broken cluster is what an operator
needs most.
`render_status` (pure) turns a `ClusterStatus` into the text table; `status_document` into JSON.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collm_common import subjects
from collm_common.bus import Bus, BusError
from collm_common.wire.admin import AggregatorStatus, StatusRequest
from collm_common.wire.control import CoordinatorDecisions, CoordinatorStatus, CoordinatorStatusRequest
from collm_common.wire.gateway import GatewayStatus, GatewayStatusRequest
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_ops.table import ms, num, pct, render_table, when


@dataclass
class ClusterStatus:
    ts_unix_s: float
    replicas: list[ReplicaTelemetry] = field(default_factory=list)
    replica_errors: dict[str, str] = field(default_factory=dict)
    coordinator: CoordinatorStatus | None = None
    aggregator: AggregatorStatus | None = None
    gateway: GatewayStatus | None = None
    errors: dict[str, str] = field(default_factory=dict)  # service -> why it gave no status
    # A local `collm up`'s supervision.json (its processes, NATS and Redis included), when there is one.
    supervision: dict[str, Any] | None = None


def read_supervision(run_dir: Path) -> dict[str, Any] | None:
    """`<run_dir>/supervision.json` as the launcher wrote it; None when absent or unreadable."""
    try:
        doc = json.loads((run_dir / "supervision.json").read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def supervision_lines(doc: dict[str, Any] | None) -> list[str]:
    """One line per supervised process: pid, restarts and last exit; crash loops first."""
    if not doc:
        return []
    services = doc.get("services") or {}
    looping = set(doc.get("crash_looping") or [])
    out = [
        f"processes (launcher pid {doc.get('launcher_pid')}, supervising: {bool(doc.get('supervising'))}):"
    ]
    for name in sorted(services, key=lambda n: (n not in looping, n)):
        e = services[name] or {}
        state = "CRASH LOOP" if name in looping else ("running" if e.get("pid") else "down")
        last = f", last exit {e['last_exit']}" if e.get("last_exit") else ""
        out.append(f"  {name}: {state}, pid {e.get('pid') or '-'}, restarts {e.get('restarts', 0)}{last}")
    return out


async def discover(bus: Bus, service: str, timeout_s: float) -> list[dict[str, Any]]:
    """Every NATS micro instance of `service` that answers `$SRV.PING.<service>` within `timeout_s`."""
    inbox = bus.nc.new_inbox()
    found: list[dict[str, Any]] = []

    async def on_msg(msg: Any) -> None:
        if msg.data:
            found.append(json.loads(msg.data))

    sub = await bus.nc.subscribe(inbox, cb=on_msg)
    try:
        await bus.nc.publish(f"$SRV.PING.{service}", b"", reply=inbox)
        await bus.nc.flush()
        await asyncio.sleep(timeout_s)
    finally:
        await sub.unsubscribe()
    return found


async def _ask(bus: Bus, subject: str, msg: Any, reply: type[Any], timeout_s: float) -> Any:
    try:
        return await bus.request(subject, msg, reply, timeout_s=timeout_s)
    except BusError as exc:
        return exc


async def gather_status(bus: Bus, timeout_s: float = 1.0) -> ClusterStatus:
    """The cluster as its services describe themselves now (see module docstring)."""
    services = asyncio.gather(
        _ask(bus, subjects.coordinator("status"), CoordinatorStatusRequest(), CoordinatorStatus, timeout_s),
        _ask(bus, subjects.aggregator("status"), StatusRequest(), AggregatorStatus, timeout_s),
        _ask(bus, subjects.gateway("status"), GatewayStatusRequest(), GatewayStatus, timeout_s),
    )
    pings = await discover(bus, subjects.SERVICE_REPLICA, min(timeout_s, 0.5))
    out = ClusterStatus(ts_unix_s=time.time())
    for name, ans in zip(("coordinator", "aggregator", "gateway"), await services, strict=True):
        if isinstance(ans, BusError):
            out.errors[name] = "not running" if ans.code == 503 else f"{ans.code}: {ans.message}"
        else:
            setattr(out, name, ans)
    ids = {str(p.get("metadata", {}).get("replica_id")) for p in pings} - {"None"}
    if out.gateway is not None:
        ids |= {r.replica_id for r in out.gateway.replicas if r.fresh}
    if out.coordinator is not None:
        ids |= set(out.coordinator.live)
    rids = sorted(ids)
    status = StatusRequest()
    answers = await asyncio.gather(
        *(_ask(bus, subjects.replica(rid, "status"), status, ReplicaTelemetry, timeout_s) for rid in rids)
    )
    for rid, ans in zip(rids, answers, strict=True):
        if isinstance(ans, ReplicaTelemetry):
            out.replicas.append(ans)
        else:
            out.replica_errors[rid] = f"{ans.code}: {ans.message}"
    return out


def status_document(s: ClusterStatus) -> dict[str, Any]:
    """JSON-able form of `s` (the wire messages as they are, plus the errors)."""

    def dump(m: Any) -> Any:
        return m.model_dump(mode="json") if m is not None else None

    return {
        "ts_unix_s": s.ts_unix_s,
        "replicas": [dump(r) for r in s.replicas],
        "replica_errors": s.replica_errors,
        "coordinator": dump(s.coordinator),
        "aggregator": dump(s.aggregator),
        "gateway": dump(s.gateway),
        "errors": s.errors,
        "supervision": s.supervision,
    }


# --- rendering ------------------------------------------------------------------------------------------
def _adapters(t: ReplicaTelemetry) -> str:
    if not t.adapters:
        return "-"
    parts = []
    for a in sorted(t.adapters, key=lambda a: a.name):
        flags = "".join(("T" if a.training else "", f"{a.in_flight}r" if a.in_flight else ""))
        parts.append(a.version_id + (f"[{flags}]" if flags else ""))
    return " ".join(parts)


def _round(t: ReplicaTelemetry) -> str:
    if t.round_role == "idle":
        return "idle"
    return f"{t.round_role}#{t.round_id}" if t.round_id is not None else t.round_role


def _share(t: ReplicaTelemetry) -> str:
    source = "coord" if t.ft_share_source == "coordinator" else "local"
    return f"{t.ft_share:.2f} {source}"


def replica_rows(s: ClusterStatus) -> list[list[object]]:
    rows: list[list[object]] = []
    for t in sorted(s.replicas, key=lambda t: t.replica_id):
        jobs = ",".join(f"{j.adapter}:{j.state}" for j in t.training_jobs) or "-"
        rows.append(
            [
                t.replica_id,
                f"{t.running}/{t.max_batch}",
                t.queue_len,
                pct(t.kv_used_frac),
                ms(t.ttft_ms_p99),
                ms(t.tpot_ms_p99),
                pct(t.slo_attainment),
                _share(t),
                f"{t.ft_tokens_per_s:.0f}",
                jobs,
                _round(t),
                _adapters(t),
            ]
        )
    for rid, err in sorted(s.replica_errors.items()):
        rows.append([rid, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", f"no answer ({err})"])
    return rows


REPLICA_HEADERS = (
    "REPLICA", "LOAD", "QUEUE", "KV", "TTFT p99", "TPOT p99", "SLO", "FT SHARE", "FT tok/s", "JOBS", "ROUND",
    "ADAPTERS (T training, Nr in flight)",
)  # fmt: skip


def _decisions(d: CoordinatorDecisions | None, label: str) -> list[str]:
    if d is None:
        return [f"  {label}: none yet"]
    head = f"  {label} decision at {when(d.ts_unix_s)} ({d.policy})"
    if d.note:
        head += f": {d.note}"
    lines = [head]
    for r in sorted(d.replicas, key=lambda r: r.replica_id):
        code = f"[{r.reason_code}] " if r.reason_code else ""
        lines.append(
            f"    {r.replica_id}: share {r.ft_share:.2f}, weight {r.routing_weight:.2f}, {code}{r.reason}"
        )
    return lines


def render_status(s: ClusterStatus) -> str:
    out = [f"CoLLM cluster at {when(s.ts_unix_s)} UTC"]
    g = s.gateway
    if g is not None:
        fresh = sum(1 for r in g.replicas if r.fresh)
        out.append(
            f"gateway {g.gateway_id}: base model {g.base_model}, {g.in_flight} in flight, "
            f"{fresh}/{len(g.replicas)} replicas fresh, routing weights factor {g.weights_factor:.2f}"
        )
    else:
        out.append(f"gateway: {s.errors.get('gateway', 'no answer')}")
    c = s.coordinator
    if c is not None:
        agg = {None: "unknown", True: "reachable", False: "UNREACHABLE"}[c.aggregator_available]
        out.append(
            f"coordinator: policy {c.policy}, live {','.join(c.live) or '-'}, "
            f"stale {','.join(c.stale) or '-'}, attainment {pct(c.attainment)} (target {pct(c.target)}, "
            f"attainable {pct(c.attainable)}), "
            f"virtual queue {num(c.virtual_queue)}, headroom {num(c.headroom)}, spend {num(c.spend)}, "
            f"demand {num(c.demand)} "
            f"replicas, aggregator {agg}"
        )
    else:
        out.append(f"coordinator: {s.errors.get('coordinator', 'no answer')}")
    a = s.aggregator
    if a is not None:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(a.rounds_by_state.items())) or "none"
        out.append(
            f"aggregator: strategy {a.strategy}, last round {a.last_round_id}, rounds: {counts}"
            + (", built-in plans on" if a.default_plan else "")
        )
        for r in a.active:
            out.append(
                f"  round {r.round_id} ({r.adapter} from v{r.base_version}) {r.state}: "
                f"{len(r.received)}/{len(r.participants)} updates (quorum {r.quorum}), "
                f"deadline {when(r.deadline_unix_s)}"
            )
    else:
        out.append(f"aggregator: {s.errors.get('aggregator', 'no answer')}")
    out.append("")
    if s.replicas or s.replica_errors:
        out.append(render_table(REPLICA_HEADERS, replica_rows(s)))
    else:
        out.append("no replica answers $SRV.PING.collm-replica")
    if c is not None:
        out.append("")
        out.append("coordinator decisions:")
        out += _decisions(c.fast, "fast")
        out += _decisions(c.slow, "slow")
        for r in c.rounds:
            who = ", ".join(f"{p.replica_id} {p.token_budget} tok" for p in r.participants) or "-"
            rid = f"#{r.round_id} " if r.round_id is not None else ""
            out.append(
                f"  planned round {rid}{r.adapter} from v{r.base_version}: {r.state}, expected gain "
                f"{r.expected_gain:.3f}, {who}" + (f" ({r.reason})" if r.reason else "")
            )
        for note in c.notes:
            out.append(f"  note: {note}")
    out += supervision_lines(s.supervision)
    return "\n".join(out)
