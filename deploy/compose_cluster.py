"""The compose check's cluster mode (`make compose-check-cluster`, `deploy/compose_check.py --cluster`):
docker-compose.yml with the cluster overlay (deploy/cluster/docker-compose.cluster.yml) started on this
machine, a NATS node and the Redis primary lost under load.

The same images as the single-host check (compose_check.py builds them, or finds them cached), then
`docker compose -f docker-compose.yml -f deploy/cluster/docker-compose.cluster.yml up -d` as project
`collm-check-cluster`: three NATS nodes, the Redis primary, its replica and three Sentinels, three CPU
replicas. After every health check: the cluster formed (each node routed to the other two, JetStream's
meta group and every stream on three current peers, the Sentinels agreeing on the primary and its
replica), a streamed chat completion through the gateway, and a federated round publishing a version.
Then, with closed-loop chat completions (streamed and plain) running, `docker stop` of the NATS node
that holds the most CoLLM connections among nats-2 and nats-3 (`nats` is the node the base file's
services and its published ports name); fresh samples go in and a round must publish while the node is
down; `docker start` brings it back and it must rejoin (its routes, the meta group, every stream current
on three peers). Every request is counted: answered, a clear error the client may retry (5xx or 429
with an OpenAI error envelope, or an error event in the stream), a refusal or lost (neither allowed).
Then `docker stop` of the Redis primary: the Sentinels promote redis-replica, a round publishes through
it, and the old primary, started again, becomes its replica. Last every container's log is kept and
scanned for refused logins and permissions, then `docker compose down -v` and the single-host check's
cleanup.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import compose_check as cc

OVERLAY = cc.ROOT / "deploy" / "cluster" / "docker-compose.cluster.yml"
PROJECT = "collm-check-cluster"
NATS_NODES = {"nats": "nats-1", "nats-2": "nats-2", "nats-3": "nats-3"}  # service -> its server_name
VICTIMS = ("nats-2", "nats-3")  # nats publishes the host ports and is the base file's node: kept up
REDIS = ("redis", "redis-replica", "redis-sentinel-1", "redis-sentinel-2", "redis-sentinel-3")
STARTED = (*NATS_NODES, *REDIS, "aggregator", "coordinator", "replica-0", "replica-1", "replica-2", "gateway")
STREAMS = ("COLLM_SAMPLES", "COLLM_UPDATES")
GATEWAY_CONNECTION = "collm-gateway"  # the gateway's NATS connection name starts with it
SENTINEL_CLI = 'REDISCLI_AUTH="$(cat /run/secrets/redis_sentinel_password)" redis-cli -p 26379'
MASTER = "collm"  # the name the Sentinels monitor the primary under (redis-sentinel.sh)
RETRYABLE = frozenset({429, 500, 502, 503, 504})


# --- pure: what the nodes, the Sentinels and the answers say ----------------------------------------------
def route_peers(routez: dict[str, Any]) -> set[str]:
    """The servers a node has routes to (a pool of routes per peer: names, not the count)."""
    return {r["remote_name"] for r in routez.get("routes") or [] if r.get("remote_name")}


def meta_current(jsz: dict[str, dict[str, Any]], size: int) -> str | None:
    """JetStream's meta leader when its own view (node name -> /jsz) has `size` peers, all current."""
    for report in jsz.values():
        meta = report.get("meta_cluster") or {}
        leader = meta.get("leader")
        if leader in jsz and leader is not None:
            lead = jsz[leader].get("meta_cluster") or {}
            peers = lead.get("replicas") or []
            if lead.get("cluster_size") == size and len(peers) == size - 1:
                if all(p.get("current") and not p.get("offline") for p in peers):
                    return str(leader)
            return None
    return None


def streams_current(
    jsz: dict[str, dict[str, Any]], size: int, streams: tuple[str, ...]
) -> dict[str, str] | None:
    """Each stream's leader, when the leader's view (node name -> /jsz?accounts=true&streams=true) has
    `size - 1` other peers, all current; else None. Only the leader knows whether its peers are current."""
    views: dict[str, dict[str, dict[str, Any]]] = {}
    for node, report in jsz.items():
        for account in report.get("account_details") or []:
            for st in account.get("stream_detail") or []:
                views.setdefault(st["name"], {})[node] = st.get("cluster") or {}
    out = {}
    for name in streams:
        seen = views.get(name) or {}
        leader = next((c.get("leader") for c in seen.values() if c.get("leader")), None)
        own = seen.get(leader or "")
        if own is None or own.get("leader") != leader:
            return None
        peers = own.get("replicas") or []
        if len(peers) != size - 1 or not all(p.get("current") and not p.get("offline") for p in peers):
            return None
        out[name] = str(leader)
    return out


def pick_victim(connections: dict[str, list[str]], candidates: tuple[str, ...]) -> str:
    """The candidate node holding the gateway's connection, else the one with the most connections."""

    def rank(node: str) -> tuple[bool, int]:
        names = connections.get(node) or []
        return any(n.startswith(GATEWAY_CONNECTION) for n in names), len(names)

    return max(candidates, key=rank)


def sentinel_blocks(text: str) -> list[dict[str, str]]:
    """`redis-cli SENTINEL MASTER|REPLICAS <name>`'s reply, not on a terminal: a field name, then its
    value, a line each (an empty value an empty line); each instance's fields start with `name`."""
    lines = text.rstrip("\n").split("\n")
    blocks: list[dict[str, str]] = []
    for key, value in zip(lines[::2], lines[1::2], strict=False):
        if key == "name" or not blocks:
            blocks.append({})
        blocks[-1][key] = value
    return blocks


# Refusals that docs/operations.md documents as expected: a replica that creates an adapter's v1 may not
# announce it, and a replica started before the aggregator may not create the streams (it waits).
KNOWN_REFUSALS = (
    re.compile(r"collm\.v1\.adapters\.[^.\s\"]+\.published"),
    re.compile(r"\$JS\.API\.STREAM\.CREATE\."),
)


# How NATS (server and client) and Redis log a refused login, publish, subscription or command.
REFUSED = (
    "authorization violation",
    "permissions violation",
    "publish violation",
    "subscription violation",
    "noperm",
)


def log_problems(text: str) -> dict[str, list[str]]:
    """`docker compose logs` lines by what they show: a refused login, Redis command or NATS
    publish/subscribe (a wiring bug: a user, password or permission that does not match), one of the
    documented refusals, a NATS server error ([ERR]), a service's ERROR (the trace exporter's, with no
    Jaeger started, left out)."""
    out: dict[str, list[str]] = {
        "refused": [],
        "documented refusal": [],
        "nats [ERR]": [],
        "service ERROR": [],
    }
    for line in text.splitlines():
        low = line.lower()
        if any(w in low for w in REFUSED):
            known = "authorization" not in low and any(p.search(line) for p in KNOWN_REFUSALS)
            out["documented refusal" if known else "refused"].append(line)
        elif "[ERR]" in line:
            out["nats [ERR]"].append(line)
        elif '"level": "ERROR"' in line and "opentelemetry" not in line:
            out["service ERROR"].append(line)
    return out


def sse_data(raw: str) -> list[str]:
    return [ln[5:].strip() for ln in raw.splitlines() if ln.startswith("data:")]


def envelope(obj: Any) -> dict[str, Any] | None:
    """The OpenAI error envelope's `error`, when `obj` is one."""
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict) and obj["error"].get("message"):
        return dict(obj["error"])
    return None


def classify(status: int, raw: str, stream: bool) -> tuple[str, str]:
    """An answered request's outcome: ("ok" | "retryable" | "error" | "lost", code). `retryable` is a
    clear error the client may send again (an envelope with a 5xx or 429, or an error event in a stream
    that had started); `error` is a clear error it may not (any other status); `lost` is no answer."""
    if status != 200:
        try:
            err = envelope(json.loads(raw))
        except ValueError:
            err = None
        if err is None:
            return "lost", f"{status}, not an error envelope: {raw[:80]!r}"
        return ("retryable" if status in RETRYABLE else "error"), f"{status} {err.get('code')}"
    if not stream:
        try:
            data = json.loads(raw)
        except ValueError:
            return "lost", f"200, not JSON: {raw[:80]!r}"
        finish = ((data.get("choices") or [{}])[0]).get("finish_reason")
        return ("ok", "") if finish in ("stop", "length") else ("lost", f"200, finish_reason {finish}")
    events = sse_data(raw)
    for e in events:
        if e != "[DONE]" and (err := envelope(json.loads(e))) is not None:
            return "retryable", f"stream error event {err.get('code')}"
    if not events or events[-1] != "[DONE]":
        return "lost", "stream ended without [DONE]"
    finished = any(
        ch.get("finish_reason") in ("stop", "length")
        for e in events[:-1]
        for ch in json.loads(e).get("choices") or []
    )
    return ("ok", "") if finished else ("lost", "stream ended without a finish_reason")


@dataclass
class Outcome:
    sent: float
    end: float
    stream: bool
    kind: str
    code: str = ""


def tally(
    outcomes: list[Outcome], since: float = float("-inf"), until: float = float("inf")
) -> dict[str, int]:
    """Counts by kind of the requests sent in [since, until)."""
    out = {"sent": 0, "ok": 0, "retryable": 0, "error": 0, "lost": 0}
    for o in outcomes:
        if since <= o.sent < until:
            out["sent"] += 1
            out[o.kind] += 1
    return out


# --- the stack ----------------------------------------------------------------------------------------
def setup(run: cc.Run) -> list[tuple[str, Callable[[cc.Run, list[str]], None]]]:
    """Point the run at the overlay; the steps of the cluster check."""
    run.project = PROJECT
    run.files = (cc.ROOT / "docker-compose.yml", OVERLAY)
    run.services = STARTED
    run.before_down.append(keep_logs)
    steps = [s for s in cc.STEPS if s[1] not in (cc.kill_replica, cc.load_adapter)]
    up = next(i for i, s in enumerate(steps) if s[1] is cc.stack_up) + 1
    formed = ("cluster formed: NATS routes, meta group, R3 streams; Sentinels", cluster_formed)
    return [
        *steps[:up],
        formed,
        *steps[up:],
        ("NATS node stopped under load, restarted", node_loss),
        ("Redis primary stopped: Sentinel failover, restarted", redis_failover),
        ("logs: no refused login, publish or subscription", logs_clean),
    ]


def node_get(run: cc.Run, service: str, path: str) -> dict[str, Any]:
    """A NATS node's monitoring endpoint, read inside its container (only `nats` publishes 8222)."""
    res = run.compose("exec", "-T", service, "wget", "-qO-", f"http://127.0.0.1:8222{path}", capture=True)
    return dict(json.loads(res.stdout[res.stdout.index("{") :]))


def jsz_all(run: cc.Run, nodes: list[str], streams: bool = False) -> dict[str, dict[str, Any]]:
    path = "/jsz?accounts=true&streams=true" if streams else "/jsz"
    return {NATS_NODES[n]: node_get(run, n, path) for n in nodes}


def service_connections(connz: dict[str, Any]) -> list[str]:
    """The CoLLM services' connections on a node (by name; a health probe's has none and lasts a moment)."""
    names = (c.get("name") or "" for c in connz.get("connections") or [])
    return sorted(n for n in names if n.startswith("collm-"))


def connections(run: cc.Run, nodes: list[str]) -> dict[str, list[str]]:
    return {n: service_connections(node_get(run, n, "/connz?limit=1024")) for n in nodes}


def wait_until(probe: Callable[[], Any], timeout: float, what: str, every: float = 1.0) -> Any:
    t0 = time.monotonic()
    last: Exception | None = None
    while time.monotonic() - t0 < timeout:
        try:
            got = probe()
        except (cc.CheckFailed, ValueError, KeyError) as exc:  # a node not answering yet
            got, last = None, exc
        if got:
            return got
        time.sleep(every)
    raise cc.CheckFailed(f"{what}: not within {timeout:.0f} s{f' ({last})' if last else ''}")


def nats_formed(run: cc.Run, timeout: float) -> tuple[str, dict[str, str]]:
    """Every node routed to the other two, the meta group and every stream current on three peers."""
    nodes = list(NATS_NODES)

    def routed() -> bool:
        return all(
            route_peers(node_get(run, n, "/routez")) == set(NATS_NODES.values()) - {NATS_NODES[n]}
            for n in nodes
        )

    wait_until(routed, timeout, "every NATS node routed to the other two")
    meta = wait_until(lambda: meta_current(jsz_all(run, nodes), 3), timeout, "the meta group on 3 nodes")
    leaders = wait_until(
        lambda: streams_current(jsz_all(run, nodes, streams=True), 3, STREAMS), timeout, "R3 streams current"
    )
    return meta, leaders


def cluster_formed(run: cc.Run, detail: list[str]) -> None:
    meta, leaders = nats_formed(run, 120)
    detail.append(
        f"NATS: 3 nodes routed, meta leader {meta}, streams' leaders {leaders}, 3 current peers each"
    )
    fields: dict[str, str] = {}
    primary = ip_of(run, "redis")
    for n in (1, 2, 3):
        fields = sentinel(run, n, "MASTER")[0]
        if (
            fields.get("ip") != primary
            or fields.get("num-other-sentinels") != "2"
            or fields.get("num-slaves") != "1"
        ):
            raise cc.CheckFailed(f"redis-sentinel-{n} sees {fields}")
    detail.append(
        f"Redis: 3 Sentinels name the primary redis ({fields['ip']}:{fields['port']}), 1 replica, "
        f"quorum {fields['quorum']}"
    )


def sentinel(run: cc.Run, n: int, what: str) -> list[dict[str, str]]:
    """`SENTINEL <what> collm` asked of redis-sentinel-<n>."""
    cmd = f"{SENTINEL_CLI} SENTINEL {what} {MASTER}"
    return sentinel_blocks(
        run.compose("exec", "-T", f"redis-sentinel-{n}", "sh", "-c", cmd, capture=True).stdout
    )


def ip_of(run: cc.Run, service: str) -> str:
    """A service's address on the stack's network (the Sentinels know the Redis nodes by address)."""
    return cc.inspect(
        run, cc.container_of(run, service), "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
    )


def primary_everywhere(run: cc.Run, host: str) -> bool:
    return all(sentinel(run, n, "MASTER")[0].get("ip") == host for n in (1, 2, 3))


def replica_synced(run: cc.Run, host: str) -> bool:
    """Sentinel 1 sees `host` as a replica of the primary, its link up."""
    return any(
        r.get("ip") == host and r.get("flags") == "slave" and r.get("master-link-status") == "ok"
        for r in sentinel(run, 1, "REPLICAS")
    )


def redis_failover(run: cc.Run, detail: list[str]) -> None:
    """`docker stop` of the Redis primary: the Sentinels promote redis-replica, the services read and
    write through it (the versions list, a round publishing), and the old primary, started again,
    becomes its replica."""
    cid = cc.container_of(run, "redis")
    old, new = ip_of(run, "redis"), ip_of(run, "redis-replica")
    before = cc.latest_version(run, cc.ROUND_DOMAIN)
    t0 = time.monotonic()
    run.sh("docker", "stop", "-t", "10", cid, capture=True)
    wait_until(lambda: primary_everywhere(run, new), 90, "redis-replica promoted", 0.5)
    promoted_s = time.monotonic() - t0
    say(f"redis stopped; the 3 Sentinels name redis-replica the primary after {promoted_s:.1f} s")
    published = cc.wait_published(run, before, t0)
    pub_s = time.monotonic() - t0
    listed = len(cc.versions(run, cc.ROUND_DOMAIN))
    detail.append(
        f"`docker stop redis`: the 3 Sentinels name redis-replica after {promoted_s:.1f} s; "
        f"{cc.ROUND_DOMAIN}@v{published['version']} published {pub_s:.0f} s after the stop, "
        f"{listed} versions listed by the gateway"
    )
    t_up = time.monotonic()
    run.sh("docker", "start", cid, capture=True)
    cc.wait_healthy(run, ("redis",), run.args.health_timeout)
    wait_until(lambda: replica_synced(run, old), 90, "redis a replica of redis-replica", 0.5)
    detail.append(
        f"`docker start redis`: a replica of redis-replica, link up, after {time.monotonic() - t_up:.1f} s"
    )


class Load:
    """Closed-loop chat completions through the published port (streamed and plain in turn) in threads."""

    def __init__(self, run: cc.Run, workers: int = 2, max_tokens: int = 16) -> None:
        self.url = cc.gateway_url(run) + "/v1/chat/completions"
        self.max_tokens = max_tokens
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self.count = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.worker, daemon=True) for _ in range(workers)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)

    def worker(self) -> None:
        import httpx

        with httpx.Client(timeout=120) as http:
            while not self.stop.is_set():
                with self.lock:
                    i, self.count = self.count, self.count + 1
                self.outcomes.append(self.one(http, i, stream=i % 2 == 0))

    def one(self, http: Any, i: int, stream: bool) -> Outcome:
        import httpx

        body: dict[str, Any] = {
            "model": cc.BASE_MODEL,
            "messages": [{"role": "user", "content": f"Name a colour ({i})."}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        t0 = time.monotonic()
        try:
            with http.stream("POST", self.url, json=body) as resp:
                raw = "".join(resp.iter_text())
                kind, code = classify(resp.status_code, raw, stream)
        except (httpx.HTTPError, ValueError) as exc:
            kind, code = "lost", f"{type(exc).__name__}: {exc}"[:160]
        return Outcome(t0, time.monotonic(), stream, kind, code)


def node_loss(run: cc.Run, detail: list[str]) -> None:
    """With chat completions running: `docker stop` of a NATS node, samples in and a round published
    while it is down, `docker start`, and the node rejoins."""
    nodes = list(NATS_NODES)
    conns = connections(run, nodes)
    victim = pick_victim(conns, VICTIMS)
    on_victim = conns[victim]
    cid = cc.container_of(run, victim)
    before = cc.latest_version(run, cc.ROUND_DOMAIN)
    detail.append(f"{victim} held {len(on_victim)} connections ({', '.join(on_victim)})")
    with Load(run) as load:
        time.sleep(5)
        t_down = time.monotonic()
        run.sh("docker", "stop", "-t", "10", cid, capture=True)
        stopped_s = time.monotonic() - t_down
        others = [n for n in nodes if n != victim]
        wait_until(
            lambda: set(on_victim) <= {c for cs in connections(run, others).values() for c in cs},
            60,
            "the stopped node's clients on the other nodes",
            0.5,
        )
        reconnected_s = time.monotonic() - t_down
        say(f"{victim} stopped in {stopped_s:.1f} s; its clients reconnected after {reconnected_s:.1f} s")
        detail.append(
            f"`docker stop {victim}` took {stopped_s:.1f} s; its clients on the other nodes "
            f"{reconnected_s:.1f} s after the stop began"
        )
        stored = cc.store_samples(run, run.args.samples, run.args.samples)
        published = cc.wait_published(run, before, time.monotonic())
        t_pub = time.monotonic()
        say(f"{cc.ROUND_DOMAIN}@v{published['version']} published {t_pub - t_down:.0f} s after the stop")
        detail.append(
            f"{stored} while down; {cc.ROUND_DOMAIN}@v{published['version']} published "
            f"{t_pub - t_down:.0f} s after the stop (source {published.get('source')})"
        )
        state = cc.inspect(run, cid, "{{.State.Status}}")
        if state != "running":  # `restart: unless-stopped` leaves a stopped container stopped
            detail.append(f"{victim} still {state} (restart policy: a manual stop stays stopped)")
        t_up = time.monotonic()
        run.sh("docker", "start", cid, capture=True)
        cc.wait_healthy(run, (victim,), run.args.health_timeout)
        healthy_s = time.monotonic() - t_up
        meta, leaders = nats_formed(run, 120)
        rejoined_s = time.monotonic() - t_up
        jsz = node_get(run, victim, "/jsz")
        size = (jsz.get("meta_cluster") or {}).get("cluster_size")
        detail.append(
            f"`docker start`: healthy after {healthy_s:.1f} s; routed to both others, meta leader {meta}, "
            f"every stream current on 3 peers after {rejoined_s:.1f} s "
            f"(its /jsz: {jsz.get('streams')} streams, meta cluster size {size})"
        )
        time.sleep(5)  # the load goes on on the rejoined cluster
    outcomes = sorted(load.outcomes, key=lambda o: o.sent)
    everything, down = tally(outcomes), tally(outcomes, t_down, t_up)
    detail.append(f"completions: {everything}; sent while the node was down: {down}")
    bad = [o for o in outcomes if o.kind != "ok"]
    for o in bad[:10]:
        say(f"    {o.kind}: sent {o.sent - t_down:+.1f} s from the stop, {o.code}")
    if everything["lost"] or everything["error"]:
        raise cc.CheckFailed(f"requests lost or refused: {[(o.kind, o.code) for o in bad][:10]}")
    if not down["ok"]:
        raise cc.CheckFailed("no request answered while the node was down")


def keep_logs(run: cc.Run) -> str:
    """Every container's log, kept in the cache directory (also when a step failed: cleanup runs it)."""
    text = run.compose("logs", "--no-color", "--timestamps", capture=True).stdout
    (cc.CACHE / f"{PROJECT}.log").write_text(text)
    return text


def logs_clean(run: cc.Run, detail: list[str]) -> None:
    """Every container's log, kept; a refused login or permission fails the check, NATS [ERR] lines and
    service errors are reported (a stopped node's peers log its routes' errors)."""
    text = keep_logs(run)
    kept = cc.CACHE / f"{PROJECT}.log"
    found = log_problems(text)
    detail.append(
        f"{len(text.splitlines())} lines in {kept}: " + ", ".join(f"{len(v)} {k}" for k, v in found.items())
    )
    for kind, lines in found.items():
        for line in lines[:5]:
            say(f"{kind}: {line[:300]}")
    if found["refused"]:
        raise cc.CheckFailed(f"refused by NATS or Redis: {found['refused'][:3]}")


def say(msg: str) -> None:
    cc.say(f"    {msg}")
