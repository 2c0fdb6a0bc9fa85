"""Health probes for container health checks (`collm health http|micro`), exit code 0 when healthy.

The service images have Python but no curl or NATS CLI, so compose's health checks call these:
`collm health http http://127.0.0.1:8000/readyz` (an HTTP 200) and
`collm health micro collm-replica --meta replica_id=r0` (an instance of that NATS micro service with
that metadata answers `$SRV.PING`, which a replica only does once its model is loaded).
"""

from __future__ import annotations

import asyncio

import httpx
import nats

from collm_ops.micro import gather


def http_ok(url: str, timeout_s: float = 2.0) -> tuple[bool, str]:
    try:
        r = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return False, f"{url}: {type(exc).__name__}: {exc}"
    return r.status_code == 200, f"{url}: HTTP {r.status_code}"


def micro_ok(
    nats_url: str, service: str, meta: dict[str, str], timeout_s: float = 1.0, user: str | None = None,
    password: str | None = None,
) -> tuple[bool, str]:  # fmt: skip
    try:
        found = asyncio.run(gather(nats_url, "PING", service, timeout_s, user=user, password=password))
    except (OSError, nats.errors.Error, TimeoutError) as exc:
        return False, f"NATS at {nats_url}: {type(exc).__name__}: {exc}"
    matching = [p for p in found if all(str(p.get("metadata", {}).get(k)) == v for k, v in meta.items())]
    if matching:
        return True, f"{service} {meta or ''} answers ({len(matching)} instance(s))"
    return False, f"no {service} instance with {meta or 'any metadata'} answers $SRV.PING"
