"""The shipped NATS configuration (deploy/nats/nats.conf + auth.conf) on a real nats-server.

Each service's user can do everything its service does on the bus: serve its micro endpoints (and answer
`$SRV` discovery), publish and subscribe its subjects, request with replies under its own inbox prefix,
publish to and consume from JetStream. And each is refused what it must not do: a replica publishing an
adapter version, a round event, a control command or another replica's update or telemetry, serving or
reading as another replica; the gateway commanding replicas or publishing adapter or round events;
strangers and wrong passwords cannot connect at all. nats-py reports a refused publish or subscription
asynchronously through the error callback: the tests assert on that callback, on the server's own log of
the violation, and on the message never reaching a subscriber.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.micro
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from nats.micro.request import Request

from collm_common import subjects
from collm_common.bus import Bus, inbox_prefix, redact_url
from collm_common.settings import CommonSettings
from collm_common.streams import ensure_streams
from collm_ops import nats_auth
from collm_ops.health import micro_ok
from collm_ops.servers import start_nats
from tests.integration.security.conftest import SecureNats

pytestmark = pytest.mark.integration


# --- helpers --------------------------------------------------------------------------------------------
async def eventually(probe: Callable[[], Any], timeout_s: float = 3.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def collect(into: list[Any], convert: Callable[[Msg], Any] = lambda m: m) -> Callable[[Msg], Any]:
    """A subscription callback (nats-py wants a coroutine) appending `convert(msg)` to `into`."""

    async def cb(msg: Msg) -> None:
        into.append(convert(msg))

    return cb


class Tap:
    """An admin subscription that records what reaches a subject (to prove a refused message never did)."""

    def __init__(self) -> None:
        self.got: list[Msg] = []

    async def on(self, admin: Client, subject: str) -> Tap:
        async def cb(msg: Msg) -> None:
            self.got.append(msg)

        await admin.subscribe(subject, cb=cb)
        await admin.flush()
        return self


def mentions(errors: list[str], kind: str, subject: str) -> bool:
    """nats-py's error text, e.g. `nats: permissions violation for publish to "collm.v1..."` (it may
    lower-case the subject)."""
    want = f'permissions violation for {kind} to "{subject}"'.lower()
    return any(want in e.lower() for e in errors)


async def refused_publish(
    secure: SecureNats, nc: Client, errors: list[str], user: str, subject: str, admin: Client
) -> None:
    tap = await Tap().on(admin, subject)
    await nc.publish(subject, b"forged")
    await nc.flush()
    await eventually(lambda: mentions(errors, "publish", subject), what=f"{user}: publish {subject} refused")
    await eventually(
        lambda: (user, "Publish", subject) in secure.violations(), what=f"server log of {user} on {subject}"
    )
    await admin.flush()
    await asyncio.sleep(0.1)
    assert tap.got == [], f"{subject} reached a subscriber although {user} may not publish it"


async def refused_subscribe(
    secure: SecureNats, nc: Client, errors: list[str], user: str, subject: str, admin: Client
) -> None:
    got: list[Msg] = []

    async def cb(msg: Msg) -> None:
        got.append(msg)

    await nc.subscribe(subject, cb=cb)
    await nc.flush()
    await eventually(lambda: mentions(errors, "subscription", subject), what=f"{user}: sub {subject} refused")
    await eventually(
        lambda: (user, "Subscription", subject) in secure.violations(),
        what=f"server log of {user} subscribing {subject}",
    )
    concrete = subject.replace(">", "x").replace("*", "x")
    await admin.publish(concrete, b"secret")
    await admin.flush()
    await asyncio.sleep(0.1)
    assert got == [], f"{user} received {concrete} without permission"


# --- the file itself ------------------------------------------------------------------------------------
def test_shipped_auth_conf_is_generated_from_the_subjects() -> None:
    assert nats_auth.AUTH_CONF.read_text() == nats_auth.render(), (
        "deploy/nats/auth.conf is stale: run `.venv/bin/python -m collm_ops.nats_auth --write`"
    )
    names = [u.name for u in nats_auth.users()]
    assert names == [
        "gateway", "coordinator", "aggregator",
        "replica-r0", "replica-r1", "replica-r2", "replica-g0", "replica-g1", "admin",
    ]  # fmt: skip
    assert nats_auth.password_var("replica-r0") == "NATS_PASSWORD_REPLICA_R0"
    with pytest.raises(ValueError, match="share"):
        nats_auth.users(["a-b", "a_b"])  # two users, one password variable


def test_inbox_prefix_is_per_user() -> None:
    assert inbox_prefix("gateway") == "_INBOX.gateway"
    assert inbox_prefix(None, ["nats://replica-r0:pw@127.0.0.1:4222"]) == "_INBOX.replica-r0"
    assert inbox_prefix(None, ["nats://s3cret-token@host:4222"]) == "_INBOX"  # a token, not a user
    assert inbox_prefix(None, ["nats://host:4222"]) == "_INBOX"
    assert inbox_prefix("bad user>") == "_INBOX"  # not usable as subject tokens: the default
    assert redact_url("nats://gateway:pw@h:4222,nats://h2:4222") == "nats://gateway:***@h:4222,nats://h2:4222"


# --- who may connect ------------------------------------------------------------------------------------
async def test_unknown_users_and_wrong_passwords_cannot_connect(secure_nats: SecureNats) -> None:
    other = secure_nats.passwords["admin"]
    for user, pw in (("mallory", "t-whatever"), ("gateway", "t-wrong"), ("replica-r0", other)):
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await secure_nats.connect(user, pw, max_reconnect_attempts=1)
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(secure_nats.url, allow_reconnect=False, max_reconnect_attempts=1)
    # The services' own connection path says why it gave up, without printing the password.
    settings = CommonSettings(
        nats_url=secure_nats.url.replace("nats://", "nats://gateway:t-wrong@"), nats_connect_timeout_s=1.5
    )
    with pytest.raises(ConnectionError) as err:
        await Bus.connect(settings, "test")
    assert "Authorization Violation" in str(err.value) and "t-wrong" not in str(err.value)


async def test_services_log_in_with_settings_or_url_credentials(secure_nats: SecureNats) -> None:
    pw = secure_nats.passwords["coordinator"]
    by_settings = CommonSettings(nats_url=secure_nats.url, nats_user="coordinator", nats_password=pw)
    by_url = CommonSettings(nats_url=secure_nats.url.replace("nats://", f"nats://coordinator:{pw}@"))
    for settings in (by_settings, by_url):
        bus = await Bus.connect(settings, "collm-coordinator")
        try:
            assert bus.nc.new_inbox().startswith("_INBOX.coordinator.")
            await round_trip(bus.nc, subjects.routing_weights())
        finally:
            await bus.close()


async def round_trip(nc: Client, subject: str) -> None:
    got: list[Msg] = []

    async def cb(msg: Msg) -> None:
        got.append(msg)

    sub = await nc.subscribe(subject, cb=cb)
    await nc.publish(subject, b"w")
    await eventually(lambda: got, what=f"{subject} back")
    await sub.unsubscribe()


# --- what each service must be able to do -----------------------------------------------------------------
async def test_every_service_can_do_its_job(secure_nats: SecureNats) -> None:
    s = secure_nats
    errors: dict[str, list[str]] = {}

    async def login(user: str) -> Client:
        errors[user] = []
        return await s.connect(user, errors=errors[user])

    admin, agg, coord, gw = [await login(u) for u in ("admin", "aggregator", "coordinator", "gateway")]
    r0, r1 = await login("replica-r0"), await login("replica-r1")
    clients = [admin, agg, coord, gw, r0, r1]
    try:
        # The aggregator creates the streams and its durable update consumer.
        await ensure_streams(agg.jetstream(), replicas=1)
        updates = await agg.jetstream().pull_subscribe(
            subjects.updates_all(),
            durable=nats_auth.AGGREGATOR_CONSUMER,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT),
        )

        # Every service registers its NATS micro service, as the real ones do.
        async def reply(text: str, times: int = 1) -> Callable[[Request], Any]:
            async def handler(req: Request) -> None:
                for i in range(times):
                    await req.respond(f"{text}:{i}".encode())

            return handler

        for rid, nc in (("r0", r0), ("r1", r1)):
            svc = await nats.micro.add_service(
                nc, name=subjects.SERVICE_REPLICA, version="0.0.1", metadata={"replica_id": rid}
            )
            for verb in subjects.REPLICA_VERBS:
                times = 40 if verb == "generate" else 1  # a token stream: many replies to one request
                await svc.add_endpoint(
                    name=verb, subject=subjects.replica(rid, verb), handler=await reply(rid, times)
                )
        agg_svc = await nats.micro.add_service(agg, name=subjects.SERVICE_AGGREGATOR, version="0.0.1")
        for verb in ("open_round", "status", "rounds", "round", "rollback", "import"):
            await agg_svc.add_endpoint(
                name=verb, subject=subjects.aggregator(verb), handler=await reply(verb)
            )
        coord_svc = await nats.micro.add_service(coord, name=subjects.SERVICE_COORDINATOR, version="0.0.1")
        for verb in ("status", "policy"):
            await coord_svc.add_endpoint(
                name=verb, subject=subjects.coordinator(verb), handler=await reply(verb)
            )
        gw_svc = await nats.micro.add_service(gw, name=subjects.SERVICE_GATEWAY, version="0.0.1")
        await gw_svc.add_endpoint(
            name="status", subject=subjects.gateway("status"), handler=await reply("gw")
        )

        # Subscriptions of each service.
        seen: dict[str, list[str]] = {}

        async def listen(nc: Client, who: str, subject: str) -> None:
            async def cb(msg: Msg) -> None:
                seen.setdefault(who, []).append(msg.subject)

            await nc.subscribe(subject, cb=cb)
            await nc.flush()

        await listen(gw, "gateway", subjects.telemetry_all())
        await listen(gw, "gateway", subjects.routing_weights())
        await listen(gw, "gateway", subjects.adapter_published_all())
        await listen(gw, "gateway", subjects.coordinator_decisions())  # the dashboard
        await listen(gw, "gateway", subjects.round_events_all())  # the dashboard
        await listen(coord, "coordinator", subjects.telemetry_all())
        await listen(coord, "coordinator", subjects.round_events_all())
        await listen(agg, "aggregator", subjects.telemetry_all())
        await listen(r1, "replica-r1", subjects.adapter_published_all())

        # Replicas: telemetry, updates (JetStream), their samples consumer.
        await r0.publish(subjects.telemetry("r0"), b"t")
        ack = await r0.jetstream().publish(
            subjects.update(7, "r0"), b"update", headers={"Nats-Msg-Id": "u-7-r0"}
        )
        assert ack.stream == subjects.STREAM_UPDATES
        samples_r1 = await r1.jetstream().pull_subscribe(
            subjects.samples("r1"),
            durable=nats_auth.samples_consumer("r1"),
            stream=subjects.STREAM_SAMPLES,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT),
        )
        # Gateway: routes a sample (JetStream), streams a generation, cancels, tokenizes, asks the aggregator.
        ack = await gw.jetstream().publish(subjects.samples("r1"), b"sample", stream=subjects.STREAM_SAMPLES)
        assert ack.stream == subjects.STREAM_SAMPLES
        inbox = gw.new_inbox()
        assert inbox.startswith("_INBOX.gateway.")
        tokens: list[bytes] = []
        await gw.subscribe(inbox, cb=collect(tokens, lambda m: m.data))
        await gw.publish(subjects.replica("r0", "generate"), b"prompt", reply=inbox)
        await eventually(lambda: len(tokens) == 40, what="40 streamed replies")
        assert (await gw.request(subjects.replica("r1", "cancel"), b"", timeout=2)).data == b"r1:0"
        assert (await gw.request(subjects.replica("r1", "tokenize"), b"", timeout=2)).data == b"r1:0"
        # ... and probes the status of a replica whose telemetry went stale.
        assert (await gw.request(subjects.replica("r1", "status"), b"", timeout=2)).data.startswith(b"r1:")
        assert (await gw.request(subjects.aggregator("import"), b"", timeout=2)).data == b"import:0"
        assert (await gw.request(subjects.aggregator("rollback"), b"", timeout=2)).data == b"rollback:0"
        # ... and, for its dashboard, reads round records and the coordinator's status.
        assert (await gw.request(subjects.aggregator("rounds"), b"", timeout=2)).data == b"rounds:0"
        assert (await gw.request(subjects.coordinator("status"), b"", timeout=2)).data == b"status:0"
        # Coordinator: weights, decisions, shares to replicas, round plans.
        await coord.publish(subjects.routing_weights(), b"w")
        await coord.publish(subjects.coordinator_decisions(), b"d")
        assert (await coord.request(subjects.replica("r0", "control"), b"", timeout=2)).data == b"r0:0"
        assert (
            await coord.request(subjects.aggregator("open_round"), b"", timeout=2)
        ).data == b"open_round:0"
        # Aggregator: training, evaluation, round events, publications; consumes and acks the update.
        assert (await agg.request(subjects.replica("r1", "control"), b"", timeout=2)).data == b"r1:0"
        assert (await agg.request(subjects.replica("r0", "evaluate"), b"", timeout=2)).data == b"r0:0"
        await agg.publish(subjects.round_event(7, "published"), b"o")
        await agg.publish(subjects.adapter_published("med"), b"p")
        msgs = await updates.fetch(1, timeout=2)
        assert msgs[0].subject == subjects.update(7, "r0")
        await msgs[0].ack()
        got = await samples_r1.fetch(1, timeout=2)
        assert got[0].data == b"sample"
        await got[0].ack()
        # Operators (admin): discovery sees every service; status endpoints answer.
        assert (await admin.request(subjects.coordinator("status"), b"", timeout=2)).data == b"status:0"
        assert (await admin.request(subjects.gateway("status"), b"", timeout=2)).data == b"gw:0"
        found: list[dict[str, Any]] = []
        disco = admin.new_inbox()
        await admin.subscribe(disco, cb=collect(found, lambda m: json.loads(m.data)))
        await admin.publish("$SRV.PING", b"", reply=disco)
        await eventually(lambda: len(found) == 5, what="5 micro services answering $SRV.PING")
        assert sorted(f["name"] for f in found) == sorted(
            [subjects.SERVICE_GATEWAY, subjects.SERVICE_COORDINATOR, subjects.SERVICE_AGGREGATOR]
            + [subjects.SERVICE_REPLICA] * 2
        )
        # Each service may ping its own kind (its container health check) under its own inbox.
        for nc, name, want in ((r0, subjects.SERVICE_REPLICA, 2), (agg, subjects.SERVICE_AGGREGATOR, 1)):
            pongs: list[bytes] = []
            box = nc.new_inbox()
            await nc.subscribe(box, cb=collect(pongs))
            await nc.publish(f"$SRV.PING.{name}", b"", reply=box)
            await eventually(lambda p=pongs, w=want: len(p) == w, what=f"$SRV.PING.{name}")

        # The compose health check (`collm health micro ...`) as the service's own user.
        for user, name, meta in (
            ("replica-r1", subjects.SERVICE_REPLICA, {"replica_id": "r1"}),
            ("gateway", subjects.SERVICE_GATEWAY, {}),
        ):
            ok, why = await asyncio.to_thread(micro_ok, s.url, name, meta, 1.0, user, s.passwords[user])
            assert ok, why

        await eventually(
            lambda: "collm.v1.telemetry.replica.r0" in seen.get("coordinator", []), what="telemetry"
        )
        await eventually(lambda: subjects.round_event(7, "published") in seen.get("coordinator", []))
        await eventually(lambda: subjects.adapter_published("med") in seen.get("replica-r1", []))
        await eventually(lambda: subjects.routing_weights() in seen.get("gateway", []))
        assert subjects.telemetry("r0") in seen["aggregator"] and subjects.telemetry("r0") in seen["gateway"]
        assert subjects.adapter_published("med") in seen["gateway"]
        await eventually(lambda: subjects.round_event(7, "published") in seen.get("gateway", []))
        assert subjects.coordinator_decisions() in seen["gateway"]
        for c in clients:
            await c.flush()
        await asyncio.sleep(0.2)
        assert {u: e for u, e in errors.items() if e} == {}, "a service was refused something it needs"
        assert secure_nats.violations() == []
    finally:
        for c in clients:
            await c.close()


# --- what each must not do ------------------------------------------------------------------------------
async def test_a_replica_has_no_authority_and_cannot_act_as_another(secure_nats: SecureNats) -> None:
    s = secure_nats
    admin = await s.connect("admin")
    await ensure_streams(admin.jetstream(), replicas=1)
    errors: list[str] = []
    r1 = await s.connect("replica-r1", errors=errors)
    try:
        for subject in (
            subjects.adapter_published("med"),  # an adapter version
            subjects.round_event(1, "published"),  # a round event or result
            subjects.replica("r0", "control"),  # a control command, to another replica or itself
            subjects.replica("r1", "control"),
            subjects.coordinator("policy"),
            subjects.aggregator("open_round"),
            subjects.telemetry("r0"),  # another replica's telemetry
            subjects.update(1, "r0"),  # another replica's update
            subjects.samples("r0"),  # samples for another replica (or itself)
            f"$JS.API.STREAM.MSG.GET.{subjects.STREAM_SAMPLES}",  # reading samples directly
            f"$JS.API.STREAM.PURGE.{subjects.STREAM_UPDATES}",
            f"$JS.API.STREAM.DELETE.{subjects.STREAM_UPDATES}",
            f"$JS.API.CONSUMER.CREATE.{subjects.STREAM_SAMPLES}.replica-r0.{subjects.samples('r0')}",
        ):
            await refused_publish(s, r1, errors, "replica-r1", subject, admin)
        for subject in (
            subjects.replica("r0", "generate"),  # serving as r0 (stealing its requests)
            nats_auth.any_replica("control"),
            subjects.samples("r0"),  # reading r0's raw data as it is published
            subjects.updates_all(),
            "_INBOX.gateway.>",  # the gateway's replies: other users' token streams
            "_INBOX.>",
            subjects.telemetry_all(),
        ):
            await refused_subscribe(s, r1, errors, "replica-r1", subject, admin)

        # Its update subject is its identity: on JetStream, another replica's update is never stored.
        before = (await admin.jetstream().stream_info(subjects.STREAM_UPDATES)).state.messages
        with pytest.raises(nats.errors.TimeoutError):
            await r1.jetstream().publish(subjects.update(2, "r0"), b"forged", timeout=1.0)
        assert (await admin.jetstream().stream_info(subjects.STREAM_UPDATES)).state.messages == before
        ack = await r1.jetstream().publish(subjects.update(2, "r1"), b"own")
        assert ack.seq == before + 1

        # Its samples consumer filters its own subject only: the server refuses a body naming another.
        body = {
            "stream_name": subjects.STREAM_SAMPLES,
            "config": {
                "name": "replica-r1",
                "durable_name": "replica-r1",
                "filter_subject": subjects.samples("r0"),
                "ack_policy": "explicit",
            },
        }
        api = f"$JS.API.CONSUMER.CREATE.{subjects.STREAM_SAMPLES}.replica-r1.{subjects.samples('r1')}"
        answer = json.loads((await r1.request(api, json.dumps(body).encode(), timeout=2)).data)
        assert answer["error"]["err_code"] == 10131, answer  # "did not match filtered subject"
    finally:
        await r1.close()
        await admin.close()


async def test_the_gateway_cannot_command_replicas_or_publish_authority(secure_nats: SecureNats) -> None:
    s = secure_nats
    admin = await s.connect("admin")
    errors: list[str] = []
    gw = await s.connect("gateway", errors=errors)
    try:
        for subject in (
            subjects.replica("r0", "control"),
            subjects.replica("r0", "evaluate"),
            subjects.coordinator("policy"),
            subjects.adapter_published("med"),
            subjects.round_event(1, "published"),
            subjects.update(1, "r0"),
            subjects.routing_weights(),
            subjects.telemetry("r0"),
            subjects.aggregator("open_round"),
        ):
            await refused_publish(s, gw, errors, "gateway", subject, admin)
        for subject in (subjects.replica("r0", "generate"), "_INBOX.replica-r0.>", subjects.samples("r0")):
            await refused_subscribe(s, gw, errors, "gateway", subject, admin)
    finally:
        await gw.close()
        await admin.close()


async def test_coordinator_and_aggregator_keep_to_their_roles(secure_nats: SecureNats) -> None:
    s = secure_nats
    admin = await s.connect("admin")
    try:
        errors: list[str] = []
        coord = await s.connect("coordinator", errors=errors)
        for subject in (
            subjects.adapter_published("med"),
            subjects.round_event(1, "published"),
            subjects.update(1, "r0"),
            subjects.replica("r0", "evaluate"),
            subjects.replica("r0", "generate"),
        ):
            await refused_publish(s, coord, errors, "coordinator", subject, admin)
        await coord.close()
        errors = []
        agg = await s.connect("aggregator", errors=errors)
        for subject in (
            subjects.update(1, "r0"),
            subjects.samples("r0"),
            subjects.coordinator("policy"),
            subjects.telemetry("r0"),
            subjects.replica("r0", "generate"),
        ):
            await refused_publish(s, agg, errors, "aggregator", subject, admin)
        await refused_subscribe(s, agg, errors, "aggregator", subjects.replica("r0", "control"), admin)
        await agg.close()
    finally:
        await admin.close()


async def test_a_token_secured_server_takes_the_token_setting(tmp_path: Path) -> None:
    conf = tmp_path / "token.conf"
    conf.write_text('authorization { token: "t-shared-token" }\n')
    srv = start_nats(workdir=tmp_path / "nats", config=conf)
    try:
        bus = await Bus.connect(CommonSettings(nats_url=srv.url, nats_token="t-shared-token"), "tok")
        try:
            await round_trip(bus.nc, subjects.routing_weights())
        finally:
            await bus.close()
        with pytest.raises(ConnectionError, match="Authorization Violation"):
            await Bus.connect(
                CommonSettings(nats_url=srv.url, nats_token="t-wrong", nats_connect_timeout_s=1.5), "x"
            )
    finally:
        srv.stop()
