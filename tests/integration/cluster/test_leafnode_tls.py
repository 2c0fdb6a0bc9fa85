"""A remote site's leaf node joins the hub over TLS (deploy/cluster/README.md, "Remote site"), with
the shipped configurations (deploy/cluster/leaf/: hub-leafnodes.conf, site-leaf.conf) given this
test's certificate paths and loopback ports.

Certificates are made on the fly with openssl: a CA, the hub's server certificate (127.0.0.1) and a
leaf's client certificate, both signed by the CA. The hub listens for leaf nodes with TLS and requires
a client certificate signed by the CA (`verify: true`); the leaf verifies the hub against the CA. Then
a message published at the leaf reaches a subscriber on the hub, a request from the leaf gets the hub's
reply, and a JetStream publish at the leaf (which runs no JetStream of its own) is stored in the hub's
stream. Interest crosses the leaf connection asynchronously, so each step first waits until the leaf's
monitoring endpoint (`/leafz?subs=1`) lists the hub's interest in the subject it publishes on. A leaf
without the CA (it cannot verify the hub) and a leaf without a client certificate (the hub refuses it)
never join.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.msg import Msg

from collm_common import subjects
from collm_common.streams import ensure_streams
from collm_ops.servers import ServerProcess, free_port, start_nats

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]

SUBJECT = "collm.v1.site.hello"
LEAF_DIR = Path(__file__).resolve().parents[3] / "deploy/cluster/leaf"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path) -> None:
    """ca.pem/ca.key, hub.pem/hub.key (server: IP 127.0.0.1), leaf.pem/leaf.key (client), in `d`."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=collm-test-ca",
        cwd=d,
    )
    for name, usage in (("hub", "serverAuth"), ("leaf", "clientAuth")):
        (d / f"{name}.ext").write_text(
            f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={usage}\n"
        )
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d,
        )  # fmt: skip


def shipped(name: str, d: Path, port: int) -> str:
    """deploy/cluster/leaf/`name` with this test's certificate directory and loopback ports."""
    text = (LEAF_DIR / name).read_text().replace("/etc/nats/tls", str(d))
    text = text.replace("0.0.0.0:7422", f"127.0.0.1:{port}")
    return re.sub(r"urls: \[[^\]]*\]", f'urls: ["tls://127.0.0.1:{port}"]', text)


def hub_config(d: Path, leaf_port: int, http_port: int) -> Path:
    """The shipped hub listener (hub-leafnodes.conf) on a hub with a monitoring port and a log file."""
    conf = d / "hub.conf"
    head = f'server_name: hub\nhttp: 127.0.0.1:{http_port}\nlog_file: "{d}/hub.log"\n'
    conf.write_text(head + shipped("hub-leafnodes.conf", d, leaf_port))
    return conf


def leaf_config(
    d: Path, name: str, leaf_port: int, drop: tuple[str, ...] = (), http_port: int | None = None
) -> Path:
    """The shipped site leaf (site-leaf.conf) without its users (the test's clients log in as nobody)
    and without the `drop`ped TLS settings; its own log file, a monitoring port only on `http_port`."""
    text = shipped("site-leaf.conf", d, leaf_port).replace("$NATS_SERVER_NAME", name)
    lines = [
        ln
        for ln in text.splitlines()
        if not ln.startswith(("include ", "http:")) and not any(ln.strip().startswith(k) for k in drop)
    ]
    conf = d / f"{name}.conf"
    http = f"http: 127.0.0.1:{http_port}\n" if http_port is not None else ""
    conf.write_text("\n".join(lines) + f'\nlog_file: "{d}/{name}.log"\n' + http)
    return conf


async def leaf_count(http_port: int) -> int:
    async with httpx.AsyncClient(timeout=2.0) as http:
        r = await http.get(f"http://127.0.0.1:{http_port}/leafz")
    return int(r.json().get("leafnodes", 0))


async def wait_leafs(http_port: int, want: int, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while await leaf_count(http_port) != want:
        assert loop.time() < end, f"the hub did not reach {want} leaf connection(s) in {timeout_s:.0f}s"
        await asyncio.sleep(0.1)


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a final `>` one or more."""
    pat, sub = pattern.split("."), subject.split(".")
    for i, tok in enumerate(pat):
        if tok == ">":
            return len(sub) > i
        if i >= len(sub) or (tok != "*" and tok != sub[i]):
            return False
    return len(pat) == len(sub)


async def wait_hub_interest(leaf_http_port: int, subject: str, timeout_s: float = 10.0) -> None:
    """Wait until the leaf knows that the hub has interest in `subject`: its leaf connection to the hub
    lists a matching subscription (`/leafz?subs=1` on the leaf's monitoring port)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as http:
        while True:
            leafs = (await http.get(f"http://127.0.0.1:{leaf_http_port}/leafz", params={"subs": 1})).json()
            subs = [s for leaf in leafs.get("leafs") or [] for s in leaf.get("subscriptions_list") or []]
            if any(subject_matches(s, subject) for s in subs):
                return
            assert loop.time() < end, f"the hub's interest in {subject} never reached the leaf: {subs}"
            await asyncio.sleep(0.05)


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[tuple[ServerProcess, int, int, Path]]:
    """The hub (JetStream, a TLS leaf listener); yields (server, leaf port, monitoring port, cert dir)."""
    certs = tmp_path / "certs"
    certs.mkdir()
    make_certs(certs)
    leaf_port, http_port = free_port(), free_port()
    srv = start_nats(workdir=tmp_path / "hub", config=hub_config(certs, leaf_port, http_port))
    try:
        yield srv, leaf_port, http_port, certs
    finally:
        srv.stop()


async def test_a_leaf_with_the_ca_joins_over_tls_and_carries_messages_requests_and_jetstream(
    hub: tuple[ServerProcess, int, int, Path], tmp_path: Path
) -> None:
    srv, leaf_port, http_port, d = hub
    leaf_http = free_port()
    conf = leaf_config(d, "site1", leaf_port, http_port=leaf_http)
    leaf = start_nats(workdir=tmp_path / "leaf", config=conf, jetstream=False)
    hub_nc = await nats.connect(srv.url)
    leaf_nc = await nats.connect(leaf.url)
    try:
        await wait_leafs(http_port, 1)
        got: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_msg(msg: Msg) -> None:
            await got.put(msg.data)

        async def on_request(msg: Msg) -> None:
            await msg.respond(b"hub:" + msg.data)

        await hub_nc.subscribe(SUBJECT, cb=on_msg)
        await hub_nc.subscribe(f"{SUBJECT}.rpc", cb=on_request)
        await hub_nc.flush()
        await wait_hub_interest(leaf_http, SUBJECT)
        await leaf_nc.publish(SUBJECT, b"from the site")
        assert await asyncio.wait_for(got.get(), 5) == b"from the site"
        await wait_hub_interest(leaf_http, f"{SUBJECT}.rpc")
        reply = await leaf_nc.request(f"{SUBJECT}.rpc", b"ping", timeout=5)
        assert reply.data == b"hub:ping"
        # A replica at the site publishes samples to the hub's stream through the leaf: once the leaf
        # knows of the stream's subjects and of the JetStream API (the stream's own subscription is
        # made on the hub when the stream is created).
        await ensure_streams(hub_nc.jetstream(), replicas=1)
        await wait_hub_interest(leaf_http, subjects.samples("r9"))
        await wait_hub_interest(leaf_http, f"$JS.API.STREAM.INFO.{subjects.STREAM_SAMPLES}")
        ack = await leaf_nc.jetstream().publish(subjects.samples("r9"), b"{}", timeout=5)
        assert ack.stream == subjects.STREAM_SAMPLES
        stored = await hub_nc.jetstream().get_msg(subjects.STREAM_SAMPLES, ack.seq)
        assert stored.subject == subjects.samples("r9")
    finally:
        await leaf_nc.close()
        await hub_nc.close()
        leaf.stop()


@pytest.mark.parametrize(
    ("case", "drop", "refuser", "reason"),
    [
        # No CA: the leaf cannot verify the hub's certificate (signed by a CA it does not trust).
        ("no-ca", ("ca_file",), "bad-no-ca", "signed by unknown authority"),
        # The CA but no client certificate: the hub (verify: true) refuses the handshake.
        ("no-cert", ("cert_file", "key_file"), "hub", "client didn't provide a certificate"),
    ],
)
async def test_a_leaf_without_the_ca_or_a_client_certificate_is_refused(
    hub: tuple[ServerProcess, int, int, Path],
    tmp_path: Path,
    case: str,
    drop: tuple[str, ...],
    refuser: str,
    reason: str,
) -> None:
    srv, leaf_port, http_port, d = hub
    conf = leaf_config(d, f"bad-{case}", leaf_port, drop)
    leaf = start_nats(workdir=tmp_path / case, config=conf, jetstream=False)
    hub_nc = await nats.connect(srv.url)
    leaf_nc = await nats.connect(leaf.url)
    try:
        got: list[bytes] = []

        async def on_msg(msg: Msg) -> None:
            got.append(msg.data)

        await hub_nc.subscribe(SUBJECT, cb=on_msg)
        await hub_nc.flush()
        for _ in range(20):  # 2 s: the leaf retries its remote every second
            await leaf_nc.publish(SUBJECT, b"from a refused site")
            await asyncio.sleep(0.1)
        # The side that refuses logs the failed TLS handshake (the leaf tries its remote every second: wait
        # for the first attempt's line however slow the machine).
        path = d / f"{refuser}.log"

        def refused() -> bool:
            text = path.read_text(errors="replace").lower() if path.exists() else ""
            return "tls handshake failure" in text and reason in text

        end = time.monotonic() + 30.0
        while not refused() and time.monotonic() < end:
            await asyncio.sleep(0.2)
        log = path.read_text(errors="replace").lower() if path.exists() else ""
        assert refused(), log[-2000:]
        assert await leaf_count(http_port) == 0
        assert got == []
    finally:
        await leaf_nc.close()
        await hub_nc.close()
        leaf.stop()
