"""Faults of the serving path: a replica SIGKILLed under load (1), the NATS server restarting (2), the
coordinator down (5). Each returns a `FaultReport` (see scenarios.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import httpx

from collm_common import subjects
from collm_common.bus import Bus
from collm_common.wire import encode
from collm_common.wire.adapters import TrainingSample
from collm_common.wire.rounds import LocalUpdate

from .harness import (
    CLIENT_TIMEOUT_S,
    FT_SHARE_DEFAULT,
    GATEWAY_STALE_S,
    REQUEST_DEADLINE_S,
    ROUTING_TTL_S,
    SHARE_TTL_S,
    FaultStack,
    gateway_retries,
    gateway_status,
    metric,
    replica_status,
    wait_for,
)
from .probe import Outcome, one_request, run_load
from .report import FaultReport

# A stream whose answer began this recently has most of its tokens still to come (256 of them here).
FRESH_STREAM_S = 0.05
# How long the killer waits for the victim's first answer, then for a stream just begun on it.
KILL_WAIT_S = 20.0


# --- 1. a replica is SIGKILLed under load ----------------------------------------------------------------
async def replica_kill(
    fs: FaultStack,
    victim: str = "r0",
    concurrency: int = 8,
    duration_s: float = 6.0,
    kill_at_s: float = 2.0,
    max_tokens: int = 256,
) -> FaultReport:
    """Concurrent streamed and plain requests over two replicas; `victim` is SIGKILLed `kill_at_s` in.

    Requests it had not accepted go to the other replica (retried), and so do those it had accepted
    without a token yet; requests it was generating end with a clear error (an SSE error event then
    [DONE], or a 503 envelope) as soon as the gateway sees its telemetry stop; nothing hangs, nothing is
    lost. Then the victim is restarted by hand (no supervision here; see supervision.py) and must serve
    again."""
    report = FaultReport("replica_kill")
    await fs.ensure_healthy()
    retries0 = await gateway_retries(fs)
    kill_at: list[float] = []
    live: dict[int, tuple[str | None, float]] = {}
    waiting: dict[int, tuple[str | None, float]] = {}  # accepted, no token yet: moved, not failed

    served_ok: dict[str, int] = {}

    def count(o: Outcome) -> None:
        if o.kind == "ok" and o.replica is not None:
            served_ok[o.replica] = served_ok.get(o.replica, 0) + 1

    async def killer() -> None:
        await asyncio.sleep(kill_at_s)
        # Kill once the victim has served a request (the load runs on both replicas: a slow replica may
        # need longer than `kill_at_s` for its first), while a stream on it has just begun (so that the
        # mid-stream path is exercised every time: a stream seen near its end may finish before the kill).
        await wait_for(
            lambda: served_ok.get(victim, 0) > 0, KILL_WAIT_S, f"a request served by {victim}", 0.01
        )

        def fresh_stream() -> bool:
            now = time.monotonic()
            return any(
                r == victim and now - t < FRESH_STREAM_S and i not in waiting
                for i, (r, t) in list(live.items())
            )

        await wait_for(fresh_stream, KILL_WAIT_S, f"a stream just begun on {victim}", 0.005)
        kill_at.append(time.monotonic())
        report.details["victim_exit_code"] = await asyncio.to_thread(fs.s.kill, f"replica-{victim}")

    # The load runs until `duration_s - kill_at_s` after the kill, however long the kill takes to come (on
    # a loaded machine the victim's first answer can take longer than `duration_s`): new streams must
    # still be starting when the killer looks for one.
    stop = asyncio.Event()
    load = asyncio.create_task(
        run_load(
            fs.gateway_url,
            fs.base_model,
            concurrency=concurrency,
            duration_s=kill_at_s + 2 * KILL_WAIT_S + duration_s,
            max_tokens=max_tokens,
            timeout_s=CLIENT_TIMEOUT_S,
            stop=stop,
            live=live,
            waiting=waiting,
            on_outcome=count,
        )
    )
    try:
        await killer()
        await asyncio.sleep(max(0.0, duration_s - kill_at_s))
    finally:
        stop.set()
        outcomes = await load
    t_kill = kill_at[0]
    report.add_outcomes(outcomes)
    report.retried = int(await gateway_retries(fs) - retries0)
    in_flight = [o for o in outcomes if o.sent_s < t_kill < o.end_s]
    errors = [o for o in outcomes if o.kind == "error"]
    after = [o for o in outcomes if o.sent_s > t_kill]
    report.details.update(
        in_flight_at_kill=len(in_flight),
        in_flight_on_victim=sum(o.replica == victim for o in in_flight),
        max_in_flight_latency_s=round(max((o.latency_s for o in in_flight), default=0.0), 3),
        error_codes=sorted({str(o.code) for o in errors}),
        error_messages=sorted({o.message for o in errors})[:5],
        lost_messages=sorted({o.message for o in outcomes if o.kind == "lost"})[:5],
        sent_after_kill=len(after),
        ok_after_kill=sum(o.kind == "ok" for o in after),
        served_by={r: sum(o.replica == r for o in outcomes if o.kind == "ok") for r in fs.replicas},
        max_latency_s=round(max((o.latency_s for o in outcomes), default=0.0), 3),
    )
    # Requests in flight on the other replica are not affected by the kill and end whenever their tokens
    # are done; recovery is about those the victim was generating (an error may not say which replica it
    # was on). One the victim had accepted without a token yet is moved and generated whole by the other
    # replica, which already serves all the load: its end says how long that took, not the recovery
    # (it is counted by "nothing lost" and "every request sent after the kill succeeded" as any other).
    on_victim = [o for o in in_flight if o.replica in (victim, None) and not o.moved]
    if on_victim:
        report.recovery_s = max(o.end_s for o in on_victim) - t_kill
    report.recovery_what = "kill -> every request the victim was generating at the kill ended (clear error)"
    report.check("nothing lost", report.lost == 0)
    report.check("no request hung past its deadline", all(o.latency_s < REQUEST_DEADLINE_S for o in outcomes))
    report.check("a stream was in progress on the victim at the kill", bool(errors))
    report.check("errors only for requests in flight at the kill", all(o.sent_s < t_kill for o in errors))
    report.check(
        "errors say the replica was lost",
        all(o.code == "replica_lost" or victim in o.message for o in errors),
    )
    report.check(
        "in-flight requests on the victim end within the staleness limit (+1.5 s)",
        report.recovery_s is None or report.recovery_s <= GATEWAY_STALE_S + 1.5,
    )
    report.check("every request sent after the kill succeeded", all(o.kind == "ok" for o in after))
    report.check("the load really ran on both replicas", all(report.details["served_by"].values()))
    report.check("no other process died", set(fs.dead_children()) == {f"replica-{victim}"})

    # Restart: the victim serves again (fresh in the gateway, and a request lands on it).
    t0 = time.monotonic()
    await asyncio.to_thread(fs.s.restart, f"replica-{victim}")
    async with httpx.AsyncClient() as http:
        await wait_for(lambda: _fresh(fs, http, victim), 120, f"{victim} fresh after its restart")
        report.details["restart_to_fresh_s"] = round(time.monotonic() - t0, 3)
        hits: list[Outcome] = []

        async def lands_on_victim() -> bool:
            o = await one_request(http, fs.gateway_url, fs.base_model, stream=False, max_tokens=4)
            hits.append(o)
            return o.kind == "ok" and o.replica == victim

        await wait_for(lands_on_victim, 30, f"a request served by {victim}")
        report.details["restart_to_serving_s"] = round(time.monotonic() - t0, 3)
        report.add_outcomes(hits)
        report.check("after the restart every probe succeeded", all(o.kind == "ok" for o in hits))
    return report


async def _fresh(fs: FaultStack, http: httpx.AsyncClient, rid: str) -> bool:
    return rid in await fs.fresh_replicas(http)


# --- 2. the NATS server restarts ------------------------------------------------------------------------
async def nats_restart(
    fs: FaultStack, down_s: float = 3.0, probe_every_s: float = 0.25, crash: bool = False
) -> FaultReport:
    """nats-server stops (SIGTERM; `crash`: SIGKILL) for `down_s`, then starts on the same port with the same
    JetStream store. While it is down the gateway must answer 503 with Retry-After at once; after it is
    back every service must serve again within 5 s: the gateway (a completion), each service's NATS
    status endpoint, and both JetStream consumers (a replica's samples, the aggregator's updates)."""
    report = FaultReport("nats_crash" if crash else "nats_restart")
    await fs.ensure_healthy()
    assert fs.nats is not None
    rid = fs.replicas[0]
    async with fs.bus("fault-nats-before") as bus:
        st = await replica_status(bus, rid)
        samples0 = st.local_samples if st else 0
    rejected0 = await metric(
        fs.metrics_url("aggregator"), "collm_aggregator_rejected_updates_total", reason="unknown_round"
    )
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient() as http:
        # A long stream running across the outage must end (answer or clear error), never hang.
        long_stream = asyncio.create_task(
            one_request(
                http, fs.gateway_url, fs.base_model, stream=True, max_tokens=450, timeout_s=CLIENT_TIMEOUT_S
            )
        )
        await asyncio.sleep(0.5)
        t_down = time.monotonic()
        await asyncio.to_thread(fs.nats.kill if crash else fs.nats.stop)
        during: list[Outcome] = []
        i = 0
        while time.monotonic() - t_down < down_s:
            during.append(
                await one_request(
                    http, fs.gateway_url, fs.base_model, stream=i % 2 == 0, timeout_s=10, index=i
                )
            )
            i += 1
            await asyncio.sleep(probe_every_s)
        t_up0 = time.monotonic()
        await asyncio.to_thread(fs.nats.restart)
        t_up = time.monotonic()
        report.details["nats_start_s"] = round(t_up - t_up0, 3)
        back = await _time_services_back(fs, http, t_up, rid, samples0, rejected0)
        stream_outcome = await long_stream
    outcomes = [*during, stream_outcome]
    report.add_outcomes(outcomes)
    report.details.update(
        during_outage={
            "requests": len(during),
            "statuses": sorted({str(o.status) for o in during}),
            "codes": sorted({str(o.code) for o in during}),
            "max_latency_s": round(max((o.latency_s for o in during), default=0.0), 3),
            "with_retry_after": sum(o.retry_after is not None for o in during),
        },
        long_stream={
            "kind": stream_outcome.kind,
            "code": stream_outcome.code,
            "message": stream_outcome.message,
        },
        back_after_s={k: (round(v, 3) if v is not None else None) for k, v in back.items()},
    )
    done = [v for v in back.values() if v is not None]
    report.recovery_s = max(done) if len(done) == len(back) else None
    report.recovery_what = "NATS up -> the last service serving again"
    report.check("nothing lost", report.lost == 0)
    report.check(
        "503 with Retry-After while NATS is down",
        bool(during) and all(o.status == 503 and o.retry_after is not None for o in during),
    )
    report.check("answers while down are quick (< 1 s)", all(o.latency_s < 1.0 for o in during))
    report.check("the stream across the outage ended clearly", stream_outcome.kind in ("ok", "error"))
    report.check(
        "every service serving again within 5 s", report.recovery_s is not None and report.recovery_s <= 5.0
    )
    report.check("no process died", not fs.failed_children())
    return report


async def _time_services_back(
    fs: FaultStack, http: httpx.AsyncClient, t_up: float, rid: str, samples0: int, rejected0: float
) -> dict[str, float | None]:
    """Seconds from `t_up` until each service serves again (None: not within 15 s)."""
    back: dict[str, float | None] = {}
    limit_s = 15.0

    async def gateway() -> None:
        async def ok() -> bool:
            o = await one_request(
                http, fs.gateway_url, fs.base_model, stream=False, max_tokens=4, timeout_s=5
            )
            return o.kind == "ok"

        with contextlib.suppress(AssertionError):
            await wait_for(ok, limit_s, "a completion", interval_s=0.05)
            back["gateway_completion"] = time.monotonic() - t_up

    async with fs.bus("fault-nats-after") as bus:

        async def answering(name: str) -> None:
            async def ok() -> bool:
                return (await fs.answering(bus, 0.5)).get(name, False)

            with contextlib.suppress(AssertionError):
                await wait_for(ok, limit_s, f"{name} status", interval_s=0.05)
                back[name] = time.monotonic() - t_up

        async def samples_consumer() -> None:
            sample = TrainingSample(
                sample_id=f"nats-{uuid.uuid4().hex[:8]}", replica_id=rid, prompt="after the restart",
                response="a sample", domain="med",
            )  # fmt: skip
            with contextlib.suppress(AssertionError):
                await wait_for(
                    lambda: _js_publish(bus, subjects.samples(rid), encode(sample)), limit_s, "JS ack"
                )

                async def got() -> bool:
                    st = await replica_status(bus, rid, 0.5)
                    return st is not None and st.local_samples > samples0

                await wait_for(got, limit_s, "the sample to be consumed")
                back[f"replica-{rid}_samples_consumer"] = time.monotonic() - t_up

        async def updates_consumer() -> None:
            upd = LocalUpdate(
                round_id=987654321, adapter="nats-probe", replica_id=rid, base_version=1,
                blob_key="none", sha256="0" * 64, num_samples=1, num_tokens=1,
            )  # fmt: skip
            with contextlib.suppress(AssertionError):
                await wait_for(
                    lambda: _js_publish(bus, subjects.update(987654321, rid), encode(upd)), limit_s, "JS ack"
                )

                async def got() -> bool:
                    with contextlib.suppress(httpx.HTTPError):
                        now = await metric(
                            fs.metrics_url("aggregator"),
                            "collm_aggregator_rejected_updates_total",
                            reason="unknown_round",
                        )
                        return now > rejected0
                    return False

                await wait_for(got, limit_s, "the update to be consumed")
                back["aggregator_updates_consumer"] = time.monotonic() - t_up

        names = list((await fs.answering(bus, 0.2)).keys())
        for n in names:
            back[n] = None
        back["gateway_completion"] = None
        back[f"replica-{rid}_samples_consumer"] = None
        back["aggregator_updates_consumer"] = None
        await asyncio.gather(
            gateway(), *(answering(n) for n in names), samples_consumer(), updates_consumer()
        )
    return back


async def _js_publish(bus: Bus, subject: str, data: bytes) -> bool:
    try:
        await bus.js.publish(subject, data, timeout=1.0)
        return True
    except Exception:  # noqa: BLE001 - JetStream not ready yet after the restart
        return False


# --- 5. the coordinator is down ----------------------------------------------------------------------------
def expected_weights_factor(age_s: float, ttl_s: float = ROUTING_TTL_S, hold_frac: float = 0.5) -> float:
    """What `collm_gateway.routing.weights_factor` should say for weights of this age."""
    hold_s = hold_frac * ttl_s
    if age_s >= ttl_s:
        return 0.0
    if age_s <= hold_s:
        return 1.0
    return (ttl_s - age_s) / (ttl_s - hold_s)


async def coordinator_down(fs: FaultStack, watch_s: float | None = None) -> FaultReport:
    """SIGKILL the coordinator: the gateway keeps routing on its last weights, fully for
    `weights_hold_frac * ttl`, then decaying linearly to even routing at the TTL; each replica keeps the
    coordinator's fine-tuning share until its TTL and then falls back to its local default. Requests keep
    succeeding throughout. After a restart both come back under the coordinator's control."""
    report = FaultReport("coordinator_down")
    await fs.ensure_healthy()
    watch_s = watch_s if watch_s is not None else max(ROUTING_TTL_S, SHARE_TTL_S) + 2.0
    outcomes: list[Outcome] = []
    curve: list[dict[str, Any]] = []
    async with fs.bus("fault-coordinator") as bus, httpx.AsyncClient() as http:

        async def controlled() -> bool:
            gs = await gateway_status(bus)
            shares = [await replica_status(bus, r) for r in fs.replicas]
            return (
                gs is not None
                and gs.weights_factor == 1.0
                and bool(gs.weights)
                and all(s is not None and s.ft_share_source == "coordinator" for s in shares)
            )

        await wait_for(controlled, 30, "weights in force at the gateway and shares from the coordinator")
        t_kill = time.monotonic()
        report.details["coordinator_exit_code"] = await asyncio.to_thread(fs.s.kill, "coordinator")
        fallback_s: dict[str, float] = {}
        i = 0
        while time.monotonic() - t_kill < watch_s:
            gs = await gateway_status(bus)
            point: dict[str, Any] = {"t_s": round(time.monotonic() - t_kill, 3)}
            if gs is not None:
                point.update(weights_age_s=gs.weights_age_s, weights_factor=round(gs.weights_factor, 4))
            for rid in fs.replicas:
                st = await replica_status(bus, rid)
                if st is not None:
                    point[f"{rid}_share"] = st.ft_share
                    point[f"{rid}_source"] = st.ft_share_source
                    if st.ft_share_source == "local_default" and rid not in fallback_s:
                        fallback_s[rid] = time.monotonic() - t_kill
            curve.append(point)
            outcomes.append(
                await one_request(
                    http, fs.gateway_url, fs.base_model, stream=i % 2 == 0, max_tokens=4, index=i
                )
            )
            i += 1
            await asyncio.sleep(0.1)
        t0 = time.monotonic()
        await asyncio.to_thread(fs.s.restart, "coordinator")
        with contextlib.suppress(AssertionError):
            await wait_for(controlled, 60, "the coordinator back in control")
            report.recovery_s = time.monotonic() - t0
    report.recovery_what = "coordinator restart -> weights and shares from it again"
    report.add_outcomes(outcomes)
    with_age = [p for p in curve if p.get("weights_age_s") is not None]
    deviation = max(
        (abs(p["weights_factor"] - expected_weights_factor(p["weights_age_s"])) for p in with_age),
        default=1.0,
    )
    zero_at = next((p["t_s"] for p in with_age if p["weights_factor"] == 0.0), None)
    factors = [p["weights_factor"] for p in with_age]
    report.details.update(
        curve=curve,
        weights_zero_after_s=zero_at,
        max_deviation_from_decay_rule=round(deviation, 4),
        share_fallback_after_s={k: round(v, 3) for k, v in fallback_s.items()},
        shares_at_end={r: curve[-1].get(f"{r}_share") for r in fs.replicas} if curve else {},
    )
    report.check("every request succeeded", report.succeeded == report.sent and report.sent > 0)
    report.check("nothing lost", report.lost == 0)
    report.check(
        "weights held, then decayed (never rose)",
        all(a >= b for a, b in zip(factors, factors[1:], strict=False)),
    )
    report.check("the decay follows hold_frac and the TTL (+-0.1)", deviation <= 0.1)
    # Judged on what each sample saw, whatever the time between samples (a request and three status
    # calls, slower on a busy machine): a sample taken after the bound that still shows the old state
    # fails the check; the services answer it after the sample's time.
    late_weights = [p for p in with_age if p["t_s"] > ROUTING_TTL_S + 0.5]
    report.check(
        "even routing by the TTL (+0.5 s)",
        zero_at is not None and all(p["weights_factor"] == 0.0 for p in late_weights),
    )
    still_controlled_s = [
        p["t_s"] for p in curve for r in fs.replicas if p.get(f"{r}_source") == "coordinator"
    ]
    report.check(
        "every replica fell back to its local share by the share TTL (+0.5 s)",
        set(fallback_s) == set(fs.replicas) and max(still_controlled_s, default=0.0) <= SHARE_TTL_S + 0.5,
    )
    report.check(
        "the local share is the replica's default",
        all(curve[-1].get(f"{r}_share") == FT_SHARE_DEFAULT for r in fs.replicas) if curve else False,
    )
    report.check("the coordinator took control again after its restart", report.recovery_s is not None)
    report.check("no process died", not fs.failed_children())
    return report
