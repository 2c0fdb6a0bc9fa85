"""NATS micro discovery for machines without the NATS CLI: what `nats micro ls|info|stats` shows.

Requests `$SRV.<VERB>[.<name>[.<id>]]` and gathers every answer that arrives within the timeout.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats

from collm_common.bus import inbox_prefix


async def gather(
    nats_url: str,
    verb: str,
    name: str | None = None,
    timeout_s: float = 0.5,
    user: str | None = None,
    password: str | None = None,
) -> list[dict[str, Any]]:
    subject = "$SRV." + verb.upper() + (f".{name}" if name else "")

    async def quiet(_exc: Exception) -> None:  # the caller reports the failure once
        return None

    # max_reconnect_attempts=1: nats-py drops a server from its pool only past a positive limit, so 0
    # would retry a dead server forever; the overall deadline bounds it regardless.
    servers = [u.strip() for u in nats_url.split(",")]
    nc = await asyncio.wait_for(
        nats.connect(
            servers,
            connect_timeout=2,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.2,
            allow_reconnect=False,
            user=user,
            password=password,
            inbox_prefix=inbox_prefix(user, servers),  # a secured server allows a user only its own
            error_cb=quiet,
        ),
        timeout=5.0,
    )
    try:
        inbox = nc.new_inbox()
        replies: list[dict[str, Any]] = []

        async def on_msg(msg: Any) -> None:
            if msg.data:
                replies.append(json.loads(msg.data))

        sub = await nc.subscribe(inbox, cb=on_msg)
        await nc.publish(subject, b"", reply=inbox)
        await nc.flush()
        await asyncio.sleep(timeout_s)
        await sub.unsubscribe()
        return sorted(replies, key=lambda r: (r.get("name", ""), r.get("id", "")))
    finally:
        await nc.close()
