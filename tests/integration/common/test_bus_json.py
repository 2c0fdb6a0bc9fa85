"""JSON on the bus's endpoints against a real nats-server, sent as the NATS CLI sends it.

`nats req SUBJECT '{...}' -H Content-Type:application/json` publishes the typed body as it is with that
one header; `--raw` prints the reply's body followed by newlines. Each request here is that message, sent
with a plain nats-py connection (no CoLLM code on the requesting side), to a bus endpoint of a test
service and to a real coordinator; `collm wire decode` is the installed command, fed a msgpack reply
with the newlines the CLI prints after it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import nats
import pytest

from collm_common import subjects
from collm_common.bus import ERROR_CODE_HEADER, ERROR_HEADER, Bus, BusError, ServiceFailure
from collm_common.clock import WallClock
from collm_common.settings import CommonSettings
from collm_common.wire import encode
from collm_common.wire.control import (
    CONTROL_COMMAND,
    ControlReply,
    CoordinatorStatusRequest,
    SetFineTuneShare,
)
from collm_coordinator.service import Coordinator
from collm_coordinator.settings import CoordinatorSettings

pytestmark = pytest.mark.integration

COLLM = Path(sys.executable).parent / "collm"
# What `-H Content-Type:application/json` puts on the message (the CLI splits K:V at the first colon).
CLI_JSON_HEADER = {"Content-Type": "application/json"}
# What `nats req --raw` prints after a body that does not end in a newline (Println, then two more).
CLI_REQ_RAW_SUFFIX = b"\n\n\n"


async def cli_request(url: str, subject: str, body: bytes, headers: dict[str, str] | None) -> Any:
    """One request as the NATS CLI makes it: its own connection, the body and headers as typed. The
    condition it needs is an endpoint the server routes to: "no responders" (the endpoint's
    subscription not yet visible to this connection on a loaded machine) is asked again, for up to
    10 s, as an operator would re-run the command."""
    nc = await nats.connect(url)
    loop = asyncio.get_running_loop()
    give_up = loop.time() + 10.0
    try:
        while True:
            try:
                return await nc.request(subject, body, timeout=5, headers=headers)
            except nats.errors.NoRespondersError:
                if loop.time() > give_up:
                    raise
                await nc.flush()
    finally:
        await nc.close()


def collm_decode(type_name: str, printed: bytes) -> dict[str, Any]:
    proc = subprocess.run(
        [str(COLLM), "wire", "decode", type_name], input=printed, capture_output=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


async def test_endpoint_answers_json_in_json_and_msgpack_in_msgpack(nats_server) -> None:
    bus = await Bus.connect(CommonSettings(nats_url=nats_server.url, nats_connect_timeout_s=5), "t")
    try:
        svc = await bus.service(subjects.SERVICE_REPLICA, "0.1.0", "test", {"replica_id": "r9"})

        async def control(cmd, _headers):
            if cmd.share > 0.9:
                raise ServiceFailure(409, "share too high")
            return ControlReply(ok=True, message=f"share={cmd.share}", detail={"reason": cmd.reason})

        subject = subjects.replica("r9", "control")
        await svc.endpoint("control", subject, CONTROL_COMMAND, control)
        url = nats_server.url

        typed = b'{"op": "set_share", "share": 0.5, "ttl_s": 30, "reason": "operator"}'
        msg = await cli_request(url, subject, typed, CLI_JSON_HEADER)
        assert msg.headers == {"Content-Type": "application/json"}
        doc = json.loads(msg.data)
        assert doc == {"v": 1, "ok": True, "message": "share=0.5", "detail": {"reason": "operator"}}

        # The header's name in lower case, a charset parameter: still JSON.
        msg = await cli_request(url, subject, typed, {"content-type": "application/json; charset=utf-8"})
        assert json.loads(msg.data)["ok"] is True

        # msgpack requests are answered as before (and the bus's own client reads them).
        msg = await cli_request(url, subject, encode(SetFineTuneShare(share=0.25)), None)
        assert not msg.headers and msg.data[:1] != b"{"
        reply = await bus.request(subject, SetFineTuneShare(share=0.25), ControlReply)
        assert reply.message == "share=0.25"

        # Bad JSON, a JSON message the schema refuses, and the same refused as msgpack: one error reply
        # each, with micro's headers, and the service keeps serving.
        bad_json = await cli_request(url, subject, b'{"op": "set_share", "share": }', CLI_JSON_HEADER)
        assert bad_json.headers[ERROR_CODE_HEADER] == "400"
        assert (
            "malformed JSON" in bad_json.headers[ERROR_HEADER]
            and "line 1 column" in bad_json.headers[ERROR_HEADER]
        )
        assert bad_json.data == b""
        invalid_json = await cli_request(url, subject, b'{"op": "set_share", "share": 2}', CLI_JSON_HEADER)
        invalid_msgpack = await cli_request(
            url, subject, msgpack.packb({"op": "set_share", "share": 2}), None
        )
        for err in (invalid_json, invalid_msgpack):
            assert err.headers[ERROR_CODE_HEADER] == "400" and err.data == b""
            assert err.headers[ERROR_HEADER] == invalid_msgpack.headers[ERROR_HEADER]
            assert "share" in err.headers[ERROR_HEADER]
        refused = await cli_request(url, subject, b'{"op": "set_share", "share": 0.95}', CLI_JSON_HEADER)
        assert (
            refused.headers[ERROR_CODE_HEADER] == "409" and refused.headers[ERROR_HEADER] == "share too high"
        )
        with pytest.raises(BusError) as err_info:
            await bus.request(subject, SetFineTuneShare(share=0.95), ControlReply)
        assert err_info.value.code == 409

        stats = json.loads((await bus.nc.request("$SRV.STATS.collm-replica", b"", timeout=2)).data)
        assert stats["endpoints"][0]["num_requests"] == 9
        assert stats["endpoints"][0]["num_errors"] == 5
    finally:
        await bus.close()


@pytest.fixture
async def coordinator(nats_server) -> AsyncIterator[str]:
    """A real coordinator (no replicas, no store) on its own connection; yields the NATS URL."""
    settings = CoordinatorSettings(
        nats_url=nats_server.url, nats_connect_timeout_s=5, coordinator_use_store=False
    )
    bus = await Bus.connect(settings, "coordinator")
    coord = Coordinator(settings, bus, WallClock())
    await coord.start()
    try:
        yield nats_server.url
    finally:
        await coord.stop()
        await bus.close()


async def test_coordinator_status_and_policy_in_json(coordinator: str) -> None:
    msg = await cli_request(coordinator, subjects.coordinator("status"), b"{}", CLI_JSON_HEADER)
    assert msg.headers == {"Content-Type": "application/json"}
    status = json.loads(msg.data)
    assert status["policy"] == "collm" and status["live"] == [] and status["v"] == 1

    # An empty body with the JSON header is the empty request too (`nats req SUBJECT '' -H ...`).
    msg = await cli_request(coordinator, subjects.coordinator("status"), b"", CLI_JSON_HEADER)
    assert json.loads(msg.data)["policy"] == "collm"

    msg = await cli_request(coordinator, subjects.coordinator("policy"), b"{}", CLI_JSON_HEADER)
    policy = json.loads(msg.data)
    assert policy["policy"] == "collm" and "separate" in policy["policies"]

    # The coordinator's own refusal of a well-formed request keeps its code.
    msg = await cli_request(
        coordinator, subjects.coordinator("policy"), b'{"policy": "nope"}', CLI_JSON_HEADER
    )
    assert msg.headers[ERROR_CODE_HEADER] == "400" and "unknown policy 'nope'" in msg.headers[ERROR_HEADER]


async def test_coordinator_refuses_invalid_json_with_an_error_reply(coordinator: str) -> None:
    for body, reason in (
        (b"{", "malformed JSON for collm.v1.CoordinatorStatusRequest"),
        (b"[]", "collm.v1.CoordinatorStatusRequest must be a JSON object, got an array"),
        (b'{"v": 7}', "unsupported schema version 7"),
    ):
        msg = await cli_request(coordinator, subjects.coordinator("status"), body, CLI_JSON_HEADER)
        assert msg.headers[ERROR_CODE_HEADER] == "400", msg.headers
        assert reason in msg.headers[ERROR_HEADER] and msg.data == b""
    # ... and still answers the next request.
    msg = await cli_request(coordinator, subjects.coordinator("status"), b"{}", CLI_JSON_HEADER)
    assert json.loads(msg.data)["policy"] == "collm"


async def test_msgpack_reply_printed_by_the_cli_decodes(coordinator: str) -> None:
    """`collm wire encode ... | nats req ... --force-stdin --raw | collm wire decode CoordinatorStatus`:
    the reply is msgpack, and the CLI prints newlines after it."""
    body = encode(CoordinatorStatusRequest())
    msg = await cli_request(coordinator, subjects.coordinator("status"), body, None)
    assert ERROR_CODE_HEADER not in (msg.headers or {})
    for suffix in (b"\n", CLI_REQ_RAW_SUFFIX):
        doc = collm_decode("CoordinatorStatus", msg.data + suffix)
        assert doc["policy"] == "collm" and doc["live"] == []


@pytest.mark.skipif(shutil.which("nats") is None, reason="the NATS CLI (`nats`) is not installed")
async def test_the_real_nats_cli(coordinator: str) -> None:
    """The documented commands with the real CLI, where one is installed."""
    base = ["nats", "--server", coordinator, "--timeout", "5s"]

    def run(*args: str) -> bytes:
        proc = subprocess.run([*base, *args], capture_output=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr.decode()
        return proc.stdout

    subject = subjects.coordinator("status")
    printed = await asyncio.to_thread(
        run, "req", subject, "{}", "-H", "Content-Type:application/json", "--raw"
    )
    assert json.loads(printed)["policy"] == "collm"
    printed = await asyncio.to_thread(run, "req", subject, "", "--raw")
    assert collm_decode("CoordinatorStatus", printed)["policy"] == "collm"
