"""JetStream streams CoLLM relies on, declared once and created idempotently by whoever starts first.

Each is created with the replicas that COLLM_NATS_STREAM_REPLICAS sets (`CommonSettings`): 1 on one
nats-server, 3 on a three-node cluster, where a stream keeps accepting and serving messages while one
node is down.
"""

from __future__ import annotations

import contextlib
import dataclasses

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from collm_common import subjects

STREAMS = {
    subjects.STREAM_UPDATES: StreamConfig(
        name=subjects.STREAM_UPDATES,
        subjects=[subjects.updates_all()],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=7 * 24 * 3600,
        max_msg_size=64 * 1024,
        duplicate_window=600,
        discard=DiscardPolicy.OLD,
    ),
    subjects.STREAM_SAMPLES: StreamConfig(
        name=subjects.STREAM_SAMPLES,
        subjects=[subjects.samples_all()],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=30 * 24 * 3600,
        max_msg_size=256 * 1024,
        duplicate_window=3600,
        discard=DiscardPolicy.OLD,
    ),
}


async def ensure_streams(js: JetStreamContext, replicas: int) -> None:
    """Create every stream that does not exist yet, with `replicas` copies (`nats_stream_replicas`); an
    existing stream is left as it is."""
    for cfg in STREAMS.values():
        try:
            await js.stream_info(cfg.name)
        except Exception:
            with contextlib.suppress(BadRequestError):  # created concurrently by another service
                await js.add_stream(dataclasses.replace(cfg, num_replicas=replicas))
