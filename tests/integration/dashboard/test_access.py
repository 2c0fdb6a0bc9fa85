"""The dashboard over HTTP: who sees what (open gateway, tenant keys, admin keys), the key taken from the
header, the query or the cookie, live updates on the event stream, and streams that end at shutdown.

A real NATS and Redis, the gateway under its own server; this test publishes the telemetry, decisions,
round events and publications the services would, and writes adapters to the store as they would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import pytest

from collm_common import subjects
from collm_common.bus import Bus
from collm_common.store import AdapterStore
from collm_common.wire.adapters import AdapterPublished
from collm_common.wire.control import CoordinatorDecisions, ReplicaDecision
from collm_common.wire.rounds import RoundOutcome
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_gateway.keys import hash_key

from .conftest import BASE_MODEL, Event, EventReader

pytestmark = pytest.mark.integration

ACME = "sk-dash-acme-0123456789"
GLOBEX = "sk-dash-globex-0123456789"
ADMIN = "sk-dash-admin-0123456789"
KEYS = {hash_key(ACME): {"tenant": "acme"}, hash_key(GLOBEX): {"tenant": "globex"}}
ADAPTERS = {"shared-med": None, "acme-fin": "acme", "globex-law": "globex"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def seed(store: AdapterStore) -> None:
    """Each adapter with v1 and v2, and a held-out loss per version (what the aggregator records)."""
    for name, owner in ADAPTERS.items():
        if owner:
            await store.set_meta(name, {"tenant": owner})
        for n in (1, 2):
            rec = await store.publish(
                name,
                f"{name} v{n}".encode(),
                expected_current=n - 1 or None,
                base_model=BASE_MODEL,
                source="round",
            )
            await store.record_quality(name, rec.version, {"dom": 2.0 - 0.25 * n})


def telemetry(rid: str) -> ReplicaTelemetry:
    return ReplicaTelemetry(
        replica_id=rid, ts_unix_s=time.time(), interval_s=0.5, model=BASE_MODEL, running=1, max_batch=4
    )


def round_event(round_id: int, adapter: str, state: str = "published") -> RoundOutcome:
    now = time.time()
    return RoundOutcome(
        round_id=round_id,
        adapter=adapter,
        state=state,
        base_version=2,
        participants=["r0"],
        timeline={"opened": now - 5, state: now},
        ts_unix_s=now,
    )


async def publish_round(bus: Bus, o: RoundOutcome) -> None:
    await bus.publish(subjects.round_event(o.round_id, o.state), o)


async def state_of(client: httpx.AsyncClient, **kw: Any) -> dict[str, Any]:
    resp = await client.get("/dashboard/state", **kw)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def wait_replica(client: httpx.AsyncClient, rid: str, **kw: Any) -> None:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        if rid in [r["id"] for r in (await state_of(client, **kw))["replicas"]]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{rid} never shown")


async def test_keys_scope_the_dashboard_state_and_the_key_comes_from_header_query_or_cookie(
    serve, store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    await seed(store)
    async with serve(api_keys=KEYS, admin_key=ADMIN) as gw:
        async with httpx.AsyncClient(base_url=gw.base_url, timeout=10) as http:
            await gw.bus.publish(subjects.telemetry("r0"), telemetry("r0"))
            for rid, name in enumerate(ADAPTERS, start=1):
                await publish_round(gw.bus, round_event(rid, name))
            await wait_replica(http, "r0", headers=bearer(ADMIN))

            page = await http.get("/dashboard")  # the page holds no data: served to anyone
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "default-src 'none'" in page.headers["content-security-policy"]
            assert "EventSource" in page.text

            for kw in ({}, {"headers": bearer("sk-unknown")}, {"params": {"key": "sk-unknown"}}):
                resp = await http.get("/dashboard/state", **kw)
                assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
            resp = await http.get("/dashboard/events")
            assert resp.status_code == 401 and "/dashboard?key=" in resp.json()["error"]["message"]

            admin = await state_of(http, headers=bearer(ADMIN))
            assert admin["access"] == {"cluster": True, "all_adapters": True, "tenant": None}
            assert [r["id"] for r in admin["replicas"]] == ["r0"] and admin["coordinator"] is not None
            assert [a["name"] for a in admin["adapters"]] == sorted(ADAPTERS)
            assert sorted(r["adapter"] for r in admin["rounds"]) == sorted(ADAPTERS)

            for kw in ({"headers": bearer(ACME)}, {"params": {"key": ACME}}):
                acme = await state_of(http, **kw)
                assert acme["access"] == {"cluster": False, "all_adapters": False, "tenant": "acme"}
                assert acme["replicas"] is None and acme["coordinator"] is None
                assert [a["name"] for a in acme["adapters"]] == ["acme-fin", "shared-med"]
                assert sorted(r["adapter"] for r in acme["rounds"]) == ["acme-fin", "shared-med"]
            fin = next(a for a in acme["adapters"] if a["name"] == "acme-fin")
            assert fin["owner"] == "acme" and fin["current_id"] == "acme-fin@v2"
            assert [(v["id"], v["quality"]) for v in fin["versions"]] == [
                ("acme-fin@v1", {"dom": 1.75}),
                ("acme-fin@v2", {"dom": 1.5}),
            ]

            # ?key= stores the key in an HttpOnly cookie scoped to the dashboard, and leaves the address bar.
            resp = await http.get("/dashboard", params={"key": GLOBEX})
            assert resp.status_code == 303 and resp.headers["location"] == "/dashboard"
            cookie = resp.headers["set-cookie"]
            assert "collm_dashboard_key=" in cookie and "HttpOnly" in cookie and "Path=/dashboard" in cookie
            assert "samesite=strict" in cookie.lower()
            globex = await state_of(http)  # the client sends the cookie back
            assert globex["access"]["tenant"] == "globex"
            assert [a["name"] for a in globex["adapters"]] == ["globex-law", "shared-med"]
            resp = await http.get("/dashboard", params={"key": ""})  # forget it
            assert resp.status_code == 303 and "collm_dashboard_key" not in http.cookies
            assert (await http.get("/dashboard/state")).status_code == 401

    # The server side (every logger but this test's own HTTP client) never logged a key.
    server_lines = [r.getMessage() for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]
    assert server_lines and not [
        line for line in server_lines for key in (ACME, GLOBEX, ADMIN) if key in line
    ]


async def test_event_streams_send_a_snapshot_then_only_what_each_key_may_see(serve, store) -> None:
    await seed(store)
    async with serve(api_keys=KEYS, admin_key=ADMIN) as gw:
        async with httpx.AsyncClient(base_url=gw.base_url, timeout=httpx.Timeout(10, read=None)) as http:
            async with (
                http.stream("GET", "/dashboard/events", params={"key": ACME}) as acme_resp,
                http.stream("GET", "/dashboard/events", headers=bearer(ADMIN)) as admin_resp,
            ):
                assert acme_resp.status_code == 200
                assert acme_resp.headers["content-type"].startswith("text/event-stream")
                acme, admin = EventReader(acme_resp), EventReader(admin_resp)
                snap = await acme.next()
                assert snap.name == "snapshot" and snap.data["access"]["tenant"] == "acme"
                assert [a["name"] for a in snap.data["adapters"]] == ["acme-fin", "shared-med"]
                assert (await admin.next()).name == "snapshot"
                assert gw.state.dashboard is not None and gw.state.dashboard.clients == 2

                await publish_round(gw.bus, round_event(1, "globex-law", "collecting"))
                await gw.bus.publish(subjects.telemetry("r1"), telemetry("r1"))
                await gw.bus.publish(
                    subjects.coordinator_decisions(),
                    CoordinatorDecisions(
                        ts_unix_s=time.time(),
                        policy="collm",
                        loop="fast",
                        replicas=[
                            ReplicaDecision(replica_id="r1", ft_share=0.25, routing_weight=1.0, reason="")
                        ],
                    ),
                )
                seen_by_admin: set[str] = set()

                def admin_saw_all(ev: Event) -> bool:
                    seen_by_admin.add(ev.name)
                    return {"round", "replica", "coordinator"} <= seen_by_admin

                await admin.until(admin_saw_all)
                # A new version of acme's adapter, published as the aggregator does, then its round's end.
                rec = await store.publish(
                    "acme-fin", b"acme-fin v3", expected_current=2, base_model=BASE_MODEL, source="round"
                )
                await store.record_quality("acme-fin", rec.version, {"dom": 1.2})
                published = AdapterPublished(
                    name="acme-fin",
                    version=3,
                    version_id="acme-fin@v3",
                    sha256=rec.sha256,
                    base_model=BASE_MODEL,
                    source="round",
                    round_id=2,
                )
                await gw.bus.publish(subjects.adapter_published("acme-fin"), published)
                ev, before = await acme.until(lambda e: e.name == "adapter")
                v3 = ev.data["adapter"]["versions"][-1]
                assert (v3["id"], v3["current"], v3["quality"]) == ("acme-fin@v3", True, {"dom": 1.2})
                await publish_round(gw.bus, round_event(2, "acme-fin"))
                ev, more = await acme.until(lambda e: e.name == "round")
                assert ev.data["round"]["adapter"] == "acme-fin" and ev.data["round"]["final"]
                # Nothing of globex's, and no cluster view, reached the tenant's stream.
                assert [e.name for e in before + more] == []
                assert isinstance(ev.data["now_unix_s"], float)


async def test_an_open_gateway_shows_everything_without_a_key(serve, store) -> None:
    await seed(store)
    async with serve() as gw:
        async with httpx.AsyncClient(base_url=gw.base_url, timeout=10) as http:
            await gw.bus.publish(subjects.telemetry("r0"), telemetry("r0"))
            await wait_replica(http, "r0")
            snap = await state_of(http)
            assert snap["access"] == {"cluster": True, "all_adapters": True, "tenant": None}
            assert [a["name"] for a in snap["adapters"]] == sorted(ADAPTERS)
            assert (await state_of(http, params={"key": "anything"}))["access"]["cluster"]


async def test_streams_end_when_the_server_shuts_down(serve) -> None:
    async with serve() as gw:
        async with httpx.AsyncClient(base_url=gw.base_url, timeout=httpx.Timeout(10, read=None)) as http:
            async with http.stream("GET", "/dashboard/events") as resp:
                reader = EventReader(resp)
                assert (await reader.next()).name == "snapshot"
                t0 = time.monotonic()
                gw.server.should_exit = True
                with pytest.raises(EOFError):
                    await reader.next(timeout_s=5)
                await asyncio.wait_for(asyncio.shield(gw.task), 5)
                assert time.monotonic() - t0 < 3  # not uvicorn's graceful timeout: the stream was ended
