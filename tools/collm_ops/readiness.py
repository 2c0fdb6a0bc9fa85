"""When a launched stack serves (`collm_ops.launcher`): its replicas answer NATS micro's `$SRV.PING` and its
gateway's `/readyz` says ready."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Set

import httpx

from collm_ops.children import Child


def replicas_answering(nats_url: str, user: str | None, password: str | None) -> set[str]:
    """Replica ids that answer `$SRV.PING.collm-replica` (NATS micro) at `nats_url`, logged in as
    `user`; none while NATS does not answer."""
    from collm_ops.micro import gather

    try:
        found = asyncio.run(gather(nats_url, "PING", "collm-replica", 0.5, user=user, password=password))
    except Exception:  # NATS not up (yet): nobody answers
        found = []
    return {str(p.get("metadata", {}).get("replica_id")) for p in found}


def wait_ready(
    want: Set[str],
    answering: Callable[[], set[str]],
    check_children: Callable[[], None],
    gateway_url: str,
    deadline_s: float,
) -> None:
    """Until every replica in `want` is `answering()` and the gateway at `gateway_url` answers `/readyz`
    with 200, polling every 0.5 s; `check_children()` raises when a child has exited meanwhile; a
    TimeoutError at `deadline_s` (monotonic clock)."""
    while time.monotonic() < deadline_s:
        check_children()
        have = answering() if want else set()
        if want <= have:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"{gateway_url}/readyz", timeout=1.0)
                if r.status_code == 200:
                    return
        time.sleep(0.5)
    raise TimeoutError("the stack did not become ready in time")


def wait_replica(
    replica_id: str, child: Callable[[], Child], answering: Callable[[], set[str]], timeout_s: float
) -> float:
    """Until replica `replica_id` is `answering()`, polling every 0.2 s; returns the seconds waited. A
    RuntimeError when its process (`child()`) exits first, a TimeoutError after `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        c = child()
        if c.proc.poll() is not None:
            raise RuntimeError(f"replica {replica_id} exited with code {c.proc.returncode}")
        if replica_id in answering():
            return time.monotonic() - t0
        time.sleep(0.2)
    raise TimeoutError(f"replica {replica_id} did not answer within {timeout_s:.0f}s")
