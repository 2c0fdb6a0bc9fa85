"""The replica's local data: the dataset it loads at start and the training samples it receives.

* `load_local_dataset`: the data directory plus the samples persisted while running, each example once,
  into its train or eval split.
* `SamplesConsumer`: a durable JetStream consumer (`replica-<id>`) of `subjects.samples(id)` that
  persists each batch of samples (msgpack, or JSON when published with `Content-Type:
  application/json`) in `samples_dir` (`collm-samples.jsonl`), hands them to the engine, then acks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from collm_common import subjects
from collm_common.bus import Bus
from collm_common.clock import Clock, WallClock
from collm_common.data import Example, LocalDataset, load_dataset, read_file, write_jsonl
from collm_common.wire import WireError, decode_payload
from collm_common.wire.adapters import TrainingSample
from collm_replica.engine import Engine
from collm_replica.settings import ReplicaSettings

log = logging.getLogger(__name__)

SAMPLES_FILE = "collm-samples.jsonl"
SAMPLES_SUBDIR = "samples"


def samples_dir(settings: ReplicaSettings) -> Path:
    """Where samples received while running are persisted (`collm-samples.jsonl`): `<data_dir>/samples/`,
    or `.collm/replica-<id>/samples/` when the replica has no data directory. The one place: nothing else
    writes there, and `load_local_dataset` reads it exactly once."""
    if settings.data_dir is None:
        return Path(".collm") / f"replica-{settings.replica_id}" / SAMPLES_SUBDIR
    return Path(settings.data_dir) / SAMPLES_SUBDIR


def load_local_dataset(settings: ReplicaSettings) -> LocalDataset:
    """The replica's local dataset, each example loaded once, into its split:

    * the data directory: with `train/` (and `eval/`) sub-directories their files give the split as
      written; otherwise (a flat directory) the stable hash of each example's id decides it;
    * persisted samples (`samples_dir`): always the stable hash of the id, exactly as when they arrived
      (`Engine.add_examples`), so a restart never moves a sample from one split to the other.

    A repeated id (a sample redelivered and persisted twice) keeps its first occurrence."""
    ds = LocalDataset([], [])
    seen: set[str] = set()

    def put(e: Example, split: str | None) -> None:
        if e.id in seen:
            return
        seen.add(e.id)
        if split is None:
            ds.add(e, settings.eval_fraction)
        else:
            (ds.train if split == "train" else ds.eval).append(e)

    sdir = samples_dir(settings)
    d = settings.data_dir
    if d is not None and Path(d).is_dir():
        d = Path(d)
        if (d / "train").is_dir():
            part = load_dataset(d, settings.eval_fraction)  # reads train/ and eval/ only
            for e in part.train:
                put(e, "train")
            for e in part.eval:
                put(e, "eval")
        else:
            for path in sorted(d.rglob("*")):
                if path.suffix in (".jsonl", ".csv") and path.is_file() and sdir not in path.parents:
                    for e in read_file(path):
                        put(e, None)
    if sdir.is_dir():
        for path in sorted(sdir.glob("*.jsonl")):
            for e in read_file(path):
                put(e, None)
    return ds


def append_samples(path: Path, examples: list[Example]) -> None:
    """Append `examples` to the JSONL file at `path` (created with its directory)."""
    write_jsonl(path, examples, append=True)


class SamplesConsumer:
    """The durable consumer of this replica's training samples (see module docstring)."""

    def __init__(
        self, settings: ReplicaSettings, bus: Bus, engine: Engine, clock: Clock | None = None
    ) -> None:
        self.s = settings
        self.clock = clock or WallClock()
        self.bus = bus
        self.engine = engine

    async def run(self) -> None:
        """Consume until cancelled (subscribing as soon as JetStream is ready)."""
        from nats.js.api import AckPolicy, ConsumerConfig

        path = samples_dir(self.s) / SAMPLES_FILE
        sub = None
        while sub is None:
            try:
                sub = await self.bus.js.pull_subscribe(
                    subjects.samples(self.s.replica_id),
                    durable=f"replica-{self.s.replica_id}",
                    stream=subjects.STREAM_SAMPLES,
                    config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=256),
                )
            except Exception as exc:  # noqa: BLE001 - JetStream not ready yet
                log.debug("samples consumer not ready: %s", exc)
                await self.clock.sleep(2.0)
        try:
            await self._consume(sub, path)
        finally:
            # A pull subscription left behind by a cancelled fetch holds the connection's drain (the last
            # step of a stop) for its whole drain timeout (30 s): the process would outlive a SIGTERM.
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _consume(self, sub: Any, path: Path) -> None:
        while True:
            try:
                msgs = await sub.fetch(64, timeout=1.0)
            except TimeoutError:
                continue
            except Exception as exc:  # noqa: BLE001 - reconnecting
                log.debug("samples fetch failed: %s", exc)
                await self.clock.sleep(1.0)
                continue
            examples = []
            for m in msgs:
                try:
                    s = decode_payload(TrainingSample, m.data, m.headers)
                except WireError as exc:
                    log.warning("dropping a malformed training sample: %s", exc)
                    await m.term()
                    continue
                examples.append(Example(s.sample_id, s.prompt, s.response, s.system, s.domain or s.adapter))
            if examples:
                await asyncio.to_thread(append_samples, path, examples)
                await asyncio.wrap_future(self.engine.add_examples(examples))
            for m in msgs:
                with contextlib.suppress(Exception):
                    await m.ack()
