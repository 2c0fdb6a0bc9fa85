"""Keys, tenants and limits through HTTP: 401, 403, 404 for a foreign adapter, 429, 413, 400 max_tokens.

A real NATS and Redis, the gateway app in-process, a replica double; adapters with owners in the store.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from collm_common.store import AdapterStore
from collm_gateway import keys
from collm_gateway.keys import hash_key

from .conftest import BASE_MODEL

pytestmark = pytest.mark.integration

ACME = "sk-test-acme"
GLOBEX = "sk-test-globex"
OPS = "sk-test-ops"
KEYS = {
    hash_key(ACME): {"tenant": "acme"},
    # A bucket of 2 that does not refill within a test (however slow the machine): the third request is 429.
    hash_key(GLOBEX): {"tenant": "globex", "rate_limit_rps": 0.01, "burst": 2},
}


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def assert_envelope(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


async def seed(store: AdapterStore) -> None:
    for name, owner in (("shared-med", None), ("acme-fin", "acme"), ("globex-law", "globex")):
        if owner:
            await store.set_meta(name, {"tenant": owner})
        await store.publish(
            name, f"weights of {name}".encode(), expected_current=None, base_model=BASE_MODEL, source="create"
        )


def chat(model: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


@pytest.fixture
async def keyed(make_gateway, store, replicas):
    await seed(store)
    double = await replicas("r0", adapters={"shared-med": 1, "acme-fin": 1, "globex-law": 1})
    async with make_gateway(
        api_keys=KEYS, admin_key=OPS, max_body_bytes=2048, max_tokens_limit=64, default_max_tokens=8
    ) as gw:
        await gw.wait_replicas("r0")
        yield gw, double


async def test_missing_or_unknown_key_is_401_and_health_stays_open(keyed) -> None:
    gw, _ = keyed
    for headers in ({}, auth("sk-nope"), {"Authorization": "Basic abc"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            resp = await gw.http.request(method, path, headers=headers, json=chat(BASE_MODEL))
            err = assert_envelope(resp, 401, "invalid_api_key")
            assert err["type"] == "authentication_error"
            assert resp.headers["www-authenticate"] == "Bearer"
    # An unauthenticated body is not even read: broken JSON is still 401, not 400.
    resp = await gw.http.post(
        "/v1/completions", content=b"{broken", headers={"content-type": "application/json"}
    )
    assert_envelope(resp, 401)
    assert (await gw.http.get("/healthz")).status_code == 200
    assert (await gw.http.get("/readyz")).status_code == 200


async def test_tenants_list_and_use_only_their_own_and_shared_adapters(keyed) -> None:
    gw, double = keyed

    async def ids(key: str) -> list[str]:
        resp = await gw.http.get("/v1/models", headers=auth(key))
        assert resp.status_code == 200
        return [m["id"] for m in resp.json()["data"]]

    assert await ids(ACME) == [BASE_MODEL, "acme-fin", "shared-med"]
    assert await ids(GLOBEX) == [BASE_MODEL, "globex-law", "shared-med"]
    assert await ids(OPS) == [BASE_MODEL, "acme-fin", "globex-law", "shared-med"]
    owned = {
        m["id"]: m["owned_by"] for m in (await gw.http.get("/v1/models", headers=auth(OPS))).json()["data"]
    }
    assert owned["acme-fin"] == "acme" and owned["shared-med"] == "collm"

    resp = await gw.http.post("/v1/chat/completions", headers=auth(ACME), json=chat("acme-fin"))
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-collm-adapter-version"] == "acme-fin@v1"
    assert double.requests[-1].tenant == "acme" and double.requests[-1].adapter == "acme-fin"
    resp = await gw.http.post("/v1/chat/completions", headers=auth(ACME), json=chat("shared-med"))
    assert resp.status_code == 200 and double.requests[-1].tenant == "acme"

    # Another tenant's adapter answers exactly like a model that does not exist.
    n_requests = len(double.requests)
    for foreign, unknown in (("globex-law", "no-such-adapter"), ("globex-law@v1", "no-such-adapter@v1")):
        got = await gw.http.post("/v1/chat/completions", headers=auth(ACME), json=chat(foreign))
        ref = await gw.http.post("/v1/chat/completions", headers=auth(ACME), json=chat(unknown))
        e_got, e_ref = (
            assert_envelope(got, 404, "model_not_found"),
            assert_envelope(ref, 404, "model_not_found"),
        )
        assert e_got["message"].replace(foreign, "X") == e_ref["message"].replace(unknown, "X")
        assert (e_got["type"], e_got["param"]) == (e_ref["type"], e_ref["param"])
        got = await gw.http.get(f"/v1/models/{foreign}", headers=auth(ACME))
        ref = await gw.http.get(f"/v1/models/{unknown}", headers=auth(ACME))
        assert got.status_code == ref.status_code == 404
        assert got.json()["error"]["message"].replace(foreign, "X") == ref.json()["error"]["message"].replace(
            unknown, "X"
        )
    got = await gw.http.get("/v1/adapters/globex-law/versions", headers=auth(ACME))
    ref = await gw.http.get("/v1/adapters/no-such-adapter/versions", headers=auth(ACME))
    assert assert_envelope(got, 404)["message"].replace("globex-law", "X") == assert_envelope(ref, 404)[
        "message"
    ].replace("no-such-adapter", "X")
    assert len(double.requests) == n_requests  # nothing foreign reached a replica
    resp = await gw.http.get("/v1/adapters/acme-fin/versions", headers=auth(ACME))
    assert resp.status_code == 200 and [v["id"] for v in resp.json()["data"]] == ["acme-fin@v1"]


async def test_per_key_rate_limit_is_429_with_retry_after(keyed) -> None:
    gw, _ = keyed
    statuses = []
    for _ in range(3):
        resp = await gw.http.get("/v1/models", headers=auth(GLOBEX))
        statuses.append(resp.status_code)
    assert statuses == [200, 200, 429]
    err = assert_envelope(resp, 429, "rate_limit_exceeded")
    assert err["type"] == "rate_limit_error" and int(resp.headers["retry-after"]) >= 1
    # Other keys have their own buckets.
    assert (await gw.http.get("/v1/models", headers=auth(ACME))).status_code == 200


async def test_body_size_and_max_tokens_limits(keyed) -> None:
    gw, _ = keyed
    big = chat(BASE_MODEL, messages=[{"role": "user", "content": "x" * 4000}])
    err = assert_envelope(
        await gw.http.post("/v1/chat/completions", headers=auth(ACME), json=big), 413, "request_too_large"
    )
    assert "2048" in err["message"]
    # Chunked (no Content-Length): counted as it arrives, refused the same way.

    async def chunks():
        yield b'{"model": "x", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}]}'

    resp = await gw.http.post(
        "/v1/chat/completions",
        headers={**auth(ACME), "content-type": "application/json"},
        content=chunks(),
    )
    assert_envelope(resp, 413)
    # Without a key the size is not even looked at.
    assert_envelope(await gw.http.post("/v1/chat/completions", json=big), 401)

    for field in ("max_tokens", "max_completion_tokens"):
        resp = await gw.http.post(
            "/v1/chat/completions", headers=auth(ACME), json=chat(BASE_MODEL, **{field: 65})
        )
        err = assert_envelope(resp, 400)
        assert err["param"] == "max_tokens" and "limit of 64" in err["message"]
    resp = await gw.http.post(
        "/v1/completions", headers=auth(ACME), json={"model": BASE_MODEL, "prompt": "a", "max_tokens": 1000}
    )
    assert assert_envelope(resp, 400)["param"] == "max_tokens"
    resp = await gw.http.post("/v1/chat/completions", headers=auth(ACME), json=chat(BASE_MODEL, max_tokens=0))
    assert_envelope(resp, 400)
    ok = await gw.http.post("/v1/chat/completions", headers=auth(ACME), json=chat(BASE_MODEL, max_tokens=64))
    assert ok.status_code == 200


async def test_admin_endpoints_need_an_admin_key(keyed) -> None:
    gw, _ = keyed
    calls = [
        ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "acme-fin"}),
        ("POST", "/v1/adapters/acme-fin/rollback", {"version": 1}),
        ("POST", "/v1/samples", {"samples": [{"replica_id": "r0", "prompt": "p", "response": "r"}]}),
    ]
    for method, path, body in calls:
        assert_envelope(await gw.http.request(method, path, json=body), 401)
        assert_envelope(
            await gw.http.request(method, path, json=body, headers=auth(ACME)), 403, "admin_key_required"
        )
    # The admin key gets through auth (then the adapter is simply unknown).
    resp = await gw.http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=auth(OPS))
    assert_envelope(resp, 404, "model_not_found")


async def test_open_gateway_accepts_any_key_but_never_opens_admin_endpoints(
    make_gateway, store, replicas
) -> None:
    await seed(store)
    await replicas("r0", adapters={"acme-fin": 1})
    async with make_gateway() as gw:
        await gw.wait_replicas("r0")
        for headers in ({}, auth("anything")):
            resp = await gw.http.get("/v1/models", headers=headers)
            assert resp.status_code == 200 and len(resp.json()["data"]) == 4  # open: every adapter
            resp = await gw.http.post("/v1/chat/completions", headers=headers, json=chat("acme-fin"))
            assert resp.status_code == 200
            resp = await gw.http.post(
                "/v1/unload_lora_adapter", headers=headers, json={"lora_name": "acme-fin"}
            )
            err = assert_envelope(resp, 403, "admin_key_required")
            assert "no admin key is configured" in err["message"]
    async with make_gateway(admin_key=OPS) as gw:
        body = {"lora_name": "nope"}
        assert_envelope(await gw.http.post("/v1/unload_lora_adapter", json=body), 401)
        assert_envelope(await gw.http.post("/v1/unload_lora_adapter", json=body, headers=auth("guess")), 403)
        assert_envelope(await gw.http.post("/v1/unload_lora_adapter", json=body, headers=auth(OPS)), 404)
        assert (await gw.http.get("/v1/models", headers=auth("guess"))).status_code == 200


async def test_keys_file_added_while_running(make_gateway, store, replicas, tmp_path) -> None:
    path = tmp_path / "keys.yaml"
    keys.write_keys_file(path, {})
    async with make_gateway(api_keys_file=path, api_keys_reload_s=0.05) as gw:
        assert_envelope(await gw.http.get("/v1/models", headers=auth(ACME)), 401)
        keys.write_keys_file(path, {hash_key(ACME): keys.ApiKeySpec(tenant="acme")})
        for _ in range(100):
            resp = await gw.http.get("/v1/models", headers=auth(ACME))
            if resp.status_code == 200:
                break
            await asyncio.sleep(0.02)
        assert resp.status_code == 200


async def test_inputs_the_wire_cannot_carry_are_400_not_500(keyed) -> None:
    gw, double = keyed
    n = len(double.requests)
    raw = b'{"model": "%s", "prompt": "\\ud800", "max_tokens": 2}' % BASE_MODEL.encode()
    headers = {**auth(ACME), "content-type": "application/json"}
    assert_envelope(await gw.http.post("/v1/completions", content=raw, headers=headers), 400)
    for prompt in ([2**70], [[1, 2**40]]):
        body = {"model": BASE_MODEL, "prompt": prompt, "max_tokens": 2}
        resp = await gw.http.post("/v1/completions", json=body, headers=auth(ACME))
        assert assert_envelope(resp, 400)["param"] == "prompt"
    raw = b'{"samples": [{"replica_id": "r0", "prompt": "\\udfff", "response": "r"}]}'
    resp = await gw.http.post(
        "/v1/samples", content=raw, headers={**auth(OPS), "content-type": "application/json"}
    )
    assert_envelope(resp, 400)
    assert len(double.requests) == n
