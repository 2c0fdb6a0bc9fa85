"""The replica as a participant of federated rounds: training jobs, their updates, candidate evaluations.

* `start_training(StartTraining)`: the job of an adapter from a stored base version (None: the current
  one; `name@v1` is created when the adapter has none), run by the engine in the slack of serving.
  With a `round_id` the replica is that round's participant until its update is sent.
  A round job whose base lacks this replica's own change of its last round (async rounds: that round
  has not published yet) starts from the base plus that change and sends only its own (`own_progress`).
* Job events from the engine: a local refresh is counted; a round job's end (`round_update`) becomes
  `store.put_update` plus a `LocalUpdate` on JetStream (`subjects.update`, `Nats-Msg-Id`
  `update-<round>-<replica>` for dedupe). While Redis is unreachable (a restart) the upload, and while
  JetStream does not acknowledge (a stream electing a leader after a lost NATS node) the announcement,
  is retried with backoff (0.1 s doubling to 1 s) until `UPDATE_SEND_MARGIN_S` before the round's
  deadline (`UPDATE_RETRY_BOUND_S` for a round without one); an update that could not be stored or
  announced by then is logged and counted as not sent (`collm_replica_round_updates_total{outcome}`).
* `evaluate(EvaluateCandidate)`: held-out losses of a candidate (a blob under `candidate_key`, or a stored
  version) and of the current version on the local eval split, per domain (`EvalReport`); of a stored
  version, with `task_examples`, also its task metric per domain (`task_eval.TaskEvaluator`).

Refusals are `ReplicaError`s: 404 unknown adapter, version or blob; 409 a job that cannot start (no local
data); 422 a blob that is not an adapter of this base model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, NamedTuple

import redis.exceptions
import torch

from collm_common import subjects, tracing
from collm_common.bus import Bus
from collm_common.clock import Clock, WallClock
from collm_common.lora import decode_adapter, encode_adapter
from collm_common.store import (
    AdapterStore,
    Conflict,
    CorruptBlob,
    NotFound,
    StoreError,
    sha256_hex,
    version_id,
)
from collm_common.wire import encode
from collm_common.wire.control import ControlReply, StartTraining
from collm_common.wire.rounds import DomainLoss, EvalReport, EvaluateCandidate, LocalUpdate
from collm_common.wire.telemetry import TrainingJobStatus
from collm_replica import metrics
from collm_replica.adapters import AdapterManager
from collm_replica.engine import Engine, JobEvent
from collm_replica.errors import ReplicaError
from collm_replica.lora_bank import AdapterMismatch, LiveLora
from collm_replica.models import LoadedModel
from collm_replica.own_progress import OwnProgress, sent_tensors, start_point
from collm_replica.task_eval import TaskEvaluator
from collm_replica.tasks import Tasks
from collm_replica.training import JobSpec

log = logging.getLogger(__name__)

# Redis unreachable (down or restarting): an update's upload waits for it (`_store_update`).
STORE_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, ConnectionError)
# An update must be on JetStream this long before its round's deadline for the aggregator to read and
# validate it in time: retrying the upload stops here.
UPDATE_SEND_MARGIN_S = 0.5
# Retrying the upload of a round without a deadline (an operator's StartTraining) stops after this long.
UPDATE_RETRY_BOUND_S = 120.0
ROUND_DEADLINES_KEPT = 64
ROUND_JOBS_KEPT = 8


class _RoundJob(NamedTuple):
    """A round job's base tensors and the offset its start carried (`own_progress`)."""

    base: dict[str, torch.Tensor]
    offset: dict[str, torch.Tensor]


def _give_up_unix_s(deadline_unix_s: float | None, now_unix_s: float) -> float:
    """When retrying an update's upload or announcement stops: `UPDATE_SEND_MARGIN_S` before the
    round's deadline, or `UPDATE_RETRY_BOUND_S` from now for a round without one."""
    if deadline_unix_s is not None:
        return deadline_unix_s - UPDATE_SEND_MARGIN_S
    return now_unix_s + UPDATE_RETRY_BOUND_S


class Participant:
    """See module docstring."""

    def __init__(
        self,
        replica_id: str,
        loaded: LoadedModel,
        engine: Engine,
        store: AdapterStore,
        bus: Bus,
        adapters: AdapterManager,
        tasks: Tasks,
        task_metrics: dict[str, str] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.rid = replica_id
        self.clock = clock or WallClock()
        self.task_eval = TaskEvaluator(engine, adapters, loaded.tokenizer, task_metrics or {})
        self.loaded = loaded
        self.engine = engine
        self.store = store
        self.bus = bus
        self.adapters = adapters
        self.tasks = tasks
        self.round_role = "idle"
        self.round_id: int | None = None
        self._round_deadlines: dict[int, float | None] = {}  # round id -> deadline (Unix s) of its job
        self._round_jobs: dict[int, _RoundJob] = {}  # round id -> its job's base and carried offset
        self._progress: dict[str, OwnProgress] = {}  # adapter -> this replica's last sent change

    def role(self, jobs: list[TrainingJobStatus]) -> str:
        """The round role to report: a participant whose round's job is gone (failed) is idle."""
        if self.round_role == "participant" and not any(j.round_id == self.round_id for j in jobs):
            return "idle"
        return self.round_role

    # ================================================================================== training
    async def start_training(self, cmd: StartTraining) -> ControlReply:
        name = subjects.check_token(cmd.adapter, "adapter name")
        base = cmd.base_version
        if base is None:
            base = await self.store.current(name)
            if base is None:
                base = await self.adapters.create_initial(name)
        try:
            blob = await self.store.get_blob(name, base)
        except NotFound as exc:
            raise ReplicaError(404, str(exc), "not_found") from None
        weights = decode_adapter(blob)
        base_tensors, offset = weights.tensors, {}
        if cmd.round_id is not None and (carried := await self._carried(name, base, cmd.round_id)):
            start, offset = start_point(weights.tensors, carried)
            if offset:
                weights = dataclasses.replace(weights, tensors=start)
                log.info(
                    "round %d: %s starts from %s plus this replica's change of round %d (not in it yet)",
                    cmd.round_id, name, version_id(name, base), carried.round_id,
                )  # fmt: skip
        current = await self.store.current(name)
        # Serving the base version here is best effort and must never hold up the job (training needs no
        # slot) nor the control endpoint (its handler runs one request at a time): when every slot is
        # pinned by in-flight requests, the load waits in the background.
        self.adapters.prefetch(name, base, base == current)
        ex = self.engine.executor
        try:
            live = LiveLora.from_weights(
                weights, ex.n_layers, ex.shapes, self.loaded.dtype, self.loaded.device
            )
        except AdapterMismatch as exc:
            raise ReplicaError(
                422, f"{version_id(name, base)} cannot be trained here: {exc}", "invalid_adapter"
            ) from None
        spec = JobSpec(
            adapter=name,
            base_version_id=version_id(name, base),
            base_version=base,
            live=live,
            token_budget=cmd.token_budget,
            learning_rate=cmd.learning_rate,
            round_id=cmd.round_id,
            deadline_unix_s=cmd.deadline_unix_s,
        )
        status = await asyncio.wrap_future(self.engine.start_job(spec))
        self.adapters.track(name)
        if cmd.round_id is not None:
            self.round_role, self.round_id = "participant", cmd.round_id
            self._round_deadlines[cmd.round_id] = cmd.deadline_unix_s
            while len(self._round_deadlines) > ROUND_DEADLINES_KEPT:  # jobs that failed never send
                del self._round_deadlines[next(iter(self._round_deadlines))]
            self._round_jobs[cmd.round_id] = _RoundJob(base_tensors, offset)
            while len(self._round_jobs) > ROUND_JOBS_KEPT:
                del self._round_jobs[next(iter(self._round_jobs))]
        return ControlReply(
            ok=True,
            message=f"training {name} from {status.base_version_id} for {cmd.token_budget} tokens",
            detail={"base_version_id": status.base_version_id, "round_id": str(cmd.round_id or "")},
        )

    async def _carried(self, name: str, base: int, round_id: int) -> OwnProgress | None:
        """This replica's own change of its last round of `name` when version `base` lacks it (async
        rounds: that round has not published yet; see `own_progress`), else None."""
        carried = self._progress.get(name)
        if carried is None or carried.round_id >= round_id:
            return None
        try:
            rec = await self.store.get_version(name, base)
        except StoreError:
            return None
        by_round = rec.round_id if rec.source == "round" else None
        return carried if carried.missing_from(base, by_round) else None

    # ================================================================================== job events
    def on_job_event_threadsafe(self, ev: JobEvent) -> None:
        """The engine's job-event callback (engine thread): handled in a task on the service's loop."""
        self.tasks.spawn_threadsafe(lambda: self.on_job_event(ev))

    async def on_job_event(self, ev: JobEvent) -> None:
        if ev.kind == "refresh":
            metrics.SWAPS.labels(self.rid, "local_refresh").inc()
            log.info(
                "local refresh of %s -> %s (eval loss %s)", ev.adapter, ev.version_id, ev.status.eval_loss
            )
        elif ev.kind == "failed":
            log.error("training job %s failed", ev.adapter)
        elif ev.kind == "round_update" and ev.round_id is not None and ev.weights is not None:
            await self.send_update(ev)

    async def send_update(self, ev: JobEvent) -> None:
        assert ev.round_id is not None and ev.weights is not None and ev.base_version is not None
        job = self._round_jobs.pop(ev.round_id, None)
        if job is not None and job.offset:  # started from the base plus its last change: send only its own
            ev.weights.tensors = sent_tensors(ev.weights.tensors, job.offset)
        ev.weights.extra.update({"collm.replica_id": self.rid, "collm.round_id": str(ev.round_id)})
        blob = encode_adapter(ev.weights)
        deadline = self._round_deadlines.pop(ev.round_id, None)
        stored = await self._store_update(ev.round_id, blob, deadline)
        if stored is None:
            self.round_role = "done"
            return
        key, sha = stored
        upd = LocalUpdate(
            round_id=ev.round_id,
            adapter=ev.adapter,
            replica_id=self.rid,
            base_version=ev.base_version,
            blob_key=key,
            sha256=sha,
            num_samples=ev.num_samples,
            num_tokens=ev.num_tokens,
            train_loss=ev.train_loss,
            eval_loss_before=ev.eval_loss_before,
            eval_loss_after=ev.eval_loss_after,
            created_unix_s=self.clock.now(),
        )
        headers = tracing.inject({"Nats-Msg-Id": f"update-{ev.round_id}-{self.rid}"})
        give_up_s = _give_up_unix_s(deadline, self.clock.now())
        delay_s = 0.1
        sent = False
        while not sent:
            try:
                await self.bus.js.publish(
                    subjects.update(ev.round_id, self.rid), encode(upd), headers=headers
                )
                sent = True
            except Exception as exc:  # noqa: BLE001 - JetStream not ready: retry, dedupe makes it safe
                if self.clock.now() + delay_s > give_up_s:
                    break
                log.warning("publishing the update of round %d failed (%s); retrying", ev.round_id, exc)
                await self.clock.sleep(delay_s)
                delay_s = min(2 * delay_s, 1.0)
        self.round_role = "done"
        if not sent:
            metrics.ROUND_UPDATES.labels(self.rid, "not_sent_bus").inc()
            log.error(
                "round %d: update %s stored but not sent: JetStream did not acknowledge it in time",
                ev.round_id, key,
            )  # fmt: skip
            return
        metrics.ROUND_UPDATES.labels(self.rid, "sent").inc()
        log.info("round %d: update %s sent (%d tokens)", ev.round_id, key, ev.num_tokens)
        if job is not None:
            progress = OwnProgress.of(ev.round_id, ev.base_version, ev.weights.tensors, job.base)
            if progress is not None:
                self._progress[ev.adapter] = progress

    async def _store_update(
        self, round_id: int, blob: bytes, deadline_unix_s: float | None
    ) -> tuple[str, str] | None:
        """Store an update's blob: (key, sha256), or None (logged and counted) when it could not be.

        While Redis is unreachable (a restart) the upload is retried with backoff (0.1 s doubling to 1 s)
        until `UPDATE_SEND_MARGIN_S` before the round's deadline, after which the aggregator could not
        take the update anyway, or for `UPDATE_RETRY_BOUND_S` when the round has no deadline. The blob is
        written once (SET NX): an attempt whose reply was lost leaves it stored, and the retry then finds
        it and announces it."""
        give_up_s = _give_up_unix_s(deadline_unix_s, self.clock.now())
        delay_s = 0.1
        while True:
            try:
                return await self.store.put_update(round_id, self.rid, blob)
            except Conflict:
                log.warning("update for round %d already stored; announcing it", round_id)
                return self.store.update_key(round_id, self.rid), sha256_hex(blob)
            except STORE_UNREACHABLE as exc:
                if self.clock.now() + delay_s > give_up_s:
                    metrics.ROUND_UPDATES.labels(self.rid, "not_sent_store_unreachable").inc()
                    until = (
                        f"until {UPDATE_SEND_MARGIN_S:g} s before the round's deadline"
                        if deadline_unix_s is not None
                        else f"for {UPDATE_RETRY_BOUND_S:g} s"
                    )
                    log.error(
                        "round %d: update not sent: the adapter store stayed unreachable (%s) %s",
                        round_id, exc, until,
                    )  # fmt: skip
                    return None
                metrics.UPDATE_UPLOAD_RETRIES.labels(self.rid).inc()
                log.warning("round %d: adapter store unreachable (%s); retrying the upload", round_id, exc)
                await self.clock.sleep(delay_s)
                delay_s = min(2 * delay_s, 1.0)
            except Exception:
                metrics.ROUND_UPDATES.labels(self.rid, "not_sent_store_error").inc()
                log.exception("round %d: update not sent: the adapter store refused it", round_id)
                return None

    # ================================================================================== evaluate
    async def _read_candidate(self, key: str, sha: str) -> bytes:
        try:
            return await self.store.get_update(key, sha)
        except NotFound as exc:
            raise ReplicaError(404, str(exc), "not_found") from None
        except CorruptBlob as exc:
            raise ReplicaError(422, str(exc), "invalid_adapter") from None
        except StoreError:
            blob = await self.store.r.get(key)  # an aggregate written under another key of this store
            if blob is None:
                raise ReplicaError(404, f"candidate blob {key} does not exist", "not_found") from None
            if sha256_hex(blob) != sha:
                raise ReplicaError(
                    422, f"candidate blob {key} failed its sha256 check", "invalid_adapter"
                ) from None
            return bytes(blob)

    async def _stored_version(self, adapter: str, version: int) -> tuple[bytes, str]:
        try:
            rec = await self.store.get_version(adapter, version)
            return await self.store.get_blob(adapter, version), rec.sha256
        except NotFound as exc:
            raise ReplicaError(404, str(exc), "not_found") from None
        except CorruptBlob as exc:
            raise ReplicaError(422, str(exc), "invalid_adapter") from None

    async def evaluate(self, req: EvaluateCandidate) -> EvalReport:
        """Held-out losses of the candidate (and, with `score_current`, of `current_version`; None: the
        base model) on this replica's eval split, per domain, with the digest of the items scored.
        Scoring a stored version on its own (`candidate_version`) is background work of a round still
        collecting: it yields to candidates waiting on a publication."""
        if req.candidate_version is not None:
            cand_blob, cand_digest = await self._stored_version(req.adapter, req.candidate_version)
        else:
            cand_blob = await self._read_candidate(req.candidate_key, req.candidate_sha256)
            cand_digest = req.candidate_sha256
        try:
            cand = decode_adapter(cand_blob)
            scored: list[tuple[str, Any, str | None]] = [("candidate", cand, cand_digest)]
            if req.score_current:
                if req.current_version is None:
                    scored.append(("current", None, "base"))
                else:
                    blob, digest = await self._stored_version(req.adapter, req.current_version)
                    scored.append(("current", decode_adapter(blob), digest))
        except ValueError as exc:
            raise ReplicaError(422, f"not an adapter blob: {exc}", "invalid_adapter") from None
        try:
            runs = await asyncio.wrap_future(
                self.engine.evaluate(
                    [(label, w) for label, w, _ in scored],
                    req.max_examples,
                    adapter=req.adapter,
                    max_tokens=req.max_tokens,
                    digests=[d for _, _, d in scored],
                    priority=0 if req.candidate_version is not None else 1,
                    deadline_unix_s=req.deadline_unix_s,
                )
            )
        except AdapterMismatch as exc:
            raise ReplicaError(422, str(exc), "invalid_adapter") from None
        tasks = (
            await self.task_eval.score(req.adapter, req.candidate_version, req.task_examples)
            if req.task_examples > 0 and req.candidate_version is not None
            else {}
        )
        cand_run = runs["candidate"]
        cur_run = runs.get("current")
        cand_loss = cand_run.per_domain()
        cur_loss = cur_run.per_domain() if cur_run is not None else {}
        losses = []
        for d in sorted(cand_loss):
            cand_examples, tokens = cand_run.example_losses(d)
            cur_examples = cur_run.example_losses(d)[0] if cur_run is not None else []
            losses.append(
                DomainLoss(
                    domain=d,
                    num_examples=cand_run.examples.get(d, 0),
                    num_tokens=cand_run.tokens.get(d, 0),
                    current_loss=cur_loss.get(d),
                    candidate_loss=cand_loss[d],
                    eval_set=cand_run.eval_set.get(d, ""),
                    example_tokens=tokens,
                    candidate_example_loss=cand_examples,
                    current_example_loss=cur_examples,
                    **(
                        {"task_metric": t.metric, "task_score": t.score, "task_examples": t.examples}
                        if (t := tasks.get(d)) is not None
                        else {}
                    ),
                )
            )
        return EvalReport(replica_id=self.rid, adapter=req.adapter, losses=losses)
