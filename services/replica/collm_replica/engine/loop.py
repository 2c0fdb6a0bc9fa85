"""The replica engine: one thread that owns the model and runs schedule -> execute -> update forever.

Everything torch happens in that thread. Other threads (the asyncio service) talk to it only through
thread-safe calls: `submit` (admission checks under a lock, then an inbox), `cancel`, and commands that
run in the engine thread at the next iteration boundary (`install_version`, `start_job`, `evaluate`, ...),
answered through `concurrent.futures.Future`s. Events of a request (`Accepted`, `TokenChunk`s, `Finished`,
`GenerateError`: the wire messages of `collm_common.wire.inference`) go to the request's sink, a callable
that must be thread-safe (the service wraps `loop.call_soon_threadsafe`).

Each iteration (`core.EngineCore.step`): take new requests and commands; the scheduler plans the step
(`batcher.Batcher`: queues, admission and preemption over the paged KV cache and its prefix cache, on
the pure planner `scheduler.plan_iteration`); the co-scheduler decides how much background time fits
after it (`scheduler.decide_background`); the model runner runs the ragged multi-adapter batch
(`runner.ModelRunner` on `executor.Executor`), each sequence samples its next token and the output
processor detokenizes, stop-checks and streams it (`output.OutputProcessor`); then background work runs
in pieces of about one decoder layer (`executor.LayerPass`) while the next piece is predicted to end
within that time: first federated evaluations (on a publication's critical path; at least one piece per
iteration, so they progress under any load), then training micro-steps (which resume at the next
iteration where they stopped). An idle replica chains pieces back to back.

Adapter identity: a request is bound at admission to an exact version id (`base`, `name@vN`, or a local
refresh `name@vN+<replica>.<k>`), which pins its slot until it finishes; `Accepted` and `Finished` carry
that id.

The parts: `types` (settings, requests, events, the snapshot), `sequence` (a request's choices),
`batcher` (the stateful scheduler), `scheduler` (the batch plan and the background-work decision, pure),
`kv` (the block manager) and `prefix_cache` (the blocks' content keys and the hit counters), `runner`
and `executor` (the model's forward over the paged KV pool, and training passes), `output` (the
requests' streams), `slots.Slots` (the adapter slot table), `background.Evaluations` and
`background.Training` (the work between iterations), `core.EngineCore` (the iteration). `Engine`
composes them, runs the thread and is the API of the other threads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from operator import attrgetter
from typing import Any, Generic, TypeVar

import torch

from collm_common.data import Example, LocalDataset
from collm_common.lora import AdapterWeights
from collm_common.wire.inference import Accepted
from collm_common.wire.telemetry import TrainingJobStatus
from collm_replica.constrain import Grammars
from collm_replica.costs import LatencyWindow
from collm_replica.engine.background import Evaluations, Examples, Training
from collm_replica.engine.batcher import Batcher
from collm_replica.engine.core import EngineCore, StepLog
from collm_replica.engine.cosched import CoScheduler, make_coscheduler
from collm_replica.engine.executor import Executor, KVPool
from collm_replica.engine.output import OutputProcessor
from collm_replica.engine.sequence import Seq, SeqMaker
from collm_replica.engine.slots import Slots
from collm_replica.engine.types import (
    EngineConfig,
    EngineRequest,
    EngineSnapshot,
    EventSink,
    JobEvent,
    eval_dtype,
)
from collm_replica.lora_bank import LoraBank
from collm_replica.models import LoadedModel
from collm_replica.training import EvalRun, JobSpec, PieceWork, TrainingJob

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Part(Generic[T]):
    """An attribute of the engine that one of its parts keeps: `x = _Part[int]("core")` in `Engine`
    reads and writes `engine.core.x` (`part`: a dotted path of attributes from the engine; `name`: the
    part's attribute, when its name differs)."""

    def __init__(self, part: str, name: str = "") -> None:
        self._part = attrgetter(part)
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, engine: Any, owner: type | None = None) -> T:
        if engine is None:  # looked up on the class
            return self  # type: ignore[return-value]
        return getattr(self._part(engine), self.name)  # type: ignore[no-any-return]

    def __set__(self, engine: Any, value: T) -> None:
        setattr(self._part(engine), self.name, value)


def lora_bank(executor: Executor, cfg: EngineConfig, loaded: LoadedModel) -> LoraBank:
    """The LoRA bank the executor's passes read (`cfg.max_resident_adapters` slots), given to it; with
    `cfg.eval_matmul_dtype`, evaluation passes multiply in that dtype (`Executor.enable_fast_eval`), and
    with `cfg.small_step_f16_rows` the smallest inference steps in fp16
    (`Executor.enable_small_step_copies`)."""
    bank = LoraBank(
        cfg.max_resident_adapters,
        executor.n_layers,
        executor.shapes,
        cfg.lora_targets,
        cfg.lora_max_rank,
        loaded.dtype,
        loaded.device,
    )
    executor.bank = bank
    fast = eval_dtype(cfg.eval_matmul_dtype, loaded.device, loaded.dtype)
    if fast is not None and not executor.fast_all:
        executor.enable_fast_eval(fast)
    if cfg.small_step_f16_rows > 0:
        executor.enable_small_step_copies(torch.float16, cfg.small_step_f16_rows)
    return bank


class Engine:
    """See module docstring. The parts: `executor` (with the LoRA `bank`), `slots`, `batcher`, `output`,
    `core` (with the model runner, `evals` and `training`), the local `examples`; `window` holds the
    latency samples of the SLO window."""

    def __init__(
        self,
        loaded: LoadedModel,
        cfg: EngineConfig | None = None,
        coscheduler: CoScheduler | None = None,
        dataset: LocalDataset | None = None,
        on_job_event: Callable[[JobEvent], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        step_log: StepLog | None = None,
    ) -> None:
        self.cfg = cfg = cfg or EngineConfig()
        self.max_model_len = loaded.max_model_len
        self.on_job_event = on_job_event
        self.clock = clock
        # Shared with the service threads: the lock (the batcher's queues, the slot table, the latency
        # window), the commands for the engine thread and the events that wake and stop it.
        self._lock = threading.Lock()
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

        self.executor = Executor(loaded)
        self.bank = lora_bank(self.executor, cfg, loaded)
        self.window = LatencyWindow(cfg.slo_window_s)
        tok, vocab_size = loaded.tokenizer, int(loaded.config.vocab_size)
        grammars = Grammars(tok, vocab_size)
        self.slots = Slots(cfg, self.bank, self.executor.n_layers, self.executor.shapes, self._lock, clock)
        make = SeqMaker(tok, loaded.eos_token_ids, cfg, vocab_size, grammars)
        self.batcher = Batcher(
            cfg, self.executor, self.slots, make, self.window, self._lock, self._stop, clock,
            self.max_model_len,
        )  # fmt: skip
        release = self.batcher.release
        self.output = OutputProcessor(tok, grammars, cfg.replica_id, self.window, self._lock, release)
        self.examples = Examples(dataset or LocalDataset([], []), tok, cfg)
        cosched = coscheduler or make_coscheduler(
            cfg.coscheduler, cfg.fixed_every_iterations, slack_frac=cfg.train_slack_frac
        )
        self.core = EngineCore(
            cfg, loaded, self.executor, self.batcher, self.output, self.slots, self.examples, cosched,
            self._cmds, clock, wall, self._emit_job_event,
        )  # fmt: skip
        self.core.step_log = step_log

    # --- state kept by the parts ----------------------------------------------------------------------
    evals = _Part[Evaluations]("core")
    training = _Part[Training]("core")
    running = _Part[list[Seq]]("batcher")
    waiting = _Part[list[Seq]]("batcher")
    kv_pool = _Part[KVPool]("batcher")
    _active = _Part[dict[str, Seq]]("batcher", "active")  # requests in flight, by id
    arrivals_total = _Part[int]("batcher")
    preemptions_total = _Part[int]("batcher")
    generated_tokens_total = _Part[int]("output")
    iteration = _Part[int]("core")
    infer_ms_total = _Part[float]("core")  # wall time of inference iterations (forward, sampling, streaming)
    longest_background_ms = _Part[float]("core")  # longest stretch of background work between iterations
    train_limits = _Part[dict[str, int]]("core")  # iterations that served with a job active, by limit
    jobs = _Part[dict[str, TrainingJob]]("training")
    ft_tokens_total = _Part[int]("training")
    ft_loss = _Part[float | None]("training")
    last_work = _Part[PieceWork | None]("training")  # the last stretch of training (tests, benchmarks)
    train_ms_total = _Part[float]("training")  # wall time of training pieces
    training_paused = _Part[bool]("training", "paused")
    dataset = _Part[LocalDataset]("examples")
    eos_ids = _Part[set[int]]("batcher.make")  # of the requests admitted from now on
    step_log = _Part[StepLog | None]("core")  # told every inference step and stretch of background work
    prefill_tokens_total = _Part[int]("core.runner")
    forward_ms_total = _Part[float]("core.runner")  # of `infer_ms_total`, the model's forward passes
    # Known tokens of the sequences admitted, looked up in the prefix cache (0 when it is off), and of
    # those, the tokens taken from the cache instead of computed.
    prefix_cache_queries_total = _Part[int]("batcher.prefix", "queries_total")
    prefix_cache_hits_total = _Part[int]("batcher.prefix", "hits_total")

    @property
    def eval_ms_total(self) -> float:
        """Wall time of evaluation pieces (requests and jobs' own evaluations)."""
        return self.evals.ms_total + self.training.eval_ms_total

    # ===================================================================================== lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="collm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; requests still queued or running get a 503 error."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        for seq in list(self._active.values()):
            self.output.error(seq, 503, "the replica is shutting down", "service_unavailable")

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            try:
                worked = self._iteration()
            except Exception:  # noqa: BLE001 - the loop must survive a bad iteration
                log.exception("engine iteration failed")
                self.core.fail_running("internal error in the engine iteration")
                worked = False
            if not worked:
                self._wake.wait(0.05)

    def _iteration(self) -> bool:
        """One iteration of the engine thread (`EngineCore.step`); whether it did any work."""
        self._wake.clear()
        return self.core.step()

    def _emit_job_event(self, event: JobEvent) -> None:
        if self.on_job_event is not None:
            self.on_job_event(event)

    # ===================================================================================== thread-safe API
    def _command(self, fn: Callable[[], None]) -> None:
        self._cmds.put(fn)
        self._wake.set()

    def _call(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - delivered to the caller
                fut.set_exception(exc)

        self._command(run)
        return fut

    def submit(self, req: EngineRequest, sink: EventSink) -> Accepted:
        """Admit a request into the queue or raise EngineRefusal / NotResident (`Batcher.submit`). The
        sink gets `Accepted` (synchronously, before any other event), then the stream."""
        accepted = self.batcher.submit(req, sink)
        self._wake.set()
        return accepted

    def cancel(self, request_id: str) -> bool:
        """Stop a request (client gone). Returns whether it was in flight."""
        if not self.batcher.in_flight(request_id):
            return False
        self._command(lambda: self._cancel(request_id))
        return True

    def _cancel(self, request_id: str) -> None:
        for seq in self.batcher.cancelled(request_id):
            self.output.finish(seq, "cancelled", self.clock())

    def current_version(self, name: str) -> str | None:
        return self.slots.current_version(name)

    def is_resident(self, version_id: str) -> bool:
        return self.slots.is_resident(version_id)

    def global_version(self, name: str) -> int | None:
        """The newest store version of `name` installed here (local refreshes not counted)."""
        return self.slots.global_version(name)

    def forget_current(self, name: str) -> None:
        """`name` has no current version any more (`Slots.forget_current`)."""
        self.slots.forget_current(name)

    def install_version(
        self, version_id: str, weights: AdapterWeights, make_current: bool = True, timeout_s: float = 30.0
    ) -> Future[str]:
        """Copy a store version into a free slot at the next iteration boundary (shadow swap).

        The future fails with EngineRefusal 503 if no slot frees up within `timeout_s` (all in use)."""
        fut, deadline, attempt = self.slots.prepare_install(version_id, weights, make_current, timeout_s)
        self._command(lambda: self.slots.pending.append((deadline, attempt)))
        return fut

    def offload_version(self, version_id: str) -> Future[bool]:
        """Free the slot of `version_id` at the next iteration boundary (`Slots.offload`); a later request
        or install makes it resident again."""
        return self._call(lambda: self.slots.offload(version_id))

    def set_share(self, share: float, ttl_s: float, spend: float = 0.0) -> Future[None]:
        """Applied at the next iteration boundary; the future resolves once the share is in force. `spend`:
        the part of the share training takes beyond the requests' slack (`cosched`), for as long as the
        share is in force."""
        return self._call(lambda: self.core.set_share(share, ttl_s, spend))

    def pause_training(self) -> Future[None]:
        return self._call(lambda: setattr(self.training, "paused", True))

    def resume_training(self) -> Future[None]:
        return self._call(lambda: setattr(self.training, "paused", False))

    def add_examples(self, examples: list[Example]) -> Future[int]:
        """Add new local samples (split by the stable hash of their id, as when they are loaded again
        after a restart); an id already present is ignored (a redelivered sample)."""
        return self._call(lambda: self.examples.add(examples))

    def examples_for(self, adapter: str) -> tuple[list[Example], list[Example]]:
        """The local examples a job for `adapter` trains on: its domain's, or all when none is tagged."""
        return self.examples.for_adapter(adapter)

    def start_job(self, spec: JobSpec) -> Future[TrainingJobStatus]:
        """Start (or restart) the job of `spec.adapter`; fails if there is no local data."""
        return self._call(lambda: self.training.start_job(spec))

    def stop_job(self, adapter: str) -> Future[bool]:
        return self._call(lambda: self.training.stop_job(adapter))

    def publish_now(self, adapter: str) -> Future[str | None]:
        """Refresh the shadow of `adapter` from its live copy now (returns the new version id)."""
        return self._call(lambda: self.training.publish_now(adapter))

    def evaluate(
        self,
        candidates: list[tuple[str, AdapterWeights | None]],
        max_examples: int = 64,
        adapter: str | None = None,
        max_tokens: int | None = None,
        digests: list[str | None] | None = None,
        priority: int = 0,
        deadline_unix_s: float | None = None,
    ) -> Future[dict[str, EvalRun]]:
        """Held-out loss of each candidate (None: the base model) on the local eval split, per domain.

        Scores at most `max_examples` examples and (with the engine's `eval_max_tokens`) at most that many
        tokens per domain, the same items for every candidate. Runs in pieces between iterations: at full
        speed on an idle replica, in the slack under load, at least one piece per iteration. `digests`
        (one per candidate: the sha256 of its blob, "base" for None, None: unknown) key a cache of
        results, so the same weights on the same items are scored once. Higher `priority` goes first
        (a candidate on a publication's critical path before a background pre-scoring). With
        `deadline_unix_s` (when the requester stops waiting), an evaluation that falls behind the even
        pace to finish by 80% of its window runs more pieces per iteration than the slack allows, up to
        the guard for the next arrival (`cosched.behind_schedule`). The runs carry `eval_set`, the
        digest of the items per domain (`training.eval_set_digests`)."""
        fut: Future[dict[str, EvalRun]] = Future()
        asked = (candidates, max_examples, adapter, max_tokens, digests, priority, deadline_unix_s)
        t_asked = self.clock()
        self._command(lambda: self.evals.enqueue(fut, *asked, t_asked))
        return fut

    def snapshot(self) -> EngineSnapshot:
        now = self.clock()
        share, source, spend = self.core.share_now(now)
        with self._lock:
            latency = self.window.summary(now)
            adapters = self.slots.resident(lambda name: name in self.jobs and self.jobs[name].active)
            queue_len = self.batcher.n_waiting
            live = self.training.live_work  # a stretch of training in progress counts as it goes
            ft_tokens_total = self.training.ft_tokens_total + (live.train_tokens if live else 0)
            train_ms_total = self.training.train_ms_total + (live.train_ms if live else 0.0)
        costs = self.core.step_costs
        decode = dict(costs.decode_ms)
        blocks = self.batcher.blocks
        return EngineSnapshot(
            queue_len=queue_len,
            running=len(self.running),
            max_batch=self.cfg.batch.max_running,
            kv_used_frac=blocks.num_used / blocks.num_blocks,
            generated_tokens_total=self.generated_tokens_total,
            prefill_tokens_total=self.prefill_tokens_total,
            arrivals_total=self.arrivals_total,
            ft_tokens_total=ft_tokens_total,
            infer_ms_total=self.infer_ms_total,
            train_ms_total=train_ms_total,
            ft_share=share,
            ft_share_source=source,
            ft_spend=spend,
            ft_loss=self.ft_loss,
            training_paused=self.training_paused,
            latency=latency,
            decode_step_ms=decode.get(max(decode)) if decode else None,
            prefill_ms_per_token=costs.prefill_ms_per_token() if self.prefill_tokens_total else None,
            train_step_ms=self.training.train_step_ms,
            jobs=[self.training.job_status(j) for j in list(self.jobs.values())],
            adapters=adapters,
            local_samples=len(self.dataset.train) + len(self.dataset.eval),
            domains=self.dataset.domains,
            train_limits=dict(self.train_limits),
            prefix_cache_queries_total=self.prefix_cache_queries_total,
            prefix_cache_hits_total=self.prefix_cache_hits_total,
        )
