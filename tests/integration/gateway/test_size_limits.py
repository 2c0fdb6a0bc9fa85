"""Request sizes at the gateway's limits: the body limit, and what fits in one NATS message to a replica.

A body under `COLLM_MAX_BODY_BYTES` grows when it is packed for a replica (msgpack, the gateway's own
fields, the trace headers); a packed request larger than the server's `max_payload` is refused with 413
and the envelope before anything is sent (the server would otherwise close the gateway's connection).
"""

import json

import pytest

from collm_common.bus import message_size
from collm_common.wire import encode

from .conftest import BASE_MODEL

pytestmark = pytest.mark.integration

LIMIT = 1 << 20  # the default body limit, and nats-server's default max_payload


def chat_body(size: int) -> bytes:
    """A chat request whose JSON body is exactly `size` bytes."""
    empty = json.dumps({"model": BASE_MODEL, "messages": [{"role": "user", "content": ""}]})
    body = json.dumps(
        {"model": BASE_MODEL, "messages": [{"role": "user", "content": "x" * (size - len(empty))}]}
    )
    assert len(body) == size
    return body.encode()


async def post(gw, body: bytes):
    return await gw.http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )


def assert_too_large(resp) -> dict:
    assert resp.status_code == 413, resp.text[:300]
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    return err


async def test_bodies_just_under_at_and_over_the_limit_are_413_never_5xx(gateway, replicas) -> None:
    r0 = await replicas("r0")
    await gateway.wait_replicas("r0")
    assert gateway.state.settings.max_body_bytes == LIMIT == gateway.state.bus.nc.max_payload
    for size in (LIMIT - 178, LIMIT - 96, LIMIT - 8, LIMIT - 1, LIMIT):
        err = assert_too_large(await post(gateway, chat_body(size)))
        assert "once packed for a replica" in err["message"], (size, err)
    err = assert_too_large(await post(gateway, chat_body(LIMIT + 1)))
    assert "the limit is 1048576" in err["message"]
    assert r0.requests == []  # nothing over the limit was sent
    # the gateway's NATS connection is intact: the next request is served
    assert gateway.state.bus.connected
    assert (await post(gateway, chat_body(1000))).status_code == 200


async def test_a_request_that_packs_to_exactly_max_payload_is_served_one_byte_more_is_413(
    gateway, replicas
) -> None:
    r0 = await replicas("r0")
    await gateway.wait_replicas("r0")
    max_payload = gateway.state.bus.nc.max_payload
    probe = 1_000_000
    assert (await post(gateway, chat_body(probe))).status_code == 200
    packed = message_size(encode(r0.requests[-1]), r0.headers[-1])
    assert packed > probe  # packing adds the gateway's fields and the trace headers
    edge = probe + (max_payload - packed)  # each byte of content adds one packed byte (a str32)
    assert edge < LIMIT  # under the body limit: only the packed size decides
    resp = await post(gateway, chat_body(edge))
    assert resp.status_code == 200, resp.text[:300]
    assert message_size(encode(r0.requests[-1]), r0.headers[-1]) == max_payload
    err = assert_too_large(await post(gateway, chat_body(edge + 1)))
    assert f"{max_payload + 1} bytes once packed" in err["message"]
    assert len(r0.requests) == 2 and gateway.state.bus.connected
