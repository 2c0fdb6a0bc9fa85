"""Every NATS CLI recipe in docs/operations.md, proven against the running stack.

The NATS CLI is not installed here, so each `nats ...` stage of a recipe is carried out with nats-py by
sending exactly what the CLI sends (`$SRV.PING|INFO|STATS`, a core request or publish with the body and
the `-H K:V` headers as typed, a subscription, the JetStream API) and printing what it prints (`--raw`:
each body followed by newlines, `nil body` for an empty one), and each `collm ...` stage runs the real
`collm` command with the previous stage's output on its stdin. A JSON request must get a JSON reply
(`Content-Type: application/json`) that validates as the endpoint's reply type; a recipe whose request
is refused names the error code it expects in a trailing `# Nats-Service-Error-Code: N` comment. The
recipes are read from the document, so a recipe added there without a way to check it here fails this
test.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest

from collm_common import subjects
from collm_common.bus import ERROR_CODE_HEADER, ERROR_HEADER
from collm_common.wire import decode, wants_json
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_ops.wire_tools import resolve

from .conftest import COLLM, OpsStack

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[3] / "docs" / "operations.md"


def recipes() -> list[str]:
    text = DOC.read_text()
    block = text.split("<!-- recipes:begin -->", 1)[1].split("<!-- recipes:end -->", 1)[0]
    lines = []
    for fenced in re.findall(r"```sh\n(.*?)```", block, re.DOTALL):
        lines += [ln.strip() for ln in fenced.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return lines


def stages(line: str) -> list[list[str]]:
    lex = shlex.shlex(line, posix=True, punctuation_chars="|")
    lex.whitespace_split = True
    out: list[list[str]] = [[]]
    for tok in lex:
        if tok == "|":
            out.append([])
        else:
            out[-1].append(tok)
    return out


@dataclass
class Result:
    stdout: bytes
    outputs: list[bytes]  # the bodies: `nats sub` one per message, `nats req` the reply's
    error_code: str | None = None  # `nats req`: the reply's Nats-Service-Error-Code
    reply_kind: str | None = None  # `nats req` in JSON: the reply's type


# The reply type of each request/reply subject the recipes use (`collm_common.wire`).
REPLY_KINDS = {
    ("replica", "status"): "ReplicaTelemetry",
    ("replica", "control"): "ControlReply",
    ("coordinator", "status"): "CoordinatorStatus",
    ("coordinator", "policy"): "PolicyReply",
    ("gateway", "status"): "GatewayStatus",
    ("aggregator", "status"): "AggregatorStatus",
    ("aggregator", "rounds"): "RoundList",
    ("aggregator", "round"): "RoundDetail",
}


def reply_kind(subject: str) -> str:
    tokens = subject.split(".")
    kind = REPLY_KINDS.get((tokens[2], tokens[-1]))
    assert kind, f"no reply type known for {subject}"
    return kind


def cli_headers(values: list[str]) -> dict[str, str]:
    """Headers as the CLI builds them from `-H K:V` (split at the first colon, both sides trimmed)."""
    out = {}
    for value in values:
        key, sep, val = value.partition(":")
        assert sep, f"the NATS CLI refuses the header {value!r}"
        out[key.strip()] = val.strip()
    return out


def printed_raw(body: bytes) -> bytes:
    """What `nats req --raw` prints for a reply body: the body and a newline, then one more, then a
    third when the body did not end in one; `nil body` for an empty body."""
    if not body:
        return b"nil body\n"
    return body + (b"\n" if body.endswith(b"\n") else b"\n\n\n")


class NatsCli:
    """What the NATS CLI does for the commands the recipes use, on nats-py."""

    def __init__(self, ops: OpsStack, nc: Any) -> None:
        self.ops = ops
        self.nc = nc

    async def run(self, argv: list[str], stdin: bytes) -> Result:
        assert argv[0] == "nats"
        args = argv[1:]
        flags = {a for a in args if a.startswith("-") and "=" not in a}
        pos = [a for i, a in enumerate(args) if not a.startswith("-") and not _is_flag_value(args, i)]
        headers = cli_headers(_flags(args, "-H", "--header"))
        cmd = pos[0]
        if cmd == "micro":
            return await self.micro(pos[1], pos[2] if len(pos) > 2 else None)
        if cmd in ("req", "request"):
            body = stdin if "--force-stdin" in flags else (pos[2].encode() if len(pos) > 2 else b"")
            return await self.request(pos[1], body, headers, raw="--raw" in flags or "-r" in flags)
        if cmd in ("pub", "publish"):
            body = stdin if "--force-stdin" in flags else (pos[2].encode() if len(pos) > 2 else b"")
            return await self.publish(pos[1], body, headers)
        if cmd in ("sub", "subscribe"):
            assert "--translate" not in flags and _flag(args, "--translate") is None, (
                "`--translate` runs its command where `nats` runs: in compose the nats-box container, "
                "which has no `collm`; pipe into `collm wire decode` instead"
            )
            assert "--raw" in flags, "a `nats sub` recipe prints raw bodies for `collm wire decode`"
            return await self.subscribe(pos[1], int(_flag(args, "--count") or 1))
        if cmd == "stream":
            return await self.stream(pos[1], pos[2] if len(pos) > 2 else None)
        if cmd == "consumer" and pos[1] in ("ls", "list"):
            infos = await self.nc.jetstream().consumers_info(pos[2])
            names = [c.name for c in infos]
            assert names, f"stream {pos[2]} has no consumers"
            return Result(json.dumps(names).encode(), [])
        raise AssertionError(f"docs show `{' '.join(argv)}`, which this test cannot check")

    async def micro(self, verb: str, name: str | None) -> Result:
        subject = {"ls": "$SRV.PING", "list": "$SRV.PING", "info": "$SRV.INFO", "stats": "$SRV.STATS"}[verb]
        subject += f".{name}" if name else ""
        inbox = self.nc.new_inbox()
        got: list[dict[str, Any]] = []

        async def on_msg(msg: Any) -> None:
            got.append(json.loads(msg.data))

        def answered() -> bool:
            if name is None:
                return {r["name"] for r in got} >= set(subjects.SERVICE_NAMES)
            return bool(got)

        sub = await self.nc.subscribe(inbox, cb=on_msg)
        await self.nc.publish(subject, b"", reply=inbox)
        # Collect for at least 0.5 s (every instance that answers), and until the answers it needs came.
        await asyncio.sleep(0.5)
        end = time.monotonic() + 30
        while not answered() and time.monotonic() < end:
            await asyncio.sleep(0.1)
        await sub.unsubscribe()
        assert got, f"nobody answered {subject}"
        if name is None:
            assert {r["name"] for r in got} >= set(subjects.SERVICE_NAMES), got
        else:
            assert all(r["name"] == name for r in got)
            if verb == "info":
                assert all(r["endpoints"] and all(e["subject"] for e in r["endpoints"]) for r in got)
            if verb == "stats":
                assert all("num_requests" in e for r in got for e in r["endpoints"])
        return Result(json.dumps(got).encode(), [])

    async def request(self, subject: str, body: bytes, headers: dict[str, str], raw: bool) -> Result:
        msg = await self.nc.request(subject, body, timeout=10, headers=headers or None)
        reply_headers = msg.headers or {}
        if raw:
            printed = printed_raw(msg.data)
        else:  # the reply's headers, a blank line, then the body
            lines = "".join(f"{k}: {v}\n" for k, v in reply_headers.items())
            printed = (lines + "\n" if lines else "").encode() + printed_raw(msg.data)
        if ERROR_CODE_HEADER in reply_headers:
            assert reply_headers.get(ERROR_HEADER), reply_headers
            return Result(printed, [], error_code=reply_headers[ERROR_CODE_HEADER])
        if not wants_json(headers):
            return Result(printed, [msg.data])
        assert reply_headers.get("Content-Type") == "application/json", (subject, reply_headers)
        return Result(printed, [msg.data], reply_kind=reply_kind(subject))

    async def publish(self, subject: str, body: bytes, headers: dict[str, str]) -> Result:
        before = await self.replica_status(subject)
        await self.nc.publish(subject, body, headers=headers or None)
        await self.nc.flush()
        if before is not None:  # a training sample: the replica takes it into its local data
            rid = before.replica_id
            end = time.monotonic() + 20
            while (await self.replica_status(subjects.samples(rid))).local_samples <= before.local_samples:  # type: ignore[union-attr]
                assert time.monotonic() < end, f"{rid} did not take the published sample"
                await asyncio.sleep(0.2)
        return Result(b"", [])

    async def replica_status(self, subject: str) -> ReplicaTelemetry | None:
        for rid in ("r0", "r1"):
            if subject == subjects.samples(rid):
                reply = await self.nc.request(subjects.replica(rid, "status"), b"", timeout=5)
                return decode(ReplicaTelemetry, reply.data)
        return None

    async def subscribe(self, pattern: str, count: int) -> Result:
        # The tap has recorded every collm.v1 message since the stack started: the latest `count` are
        # what a `nats sub` opened just before would have printed (`--raw`: each body and a newline).
        # Wait for more if there are not enough.
        end = time.monotonic() + 30
        while len(msgs := self.ops.tap.matching(pattern)) < count:
            assert time.monotonic() < end, f"fewer than {count} messages on {pattern}"
            await asyncio.sleep(0.2)
        bodies = [m.data for m in msgs[-count:]]
        return Result(b"".join(b + b"\n" for b in bodies), bodies)

    async def stream(self, verb: str, name: str | None) -> Result:
        js = self.nc.jetstream()
        if verb in ("ls", "list"):
            names = [s.config.name for s in await js.streams_info()]
            assert {subjects.STREAM_UPDATES, subjects.STREAM_SAMPLES} <= set(names), names
            return Result(json.dumps(names).encode(), [])
        assert verb == "info" and name
        info = await js.stream_info(name)
        assert info.config.name == name
        return Result(json.dumps({"messages": info.state.messages}).encode(), [])


def _flag(args: list[str], name: str) -> str | None:
    values = _flags(args, name)
    return values[-1] if values else None


def _flags(args: list[str], *names: str) -> list[str]:
    """Every value given to the flag called any of `names` (`--name VALUE` or `--name=VALUE`)."""
    out = []
    for i, a in enumerate(args):
        for name in names:
            if a == name and i + 1 < len(args):
                out.append(args[i + 1])
            elif a.startswith(name + "="):
                out.append(a.split("=", 1)[1])
    return out


def _is_flag_value(args: list[str], i: int) -> bool:
    return i > 0 and args[i - 1] in ("--count", "--translate", "--server", "--timeout", "-H", "--header")


def run_collm(ops: OpsStack, argv: list[str], stdin: bytes) -> bytes:
    assert argv[0] == "collm"
    proc = subprocess.run(
        [str(COLLM), *argv[1:]], input=stdin, capture_output=True, env=ops.env(), timeout=60, check=False
    )
    assert proc.returncode == 0, f"{' '.join(argv)} failed: {proc.stderr.decode()[-2000:]}"
    return proc.stdout


async def run_recipe(ops: OpsStack, nc: Any, line: str) -> tuple[Result, list[str]]:
    data = b""
    result = Result(b"", [])
    parts = stages(line)
    for argv in parts:
        if argv[0] == "nats":
            result = await NatsCli(ops, nc).run(argv, data)
        else:
            out = run_collm(ops, argv, data)
            result = Result(out, [out])
        data = result.stdout
    return result, parts[-1]


def check_output(line: str, result: Result, last: list[str]) -> None:
    """What each answer must say (the recipe's point, beyond "it decoded"): a `collm wire decode` stage's
    JSON, or a JSON request's reply, which must also validate as the endpoint's reply type."""
    expected_error = re.search(r"#\s*Nats-Service-Error-Code:\s*(\d+)", line)
    if result.error_code is not None or expected_error:
        assert expected_error and result.error_code == expected_error.group(1), (line, result.error_code)
        if "--raw" not in last:  # the CLI shows the error headers
            assert f"{ERROR_CODE_HEADER}: {result.error_code}".encode() in result.stdout
        return
    if last[0] == "collm":
        kind = last[-1]
    elif result.reply_kind is not None:
        kind = result.reply_kind
        resolve(kind).model_validate_json(result.outputs[0])  # type: ignore[union-attr]
        if "--raw" in last:  # what it prints is one JSON document (for `| jq`)
            json.loads(result.stdout)
    else:
        return
    docs = [json.loads(o) for o in result.outputs if o.strip().startswith(b"{")]
    assert docs, f"{line}: no JSON output"
    doc = docs[0]
    if kind == "ReplicaTelemetry":
        assert {d["replica_id"] for d in docs} <= {"r0", "r1"} and doc["model"] == "tiny"
        if "replica.r0.status" in line:
            assert doc["replica_id"] == "r0"
    elif kind == "ControlReply":
        assert doc["ok"] is True, doc
    elif kind == "CoordinatorStatus":
        assert doc["policy"] == "collm" and set(doc["live"]) == {"r0", "r1"}
    elif kind == "CoordinatorDecisions":
        assert doc["loop"] in ("fast", "slow") and doc["replicas"]
    elif kind == "GatewayStatus":
        assert {r["replica_id"] for r in doc["replicas"]} == {"r0", "r1"}
    elif kind == "AggregatorStatus":
        assert doc["instance_id"] and doc["last_round_id"] >= 1 and sum(doc["rounds_by_state"].values()) >= 1
    elif kind == "RoundDetail":
        assert doc["outcome"]["round_id"] == 1 and doc["plan"]["adapter"] == "ops"
    elif kind == "PolicyReply":
        assert doc["policy"] == "collm" and "separate" in doc["policies"]
    elif kind == "RoundList":
        assert doc["rounds"] and doc["rounds"][0]["adapter"] == "ops"
    elif kind == "RoundOutcome":
        assert doc["adapter"] == "ops" and doc["round_id"] >= 1
    elif kind == "AdapterPublished":
        assert doc["name"] == "ops" and doc["version_id"] == f"ops@v{doc['version']}"
    else:
        raise AssertionError(f"{line}: no check for {kind}")


def test_the_document_has_recipes() -> None:
    lines = recipes()
    assert len(lines) >= 10
    assert any(ln.startswith("nats micro ls") for ln in lines)
    json_header = "-H Content-Type:application/json"
    assert any(ln.startswith("nats req collm.v1.coordinator.status '{}' " + json_header) for ln in lines)
    assert any(ln.startswith("nats pub collm.v1.samples.r0 '{") and json_header in ln for ln in lines)
    assert any("nats sub collm.v1.telemetry.replica.r0" in ln and "collm wire decode" in ln for ln in lines)
    assert not any("--translate" in ln for ln in lines), "nats-box has no collm to translate with"


@pytest.mark.parametrize("line", recipes())
async def test_recipe(ops: OpsStack, ops_round: Any, line: str) -> None:
    nc = await nats.connect(ops.nats_url)
    try:
        result, last = await run_recipe(ops, nc, line)
    finally:
        await nc.close()
    check_output(line, result, last)
