"""The replica engine (`loop.Engine`) and its public types.

`loop` runs the engine thread and is the API of the other threads; `core` the iteration; `types` holds
the settings, requests, events, the snapshot and the refusals; `sequence` a request's choices; `batcher`
the stateful scheduler (queues, admission, preemption, the KV blocks and the prefix cache); `scheduler`
the batch plan and the background-work decision (pure), `cosched` the co-schedulers; `kv` the paged KV
cache's block manager and `prefix_cache` the keys of its shared blocks (pure); `runner` and `executor`
the model's passes; `output` the requests' streams; `slots` the adapter slot table; `background` the
evaluations and training jobs run between iterations.
"""

from collm_replica.engine.loop import Engine
from collm_replica.engine.types import (
    BASE,
    EngineConfig,
    EngineRefusal,
    EngineRequest,
    EngineSnapshot,
    EventSink,
    JobEvent,
    NotResident,
    eval_dtype,
    parse_version_id,
)

__all__ = [
    "BASE",
    "Engine",
    "EngineConfig",
    "EngineRefusal",
    "EngineRequest",
    "EngineSnapshot",
    "EventSink",
    "JobEvent",
    "NotResident",
    "eval_dtype",
    "parse_version_id",
]
