"""The replica engine: one thread that owns the model and runs schedule -> execute -> update forever.

Everything torch happens in that thread. Other threads (the asyncio service) talk to it only through
thread-safe calls: `submit` (admission checks under a lock, then an inbox), `cancel`, and commands that
run in the engine thread at the next iteration boundary (`install_version`, `start_job`, `evaluate`, ...),
answered through `concurrent.futures.Future`s. Events of a request (`Accepted`, `TokenChunk`s, `Finished`,
`GenerateError`: the wire messages of `collm_common.wire.inference`) go to the request's sink, a callable
that must be thread-safe (the service wraps `loop.call_soon_threadsafe`).

Each iteration:
1. take new requests and commands (adapter installs and shadow refreshes happen here, at the boundary,
   as a copy into a free LoRA-bank slot: running requests keep reading their own slot);
2. `batching.plan_iteration` picks decode tokens and prefill chunks within the token and KV budgets;
3. the co-scheduler decides how much background time fits after this step (the slack of every request,
   from the cost model's estimates of this step and the next);
4. the executor runs the ragged multi-adapter batch; tokens are sampled, detokenized, stop-checked and
   streamed;
5. background work runs in pieces of about one decoder layer (`executor.LayerPass`) while the next
   piece is predicted to end within that time: first federated evaluations (on a publication's critical
   path; at least one piece per iteration, so they progress under any load), then training micro-steps
   (which resume at the next iteration where they stopped). An idle replica chains pieces back to back.

Adapter identity: a request is bound at admission to an exact version id (`base`, `name@vN`, or a local
refresh `name@vN+<replica>.<k>`), which pins its slot until it finishes; `Accepted` and `Finished` carry
that id.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from collm_common.data import Example, LocalDataset
from collm_common.lora import AdapterWeights
from collm_common.step_log import BackgroundWork, InferenceStep
from collm_common.wire.inference import Accepted, Finished, GenerateError, TokenChunk
from collm_common.wire.telemetry import ResidentAdapter, TrainingJobStatus
from collm_replica.batching import BatchConfig, Plan, SeqView, plan_iteration
from collm_replica.cosched import (
    CoSchedInput,
    CoScheduler,
    ReqTiming,
    StepModel,
    TrainCost,
    arrival_guard_s,
    background_budget_ms,
    behind_schedule,
    effective_share,
    likely_arrivals,
    make_coscheduler,
    request_deadlines,
    running_timing,
)
from collm_replica.costs import FinishedSample, LatencyWindow, PieceCosts, StepCosts
from collm_replica.executor import Executor, ForwardItem, SeqKV
from collm_replica.lora_bank import LiveLora, LoraBank, parse_adapter
from collm_replica.lru import VersionLru
from collm_replica.models import LoadedModel
from collm_replica.sampling import IncrementalDetokenizer, StopMatcher, make_generator, sample_token
from collm_replica.training import (
    TRAIN_HEAD_ROWS,
    EvalRun,
    JobConfig,
    JobSpec,
    PieceWork,
    Rendered,
    TrainingJob,
    eval_set_digests,
    render_example,
    select_eval_items,
)

log = logging.getLogger(__name__)

BASE = "base"
_VERSION_RE = re.compile(r"^(?P<name>[A-Za-z0-9_-]+)@v(?P<n>\d+)(?:\+(?P<local>[A-Za-z0-9_.-]+))?$")

EventSink = Callable[[Any], None]


def parse_version_id(version_id: str) -> tuple[str, int, str | None]:
    """`medical@v3+r0.2` -> ("medical", 3, "r0.2")."""
    m = _VERSION_RE.match(version_id)
    if not m:
        raise ValueError(f"malformed adapter version id {version_id!r}")
    return m.group("name"), int(m.group("n")), m.group("local")


def eval_dtype(setting: str, device: torch.device, model_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of evaluation's matrix products when it differs from the model's (None: the model's)."""
    if setting == "bfloat16":
        return None if model_dtype == torch.bfloat16 else torch.bfloat16
    if setting != "auto" or device.type != "cpu" or model_dtype != torch.float32:
        return None
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return torch.bfloat16 if amx is not None and amx() else None


class EngineRefusal(Exception):
    """A request the engine does not accept; `code` is HTTP-like (400, 404, 429, 503)."""

    def __init__(
        self, code: int, message: str, type_: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.type = type_
        self.param = param


class NotResident(Exception):
    """The adapter (version) a request names is not in the bank: the service fetches it and retries."""


@dataclass(frozen=True)
class EngineConfig:
    replica_id: str = "r0"
    max_queue: int = 64
    batch: BatchConfig = field(default_factory=BatchConfig)
    max_resident_adapters: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    lora_max_rank: int = 16
    default_ttft_slo_ms: float = 2000.0
    default_tpot_slo_ms: float = 250.0
    ft_share_default: float = 0.3
    coscheduler: str = "slo"
    fixed_every_iterations: int = 5
    job: JobConfig = field(default_factory=JobConfig)
    slo_window_s: float = 30.0
    round_deadline_margin_s: float = 3.0
    eval_fraction: float = 0.1
    train_guard_frac: float = 0.4  # background work between iterations: at most this share of the TTFT SLO
    train_slack_frac: float = 0.5  # share of the requests' slack that background work may use
    # Background work plans against each request's SLOs less this fraction (a reserve for what the step
    # model cannot see: steps slower than predicted, prompts arriving after the decision).
    train_slo_reserve_frac: float = 0.1
    eval_max_tokens: int | None = 4096  # held-out tokens per domain an evaluation request scores at most
    eval_cache_entries: int = 64  # evaluation results kept (by weights digest and eval set)
    # Precision of the base model's products in evaluation passes: "auto" (bfloat16 on a CPU with AMX,
    # else the model's dtype), "bfloat16", or "float32"/"model" (the model's own dtype).
    eval_matmul_dtype: str = "auto"
    refresh_slot_wait_s: float = 60.0  # a local job whose refreshes find no slot this long fails

    @classmethod
    def from_settings(cls, s: Any) -> EngineConfig:
        return cls(
            replica_id=s.replica_id,
            max_queue=s.max_queue,
            batch=BatchConfig(
                s.max_batch,
                s.max_batch_tokens,
                s.prefill_chunk_tokens,
                s.kv_budget_tokens,
                block_size=s.kv_block_tokens,
                kv_admission=s.kv_admission,
            ),
            max_resident_adapters=s.max_resident_adapters,
            lora_targets=tuple(s.lora_target_modules.split(",")),
            lora_max_rank=s.lora_max_rank,
            default_ttft_slo_ms=s.default_ttft_slo_ms,
            default_tpot_slo_ms=s.default_tpot_slo_ms,
            ft_share_default=s.ft_share_default,
            coscheduler=s.coscheduler,
            fixed_every_iterations=s.fixed_ratio_k,
            job=JobConfig(
                micro_tokens=s.train_micro_tokens,
                batch_tokens=s.train_batch_tokens,
                max_seq_len=s.train_max_seq_len,
                publish_every_steps=s.publish_every_steps,
                eval_max_examples=s.eval_max_examples,
            ),
            slo_window_s=s.slo_window_s,
            round_deadline_margin_s=s.round_deadline_margin_s,
            eval_fraction=s.eval_fraction,
            train_guard_frac=s.ft_guard_frac,
            train_slack_frac=s.ft_slack_frac,
            train_slo_reserve_frac=s.ft_slo_reserve_frac,
            eval_max_tokens=s.eval_max_tokens,
            eval_matmul_dtype=s.eval_matmul_dtype,
        )


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    adapter: str | None = None  # None: the base model
    version_id: str | None = None  # exact version (pinned); None: the adapter's current version
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    deadline_unix_s: float | None = None
    span: Any = None  # an OpenTelemetry span started by the service (context captured at admission)


@dataclass
class JobEvent:
    """Told to the service (from the engine thread) when a job refreshes, finishes or fails."""

    kind: str  # "refresh", "round_update", "done", "failed"
    adapter: str
    status: TrainingJobStatus
    version_id: str | None = None
    weights: AdapterWeights | None = None
    num_samples: int = 0
    num_tokens: int = 0
    round_id: int | None = None
    base_version: int | None = None
    train_loss: float | None = None
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None


class _Seq:
    __slots__ = (
        "req", "sink", "version_id", "slot", "prompt_len", "computed", "output", "kv", "reserve", "gen",
        "detok", "stops", "chunk_seq", "t_arrival", "t_admit", "t_first", "t_last", "ttft_slo", "tpot_slo",
        "done", "eos",
    )  # fmt: skip

    def __init__(self, req: EngineRequest, sink: EventSink, version_id: str, slot: int, tokenizer: Any,
                 eos: set[int], cfg: EngineConfig, now: float) -> None:  # fmt: skip
        self.req = req
        self.sink = sink
        self.version_id = version_id
        self.slot = slot
        self.prompt_len = len(req.prompt_ids)
        self.computed = 0
        self.output: list[int] = []
        self.kv: SeqKV | None = None
        self.reserve = self.prompt_len + req.max_tokens
        self.gen = make_generator(req.seed) if req.temperature > 0 else None
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopMatcher(req.stop)
        self.chunk_seq = 0
        self.t_arrival = now
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.ttft_slo = (req.ttft_slo_ms or cfg.default_ttft_slo_ms) / 1e3
        self.tpot_slo = (req.tpot_slo_ms or cfg.default_tpot_slo_ms) / 1e3
        self.done = False
        self.eos = set() if req.ignore_eos else eos

    def view(self, cfg: BatchConfig) -> SeqView:
        return SeqView(
            self.req.request_id,
            self.prompt_len,
            self.computed,
            kv_reserve=cfg.reserve_tokens(self.reserve),
            output_len=len(self.output),
            blocks_held=len(self.kv.blocks) if self.kv is not None else 0,
        )

    def next_tokens(self, n: int) -> list[int]:
        """The `n` known tokens after those in the KV cache (prompt, then output after a preemption)."""
        c = self.computed
        if c + n <= self.prompt_len:
            return self.req.prompt_ids[c : c + n]
        return (self.req.prompt_ids + self.output)[c : c + n]


@dataclass
class _PendingEval:
    """An evaluation waiting for or in its pieces; `pace` = (asked, deadline) on the engine's clock."""

    priority: int
    runs: list[EvalRun]
    fut: Future[Any]
    finish: Callable[[list[EvalRun]], Any]
    pace: tuple[float, float] | None = None

    def behind(self, at_s: float) -> bool:
        """Behind the even pace to its deadline at `at_s` (never without a deadline)."""
        if self.pace is None:
            return False
        progress = sum(r.progress for r in self.runs) / len(self.runs) if self.runs else 1.0
        return behind_schedule(progress, at_s, *self.pace)


@dataclass
class EngineSnapshot:
    """Plain numbers for telemetry and metrics (read from any thread)."""

    queue_len: int
    running: int
    max_batch: int
    kv_used_frac: float
    generated_tokens_total: int
    prefill_tokens_total: int
    arrivals_total: int
    ft_tokens_total: int
    infer_ms_total: float
    train_ms_total: float
    ft_share: float
    ft_share_source: str
    ft_loss: float | None
    training_paused: bool
    latency: dict[str, float | int | None]
    decode_step_ms: float | None
    prefill_ms_per_token: float | None
    train_step_ms: float | None
    jobs: list[TrainingJobStatus]
    adapters: list[ResidentAdapter]
    local_samples: int
    domains: list[str]
    iterations: int
    train_limits: dict[str, int] = field(default_factory=dict)


class Engine:
    """See module docstring."""

    def __init__(
        self,
        loaded: LoadedModel,
        cfg: EngineConfig | None = None,
        coscheduler: CoScheduler | None = None,
        dataset: LocalDataset | None = None,
        on_job_event: Callable[[JobEvent], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        step_log: Callable[[InferenceStep | BackgroundWork], None] | None = None,
    ) -> None:
        self.loaded = loaded
        self.cfg = cfg or EngineConfig()
        self.tok = loaded.tokenizer
        self.eos_ids = loaded.eos_token_ids
        self.max_model_len = loaded.max_model_len
        self.executor = Executor(loaded)
        self.bank = LoraBank(
            self.cfg.max_resident_adapters,
            self.executor.n_layers,
            self.executor.shapes,
            self.cfg.lora_targets,
            self.cfg.lora_max_rank,
            loaded.dtype,
            loaded.device,
        )
        self.executor.bank = self.bank
        fast = eval_dtype(self.cfg.eval_matmul_dtype, loaded.device, loaded.dtype)
        if fast is not None and not self.executor.fast_all:
            self.executor.enable_fast_eval(fast)
        self.cosched = coscheduler or make_coscheduler(
            self.cfg.coscheduler, self.cfg.fixed_every_iterations, slack_frac=self.cfg.train_slack_frac
        )
        self.dataset = dataset or LocalDataset([], [])
        self.on_job_event = on_job_event
        self.clock = clock
        self.wall = wall
        self.step_log = step_log  # told every inference step and stretch of background work (`step_log`)
        # The training budget decided for the iteration in progress and what bounded it (for the step log).
        self._train_decision: tuple[float, str | None] = (0.0, None)

        self._lock = threading.Lock()
        self._lru = VersionLru(self.cfg.max_resident_adapters)
        self._inbox: deque[_Seq] = deque()
        self._n_waiting = 0  # inbox + waiting, under _lock
        self._active: dict[str, _Seq] = {}
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

        # Engine-thread state.
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self.kv_reserved = 0  # reserve admission: tokens reserved by running sequences (whole blocks)
        self.kv_pool = self.executor.init_kv_pool(self.cfg.batch.num_blocks, self.cfg.batch.block_size)
        self.preemptions_total = 0
        self.jobs: dict[str, TrainingJob] = {}
        self._job_rr = 0
        # Pending evaluations, highest priority first (then FIFO).
        self._evals: list[_PendingEval] = []
        self._eval_cache: dict[tuple[str, str], EvalRun] = {}
        self._render_cache: dict[tuple[Example, int], Rendered | None] = {}
        self._pending_installs: list[tuple[float, Callable[[], bool]]] = []
        self.training_paused = False
        self._share: float | None = None
        self._share_expires: float | None = None
        self._refresh_counter: dict[str, int] = {}
        self._global_current: dict[str, int] = {}
        self._recent_slos: deque[tuple[float, float]] = deque(maxlen=4096)
        self._prompt_tokens_ewma = 64.0  # prompt length of recent arrivals (the next one's, as a guess)
        self.iteration = 0

        # Costs and counters.
        self.step_costs = StepCosts()
        self.piece_costs = PieceCosts()
        self._train_step_ms: float | None = None
        self.window = LatencyWindow(self.cfg.slo_window_s)
        self.generated_tokens_total = 0
        self.prefill_tokens_total = 0
        self.arrivals_total = 0
        self.ft_tokens_total = 0
        self.ft_loss: float | None = None
        self.errors_total = 0
        self.infer_ms_total = 0.0  # wall time of inference iterations (forward, sampling, streaming)
        self.forward_ms_total = 0.0  # of which the model's forward passes
        self.train_ms_total = 0.0  # wall time of training pieces
        self.eval_ms_total = 0.0  # wall time of evaluation pieces (requests and jobs' own evaluations)
        self.longest_background_ms = 0.0  # longest stretch of background work between two iterations
        # Iterations that served with a training job active, by what bounded their training time
        # (`cosched.Limit`; "policy" for co-schedulers that do not say).
        self.train_limits: dict[str, int] = {}
        self._live_work: PieceWork | None = None  # the job's work of the stretch in progress
        self.last_work: PieceWork | None = None  # the last stretch of training (for tests and benchmarks)

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
            self._emit_error(seq, 503, "the replica is shutting down", "service_unavailable")

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ===================================================================================== thread-safe API
    def submit(self, req: EngineRequest, sink: EventSink) -> Accepted:
        """Admit a request into the queue or raise EngineRefusal / NotResident. The sink gets `Accepted`
        (synchronously, before any other event), then the stream."""
        n = len(req.prompt_ids)
        limit = self.max_model_len
        if n == 0:
            raise EngineRefusal(400, "the prompt is empty", param="prompt")
        if req.max_tokens < 1:
            raise EngineRefusal(400, "max_tokens must be >= 1", param="max_tokens")
        if n >= limit:
            raise EngineRefusal(
                400,
                f"the prompt has {n} tokens but this model's context is {limit} tokens "
                f"(prompt + max_tokens must be <= {limit})",
                param="messages",
            )
        if n + req.max_tokens > limit:
            raise EngineRefusal(
                400,
                f"prompt ({n} tokens) + max_tokens ({req.max_tokens}) = {n + req.max_tokens} exceeds this "
                f"model's context of {limit} tokens",
                param="max_tokens",
            )
        pool_tokens = self.cfg.batch.num_blocks * self.cfg.batch.block_size
        if self.cfg.batch.reserve_tokens(n + req.max_tokens) > pool_tokens:
            raise EngineRefusal(
                400,
                f"prompt + max_tokens = {n + req.max_tokens} tokens exceeds this replica's KV cache of "
                f"{pool_tokens} tokens",
                param="max_tokens",
            )
        with self._lock:
            if self._stop.is_set():
                raise EngineRefusal(503, "the replica is shutting down", "service_unavailable")
            if self._n_waiting >= self.cfg.max_queue:
                raise EngineRefusal(
                    429, f"the replica's queue is full ({self.cfg.max_queue} waiting)", "rate_limit_exceeded"
                )
            if req.request_id in self._active:
                raise EngineRefusal(
                    400, f"request id {req.request_id!r} is already in flight", param="request_id"
                )
            version_id, slot = BASE, -1
            if req.adapter is not None:
                version_id = req.version_id or self._lru.current_of(req.adapter) or ""
                if version_id not in self._lru:
                    raise NotResident(req.version_id or req.adapter)
                slot = self._lru.acquire(version_id).slot
            seq = _Seq(req, sink, version_id, slot, self.tok, self.eos_ids, self.cfg, self.clock())
            accepted = Accepted(
                request_id=req.request_id,
                replica_id=self.cfg.replica_id,
                adapter_version_id=version_id,
                prompt_tokens=n,
                queue_position=self._n_waiting,
            )
            sink(accepted)
            self._inbox.append(seq)
            self._active[req.request_id] = seq
            self._n_waiting += 1
            self.arrivals_total += 1
        if req.span is not None:
            req.span.set_attribute("collm.adapter.version", version_id)
            req.span.add_event("queued", {"queue_position": accepted.queue_position})
        self._wake.set()
        return accepted

    def cancel(self, request_id: str) -> bool:
        """Stop a request (client gone). Returns whether it was in flight."""
        with self._lock:
            if request_id not in self._active:
                return False
        self._command(lambda: self._cancel(request_id))
        return True

    def current_version(self, name: str) -> str | None:
        with self._lock:
            return self._lru.current_of(name)

    def is_resident(self, version_id: str) -> bool:
        with self._lock:
            return version_id in self._lru

    def global_version(self, name: str) -> int | None:
        """The newest store version of `name` installed here (local refreshes not counted)."""
        with self._lock:
            return self._global_current.get(name)

    def install_version(
        self, version_id: str, weights: AdapterWeights, make_current: bool = True, timeout_s: float = 30.0
    ) -> Future[str]:
        """Copy a store version into a free slot at the next iteration boundary (shadow swap).

        The future fails with EngineRefusal 503 if no slot frees up within `timeout_s` (all in use)."""
        name, number, local = parse_version_id(version_id)
        parsed = parse_adapter(weights, self.executor.n_layers, self.executor.shapes, self.cfg.lora_targets)
        if weights.spec.r > self.cfg.lora_max_rank:
            raise EngineRefusal(
                400, f"adapter rank {weights.spec.r} exceeds the replica's max {self.cfg.lora_max_rank}"
            )
        fut: Future[str] = Future()
        deadline = self.clock() + timeout_s

        def attempt() -> bool:
            try:
                self._install(version_id, name, parsed, weights.spec.scaling, make_current)
            except _NoSlot:
                if self.clock() < deadline:
                    return False
                fut.set_exception(EngineRefusal(503, "every adapter slot is in use", "service_unavailable"))
                return True
            except Exception as exc:  # noqa: BLE001 - report to the caller
                fut.set_exception(exc)
                return True
            if local is None and make_current:
                with self._lock:
                    self._global_current[name] = max(number, self._global_current.get(name, 0))
            fut.set_result(version_id)
            return True

        self._command(lambda: self._pending_installs.append((deadline, attempt)))
        return fut

    def set_share(self, share: float, ttl_s: float) -> Future[None]:
        """Applied at the next iteration boundary; the future resolves once the share is in force."""

        def apply() -> None:
            self._share = share
            self._share_expires = self.clock() + ttl_s

        return self._call(apply)

    def pause_training(self) -> Future[None]:
        return self._call(lambda: setattr(self, "training_paused", True))

    def resume_training(self) -> Future[None]:
        return self._call(lambda: setattr(self, "training_paused", False))

    def add_examples(self, examples: list[Example]) -> Future[int]:
        """Add new local samples (split by the stable hash of their id, as when they are loaded again
        after a restart); an id already present is ignored (a redelivered sample)."""

        def apply() -> int:
            known = {e.id for e in self.dataset.train} | {e.id for e in self.dataset.eval}
            for e in examples:
                if e.id not in known:
                    self.dataset.add(e, self.cfg.eval_fraction)
                    known.add(e.id)
            return len(self.dataset.train) + len(self.dataset.eval)

        return self._call(apply)

    def examples_for(self, adapter: str) -> tuple[list[Example], list[Example]]:
        """The local examples a job for `adapter` trains on: its domain's, or all when none is tagged."""
        train = [e for e in self.dataset.train if e.domain == adapter]
        held = [e for e in self.dataset.eval if e.domain == adapter]
        if not train:
            return list(self.dataset.train), list(self.dataset.eval)
        return train, held

    def start_job(self, spec: JobSpec) -> Future[TrainingJobStatus]:
        """Start (or restart) the job of `spec.adapter`; fails if there is no local data."""

        def apply() -> TrainingJobStatus:
            old = self.jobs.pop(spec.adapter, None)
            if old is not None:
                old.stop()
            train, held = self.examples_for(spec.adapter)
            job = TrainingJob(
                spec, self.executor, self.tok, train, held, self.cfg.job, wall=self.wall, render=self._render
            )
            if job.state == "failed":
                raise EngineRefusal(409, f"cannot train {spec.adapter}: {job.message}", "conflict")
            self.jobs[spec.adapter] = job
            return self._job_status(job)

        return self._call(apply)

    def stop_job(self, adapter: str) -> Future[bool]:
        def apply() -> bool:
            job = self.jobs.get(adapter)
            if job is None:
                return False
            job.stop()
            return True

        return self._call(apply)

    def publish_now(self, adapter: str) -> Future[str | None]:
        """Refresh the shadow of `adapter` from its live copy now (returns the new version id)."""

        def apply() -> str | None:
            job = self.jobs.get(adapter)
            if job is None:
                raise EngineRefusal(404, f"no training job for adapter {adapter!r}", "not_found")
            return self._local_refresh(job, force=True)

        return self._call(apply)

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
        labels = [label for label, _ in candidates]
        keys = list(digests) if digests is not None else [None] * len(candidates)
        caps = [m for m in (max_tokens, self.cfg.eval_max_tokens) if m is not None]
        t_asked = self.clock()

        def apply() -> None:
            t_start = self.clock()
            try:
                _, held = self.examples_for(adapter) if adapter else ([], list(self.dataset.eval))
                rendered = [r for e in held if (r := self._render(e)) is not None]
                items = select_eval_items(rendered, max_examples, min(caps) if caps else None)
                eval_set = eval_set_digests(items, self.cfg.job.max_seq_len, self.executor.eval_precision)
                set_key = "|".join(f"{d}={h}" for d, h in sorted(eval_set.items()))
                runs: list[EvalRun] = []
                todo: list[EvalRun] = []
                for (_label, w), key in zip(candidates, keys, strict=True):
                    cached = self._eval_cache.get((key, set_key)) if key else None
                    if cached is not None:
                        runs.append(cached)
                        continue
                    live = (
                        LiveLora.from_weights(w, self.executor.n_layers, self.executor.shapes,
                                              self.loaded.dtype, self.loaded.device)
                        if w is not None else None
                    )  # fmt: skip
                    run = EvalRun(items, live, self.cfg.job.eval_chunk_tokens, eval_set=eval_set)
                    run.cache_key = (key, set_key) if key else None
                    runs.append(run)
                    todo.append(run)
            except Exception as exc:  # noqa: BLE001 - delivered to the caller
                fut.set_exception(exc)
                return

            def finish(_rs: list[EvalRun]) -> dict[str, EvalRun]:
                for run in todo:
                    if run.cache_key is not None:
                        run.live = None  # the weights are not needed any more
                        self._eval_cache[run.cache_key] = run
                while len(self._eval_cache) > self.cfg.eval_cache_entries:
                    self._eval_cache.pop(next(iter(self._eval_cache)))
                now = self.clock()
                log.info(
                    "evaluated %s: %d of %d versions scored (%d tokens each, priority %d) in %.0f ms "
                    "(%.0f ms waiting for the engine)",
                    adapter or "all domains", len(todo), len(runs), sum(len(r.ids) for r in items),
                    priority, (now - t_asked) * 1e3, (t_start - t_asked) * 1e3,
                )  # fmt: skip
                return dict(zip(labels, runs, strict=True))

            if not todo:
                fut.set_result(finish([]))
                return
            pace = None
            if deadline_unix_s is not None:
                pace = (t_asked, t_asked + deadline_unix_s - self.wall())
            pos = next((i for i, e in enumerate(self._evals) if e.priority < priority), len(self._evals))
            self._evals.insert(pos, _PendingEval(priority, todo, fut, finish, pace))

        self._command(apply)
        return fut

    def _render(self, e: Example) -> Rendered | None:
        """Render through the chat template once per example (cached: examples are immutable)."""
        key = (e, self.cfg.job.max_seq_len)
        if key not in self._render_cache:
            self._render_cache[key] = render_example(self.tok, e, self.cfg.job.max_seq_len)
        return self._render_cache[key]

    def snapshot(self) -> EngineSnapshot:
        now = self.clock()
        share, source = effective_share(now, self._share, self._share_expires, self.cfg.ft_share_default)
        with self._lock:
            latency = self.window.summary(now)
            adapters = [
                ResidentAdapter(
                    name=r.name,
                    version_id=r.version_id,
                    version=parse_version_id(r.version_id)[1],
                    in_flight=r.refs,
                    training=r.name in self.jobs and self.jobs[r.name].active,
                )
                for r in sorted(self._lru.by_id.values(), key=lambda r: r.version_id)
            ]
            queue_len = self._n_waiting
            live = self._live_work  # a stretch of training in progress counts as it goes
            ft_tokens_total = self.ft_tokens_total + (live.train_tokens if live else 0)
            train_ms_total = self.train_ms_total + (live.train_ms if live else 0.0)
        decode = dict(self.step_costs.decode_ms)
        prefill_ms = self.step_costs.prefill_ms_per_token() if self.prefill_tokens_total else None
        return EngineSnapshot(
            queue_len=queue_len,
            running=len(self.running),
            max_batch=self.cfg.batch.max_batch,
            kv_used_frac=self.kv_pool.blocks.num_used / self.kv_pool.blocks.num_blocks,
            generated_tokens_total=self.generated_tokens_total,
            prefill_tokens_total=self.prefill_tokens_total,
            arrivals_total=self.arrivals_total,
            ft_tokens_total=ft_tokens_total,
            infer_ms_total=self.infer_ms_total,
            train_ms_total=train_ms_total,
            ft_share=share,
            ft_share_source=source,
            ft_loss=self.ft_loss,
            training_paused=self.training_paused,
            latency=latency,
            decode_step_ms=decode.get(max(decode)) if decode else None,
            prefill_ms_per_token=prefill_ms,
            train_step_ms=self._train_step_ms,
            jobs=[self._job_status(j) for j in list(self.jobs.values())],
            adapters=adapters,
            local_samples=len(self.dataset.train) + len(self.dataset.eval),
            domains=self.dataset.domains,
            iterations=self.iteration,
            train_limits=dict(self.train_limits),
        )

    def decode_step_ms_by_batch(self) -> dict[int, float]:
        return dict(self.step_costs.decode_ms)

    # ===================================================================================== internals
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

    def _install(self, version_id: str, name: str, parsed: dict, scaling: float, make_current: bool) -> None:
        with self._lock:
            if version_id in self._lru:
                if make_current:
                    self._lru.make_current(version_id)
                return
            choice = self._lru.slot_for_new()
            if choice is None:
                raise _NoSlot()
            slot, victim = choice
            if victim is not None:
                self._lru.evict(victim.version_id)
        # Outside the lock: nobody can acquire this slot (it is in no version's record now).
        self.bank.write_parsed(slot, parsed, scaling)
        with self._lock:
            self._lru.add(version_id, name, slot, current=make_current)
        log.info("adapter %s resident in slot %d%s", version_id, slot, " (current)" if make_current else "")

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            try:
                worked = self._iteration()
            except Exception:  # noqa: BLE001 - the loop must survive a bad iteration
                log.exception("engine iteration failed")
                self._fail_running("internal error in the engine iteration")
                worked = False
            if not worked:
                self._wake.wait(0.05)

    def _fail_running(self, message: str) -> None:
        for seq in list(self.running):
            self._emit_error(seq, 500, message)
            self._release(seq)

    def _iteration(self) -> bool:
        self._wake.clear()
        now = self.clock()
        with self._lock:
            while self._inbox:
                seq = self._inbox.popleft()
                self.waiting.append(seq)
                self._recent_slos.append((now, seq.ttft_slo * 1e3))
                self._prompt_tokens_ewma = 0.9 * self._prompt_tokens_ewma + 0.1 * seq.prompt_len
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            cmd()
        if self._pending_installs:
            self._pending_installs = [(d, a) for d, a in self._pending_installs if not a()]
        self._expire(now)
        self.iteration += 1

        b = self.cfg.batch
        plan = plan_iteration(
            b,
            [s.view(b) for s in self.running],
            [s.view(b) for s in self.waiting],
            self.kv_reserved,
            free_blocks=self.kv_pool.blocks.num_free,
        )
        self._preempt(plan.preempted)
        by_id = {s.req.request_id: s for s in self.waiting}
        for sid in plan.admitted:
            seq = by_id[sid]
            self.waiting.remove(seq)
            with self._lock:
                self._n_waiting -= 1
            if seq.t_admit is None:
                seq.t_admit = now
            seq.kv = self.kv_pool.sequence(seq.reserve)
            self.kv_reserved += b.reserve_tokens(seq.reserve)
            self.running.append(seq)
            if seq.req.span is not None:
                seq.req.span.add_event("prefill_start", {"queue_ms": (now - seq.t_arrival) * 1e3})

        step_ms, train_ms, eval_ms, job, idle = self._decide_background(now, plan)
        worked = False
        if plan.items:
            t0 = time.perf_counter()
            self._execute(plan.items)
            self.infer_ms_total += (time.perf_counter() - t0) * 1e3
            worked = True
        # Background work: the windows are absolute (from the decision), so an inference step slower than
        # predicted shortens them, and evaluation time counts against training's window.
        t_bg = time.perf_counter()
        if self._evals:
            worked = self._eval_work(now + (step_ms + eval_ms) / 1e3) or worked
        if train_ms > 0 and job is not None:
            force = idle and not self._evals  # pending evaluations come first, even when idle
            worked = self._train_work(job, now + (step_ms + train_ms) / 1e3, force_one=force) or worked
        # A round job past its deadline (less the margin) wraps up and sends its update whatever this
        # iteration granted training (a zero share, no slack, training paused): the wrap-up is bounded (at
        # most the backward of the micro-step in progress, or a first micro-step's rest within the guard,
        # and one optimizer step: `TrainingJob._finish_training`), and an update held back would cost the
        # whole round its participant.
        for due in [j for j in self._active_jobs() if j.due(self.cfg.round_deadline_margin_s)]:
            worked = self._train_work(due, now, force_one=False) or worked
        bg_ms = (time.perf_counter() - t_bg) * 1e3
        if bg_ms > self.longest_background_ms:
            self.longest_background_ms = bg_ms
        return worked

    def _preempt(self, seq_ids: list[str]) -> None:
        """Preempted sequences give back their KV blocks and return to the front of the queue, in
        arrival order, to recompute their prompt and output so far when readmitted."""
        if not seq_ids:
            return
        by_id = {s.req.request_id: s for s in self.running}
        out = sorted((by_id[sid] for sid in seq_ids), key=lambda s: s.t_arrival)
        for seq in out:
            self.running.remove(seq)
            self.kv_reserved -= self.cfg.batch.reserve_tokens(seq.reserve)
            if seq.kv is not None:
                seq.kv.free()
            seq.kv = None
            seq.computed = 0
            if seq.req.span is not None:
                seq.req.span.add_event("preempted", {"output_tokens": len(seq.output)})
        self.waiting[:0] = out
        self.preemptions_total += len(out)
        with self._lock:
            self._n_waiting += len(out)

    # --- scheduling helpers ---------------------------------------------------------------------------
    def _decode_ms_at(self, batch: int) -> float:
        """Predicted cost of a decode step of `batch` sequences (measured when seen, else the fit)."""
        return self.step_costs.decode_at(batch)

    def _timings(self, now: float, plan: Plan | None) -> tuple[list[ReqTiming], list[ReqTiming], StepModel]:
        """The running and waiting requests as they will be after `plan`'s step, and the step model. The
        SLOs are the requests' own less the reserve (`train_slo_reserve_frac`): background work spends
        only the slack within them."""
        n_tokens = dict(plan.items) if plan is not None else {}
        keep = 1.0 - self.cfg.train_slo_reserve_frac
        running = []
        for s in self.running:
            running.append(
                running_timing(
                    now,
                    s.t_arrival,
                    keep * s.ttft_slo,
                    keep * s.tpot_slo,
                    s.t_first,
                    s.prompt_len,
                    s.computed,
                    len(s.output),
                    s.req.max_tokens,
                    n_tokens.get(s.req.request_id, 0),
                )
            )
        waiting = [
            ReqTiming(
                s.t_arrival,
                keep * s.ttft_slo,
                keep * s.tpot_slo,
                prompt_left=s.prompt_len + len(s.output) - s.computed,
                tokens_left=s.req.max_tokens - len(s.output),
            )
            for s in self.waiting
        ]
        b = self.cfg.batch
        model = StepModel(
            decode_step_s=self._decode_ms_at(max(1, len(self.running))) / 1e3,
            prefill_s_per_token=self.step_costs.prefill_ms_per_token() / 1e3,
            max_batch=b.max_batch,
            max_batch_tokens=b.max_batch_tokens,
            prefill_chunk_tokens=b.prefill_chunk_tokens,
        )
        return running, waiting, model

    def _min_ttft_slo_ms(self) -> float:
        """The tightest TTFT SLO of present requests and of those that arrived within the SLO window
        (the next arrival is likely to be like the recent ones)."""
        now = self.clock()
        while self._recent_slos and self._recent_slos[0][0] < now - self.cfg.slo_window_s:
            self._recent_slos.popleft()
        slos = [s.ttft_slo * 1e3 for s in (*self.running, *self.waiting)]
        return min([*slos, *(x for _, x in self._recent_slos), self.cfg.default_ttft_slo_ms])

    def _likely_arrivals(self, within_s: float) -> int:
        """Arrivals to expect within `within_s` at the rate of the last SLO window, rounded up (a burst of
        that many must find room), at least 1 and at most 4."""
        recent = self._recent_slos  # one entry per arrival of the window (pruned by `_min_ttft_slo_ms`)
        if not recent:
            return 1
        return likely_arrivals(len(recent), recent[0][0], recent[-1][0], within_s)

    def _active_jobs(self) -> list[TrainingJob]:
        return [j for j in self.jobs.values() if j.active]

    def _decide_background(
        self, now: float, plan: Plan
    ) -> tuple[float, float, float, TrainingJob | None, bool]:
        """(predicted inference ms, training ms, evaluation ms, the job to train, idle) of this iteration."""
        jobs = self._active_jobs()
        share, _ = effective_share(now, self._share, self._share_expires, self.cfg.ft_share_default)
        fixed, per = self.piece_costs.micro_step(self.executor.n_layers, head_rows=TRAIN_HEAD_ROWS)
        step_ms = self.step_costs.line.predict(plan.tokens) if plan.tokens else 0.0
        running, waiting, model = self._timings(now, plan)
        min_ttft_ms = self._min_ttft_slo_ms()
        # A request arriving meanwhile must still meet its TTFT: background work lasts at most a share of
        # the SLO and, under load, no more than the arrival could absorb given the queue and, when the
        # batch is full, its wait for a free slot. (Idle, an arrival interrupts the work at the next piece.)
        guard_ms = self.cfg.train_guard_frac * min_ttft_ms
        if self.running:
            guard_ms = min(
                guard_ms,
                1e3
                * arrival_guard_s(
                    running,
                    waiting,
                    model,
                    step_ms / 1e3,
                    (1.0 - self.cfg.train_slo_reserve_frac) * min_ttft_ms / 1e3,
                    round(self._prompt_tokens_ewma),
                    self._likely_arrivals(min_ttft_ms / 1e3),
                ),
            )
        inp = CoSchedInput(
            now_s=now,
            share=share,
            has_job=bool(jobs) and not self.training_paused,
            running=len(self.running),
            waiting=len(self.waiting),
            inference_tokens=plan.tokens,
            token_budget=self.cfg.batch.max_batch_tokens,
            step_ms=step_ms,
            deadlines_s=request_deadlines(running, waiting, model),
            train=TrainCost(fixed, per),
            micro_tokens=self.cfg.job.micro_tokens,
            batch_tokens=self.cfg.job.batch_tokens,
            iteration=self.iteration,
            max_train_ms=guard_ms,
        )
        budget = getattr(self.cosched, "budget_ms", None)
        train_ms = budget(inp) if budget is not None else inp.train.ms(self.cosched.decide(inp))
        train_ms = min(train_ms, 60_000.0)
        limit = getattr(self.cosched, "limit", "policy")
        self._train_decision = (max(0.0, train_ms), limit) if inp.has_job else (0.0, None)
        if inp.has_job and not inp.idle:  # what bounded training while serving (observability)
            self.train_limits[limit] = self.train_limits.get(limit, 0) + 1
        eval_ms = 0.0
        if self._evals:
            margin = getattr(self.cosched, "margin_ms", 10.0)
            eval_ms = background_budget_ms(inp, margin, self.cfg.train_slack_frac)
        job = None
        if train_ms > 0 and jobs and inp.has_job:
            # A round job past its deadline first (it only wraps up and sends its update), then one with
            # a micro-step or evaluation batch half done, else the next in turn: jobs yield to each other
            # at those boundaries (`_train_work`), so each gets its share of the training time.
            wrap_up = self.cfg.round_deadline_margin_s
            job = next((j for j in jobs if j.due(wrap_up)), None) or next(
                (j for j in jobs if j.in_progress), None
            )
            if job is None:
                self._job_rr += 1
                job = jobs[self._job_rr % len(jobs)]
        return step_ms, train_ms, eval_ms, job, inp.idle

    def _expire(self, now: float) -> None:
        wall = self.wall()
        for seq in list(self.waiting):
            d = seq.req.deadline_unix_s
            if d is not None and wall > d:
                self.waiting.remove(seq)
                with self._lock:
                    self._n_waiting -= 1
                self._finish(seq, "deadline", now)

    def _cancel(self, request_id: str) -> None:
        seq = self._active.get(request_id)
        if seq is None or seq.done:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
            with self._lock:
                self._n_waiting -= 1
        elif seq not in self.running:  # still in the inbox (cannot happen: the inbox is drained first)
            return
        self._finish(seq, "cancelled", self.clock())

    # --- execution ------------------------------------------------------------------------------------
    def _execute(self, items: list[tuple[str, int]]) -> None:
        t_start = time.perf_counter()
        by_id = {s.req.request_id: s for s in self.running}
        work = sorted(((by_id[sid], n) for sid, n in items), key=lambda x: x[0].slot)
        fitems = []
        prefill_tokens = 0
        chunks: list[tuple[int, int]] = []  # (tokens, earlier tokens) of each prefill chunk
        decode_context = 0  # tokens of context before the decoding sequences' new tokens
        for seq, n in work:
            assert seq.kv is not None
            toks = seq.next_tokens(n)
            if seq.prompt_len + len(seq.output) - seq.computed > 1:  # a prefill (or recompute) chunk
                prefill_tokens += len(toks)
                chunks.append((len(toks), seq.computed))
            else:
                decode_context += seq.computed
            fitems.append(ForwardItem(toks, seq.computed, seq.kv, seq.slot))
        t_clock = self.clock()
        t0 = time.perf_counter()
        logits = self.executor.forward(fitems)
        ms = (time.perf_counter() - t0) * 1e3
        self.forward_ms_total += ms
        n_tokens = sum(len(f.token_ids) for f in fitems)
        self.step_costs.observe(len(fitems), n_tokens, prefill_tokens, ms)
        self.prefill_tokens_total += prefill_tokens
        now = self.clock()
        for (seq, n), lg in zip(work, logits, strict=True):
            if seq.done:
                continue
            seq.computed += n
            if seq.computed < seq.prompt_len + len(seq.output):
                continue  # more prompt (or recompute) chunks to come
            try:
                tok = sample_token(lg, seq.req.temperature, seq.req.top_p, seq.gen)
                self._on_token(seq, tok, now)
            except Exception as exc:  # noqa: BLE001 - fail this request, keep the batch
                log.exception("request %s failed", seq.req.request_id)
                self._emit_error(seq, 500, f"generation failed: {type(exc).__name__}")
                self._release(seq)
        if self.step_log is not None:
            self.step_log(
                InferenceStep(
                    t_s=t_clock,
                    decodes=len(work) - len(chunks),
                    decode_context_tokens=decode_context,
                    prefill=chunks,
                    adapters=len({seq.slot for seq, _ in work if seq.slot >= 0}),
                    forward_ms=ms,
                    step_ms=(time.perf_counter() - t_start) * 1e3,
                    train_budget_ms=self._train_decision[0],
                    train_limit=self._train_decision[1],
                )
            )

    def _on_token(self, seq: _Seq, tok: int, now: float) -> None:
        if seq.t_first is None:
            seq.t_first = now
            if seq.req.span is not None:
                seq.req.span.add_event("first_token", {"ttft_ms": (now - seq.t_arrival) * 1e3})
        seq.t_last = now
        seq.output.append(tok)
        self.generated_tokens_total += 1
        if tok in seq.eos:
            tail = seq.stops.flush()
            if tail:
                self._chunk(seq, [], tail)
            self._finish(seq, "stop", now)
            return
        text = seq.stops.push(seq.detok.push(tok))
        if seq.stops.stopped:
            self._chunk(seq, [tok], text)
            self._finish(seq, "stop", now)
            return
        if len(seq.output) >= seq.req.max_tokens:
            self._chunk(seq, [tok], text + seq.stops.flush())
            self._finish(seq, "length", now)
            return
        self._chunk(seq, [tok], text)

    def _chunk(self, seq: _Seq, token_ids: list[int], text: str) -> None:
        seq.sink(TokenChunk(request_id=seq.req.request_id, seq=seq.chunk_seq, token_ids=token_ids, text=text))
        seq.chunk_seq += 1

    def _completion_tokens(self, seq: _Seq) -> int:
        return sum(1 for t in seq.output if t not in seq.eos)

    def _finish(self, seq: _Seq, reason: str, now: float) -> None:
        if seq.done:
            return
        completion = self._completion_tokens(seq)
        ttft_ms = (seq.t_first - seq.t_arrival) * 1e3 if seq.t_first is not None else 0.0
        e2e_ms = ((seq.t_last or now) - seq.t_arrival) * 1e3
        tpot_ms = (e2e_ms - ttft_ms) / (len(seq.output) - 1) if len(seq.output) > 1 else 0.0
        queue_ms = ((seq.t_admit or now) - seq.t_arrival) * 1e3
        seq.sink(
            Finished(
                request_id=seq.req.request_id,
                seq=seq.chunk_seq,
                finish_reason=reason,  # type: ignore[arg-type]
                prompt_tokens=seq.prompt_len,
                completion_tokens=completion,
                adapter_version_id=seq.version_id,
                replica_id=self.cfg.replica_id,
                queue_ms=queue_ms,
                ttft_ms=ttft_ms,
                tpot_ms=tpot_ms,
                e2e_ms=e2e_ms,
            )
        )
        if reason in ("stop", "length"):
            good = ttft_ms <= seq.ttft_slo * 1e3 and (len(seq.output) <= 1 or tpot_ms <= seq.tpot_slo * 1e3)
            with self._lock:
                self.window.add(FinishedSample(now, ttft_ms, tpot_ms if len(seq.output) > 1 else None, good))
        span = seq.req.span
        if span is not None:
            span.add_event("finished", {"finish_reason": reason, "completion_tokens": completion})
            span.set_attribute("collm.finish_reason", reason)
            span.set_attributes(  # GenAI semantic conventions (collm_replica.observe sets the request's)
                {
                    "gen_ai.usage.input_tokens": seq.prompt_len,
                    "gen_ai.usage.output_tokens": completion,
                    "gen_ai.response.finish_reasons": (reason,),
                }
            )
            span.end()
        self._release(seq)

    def _emit_error(self, seq: _Seq, code: int, message: str, type_: str = "server_error") -> None:
        if seq.done:
            return
        self.errors_total += 1
        with contextlib.suppress(Exception):
            seq.sink(GenerateError(request_id=seq.req.request_id, code=code, type=type_, message=message))
        if seq.req.span is not None:
            seq.req.span.add_event("error", {"code": code, "message": message})
            seq.req.span.end()

    def _release(self, seq: _Seq) -> None:
        """Free the sequence's KV reservation and its hold on the adapter version (exactly once)."""
        if seq.done:
            return
        seq.done = True
        if seq in self.running:
            self.running.remove(seq)
            self.kv_reserved -= self.cfg.batch.reserve_tokens(seq.reserve)
        if seq.kv is not None:
            seq.kv.free()
        seq.kv = None
        with self._lock:
            self._active.pop(seq.req.request_id, None)
            if seq.version_id != BASE and seq.version_id in self._lru:
                self._lru.release(seq.version_id)

    # --- background evaluation and training -----------------------------------------------------------
    def _eval_work(self, until: float) -> bool:
        """Evaluation pieces (highest priority first) while the next is predicted to end by `until`;
        at least one piece, so an evaluation progresses under any load; past `until` while the first
        evaluation is behind its deadline's pace, up to the guard for the next arrival."""
        pad = int(self.tok.pad_token_id or 0)
        ran = False
        catch_up_until = self.clock() + self.cfg.train_guard_frac * self._min_ttft_slo_ms() / 1e3
        while self._evals:
            ev = self._evals[0]
            try:
                run = next((r for r in ev.runs if not r.done), None)
                if run is None:
                    self._evals.pop(0)
                    ev.fut.set_result(ev.finish(ev.runs))
                    continue
                nxt = run.next_piece(self.executor, pad)
                if nxt is None:
                    continue
                end = self.clock() + self.piece_costs.predict(*nxt) / 1e3
                if ran and (end > until or self._news()) and not (end <= catch_up_until and ev.behind(end)):
                    break
                t_clock = self.clock()
                ms, tokens = run.run_piece(self.executor, pad, self.piece_costs)
                self.eval_ms_total += ms
                ran = True
                if self.step_log is not None:
                    self.step_log(BackgroundWork(kind="eval", t_s=t_clock, ms=ms, tokens=tokens))
            except Exception as exc:  # noqa: BLE001 - delivered to the caller
                self._evals.pop(0)
                ev.fut.set_exception(exc)
        return ran

    def _news(self) -> bool:
        """New requests or commands are waiting: background work yields to the next iteration."""
        return bool(self._inbox) or not self._cmds.empty()

    def _train_work(self, job: TrainingJob, until: float, force_one: bool) -> bool:
        """Pieces of `job` while the next is predicted to end by `until` (at least one when idle)."""
        t_clock = self.clock()
        res = PieceWork()
        self.last_work = res
        with self._lock:
            self._live_work = res
        try:
            job.work(
                until,
                self.clock,
                self.piece_costs,
                force_one,
                self.cfg.round_deadline_margin_s,
                self._news,
                out=res,
                yield_at_boundary=len(self._active_jobs()) > 1,
                # a first micro-step completed at the deadline stalls serving at most this long
                wrap_up_ms=self.cfg.train_guard_frac * self._min_ttft_slo_ms(),
            )
        except Exception as exc:  # noqa: BLE001 - a failed job must not take the replica down
            log.exception("training job %s failed", job.spec.adapter)
            job.stop()
            job.state = "failed"
            job.message = f"{type(exc).__name__}: {exc}"
            self._job_event("failed", job)
            self._account_work(job, res)
            return False
        self._account_work(job, res)
        if self.step_log is not None and res.did_work:
            if res.train_ms > 0:
                self.step_log(
                    BackgroundWork(
                        kind="train",
                        t_s=t_clock,
                        ms=res.train_ms,
                        tokens=res.train_tokens,
                        micro_steps=list(res.micro_steps),
                    )
                )
            if res.eval_ms > 0:
                self.step_log(
                    BackgroundWork(kind="eval", t_s=t_clock, ms=res.eval_ms, tokens=res.eval_tokens)
                )
        return res.did_work or not job.active

    def _account_work(self, job: TrainingJob, res: PieceWork) -> None:
        if res.did_work:
            self.cosched.charge(res.train_ms + res.eval_ms)
        with self._lock:
            self._live_work = None
            self.ft_tokens_total += res.train_tokens
            self.train_ms_total += res.train_ms
        self.eval_ms_total += res.eval_ms
        for _tokens, ms in res.micro_steps:
            old = self._train_step_ms
            self._train_step_ms = ms if old is None else 0.8 * old + 0.2 * ms
        if job.train_loss is not None:
            self.ft_loss = job.train_loss
        if job.pending_refresh:
            job.pending_refresh = False
            self._local_refresh(job)
        if job.finished_update:
            job.finished_update = False
            self._job_event("round_update", job, weights=job.live.to_weights())
        elif job.state == "done":
            self._job_event("done", job)

    def _local_refresh(self, job: TrainingJob, force: bool = False) -> str | None:
        """Copy the live weights into a new shadow version `name@vN+<replica>.<k>` and make it current."""
        name = job.spec.adapter
        base_n = job.spec.base_version
        newest = self._global_current.get(name)
        if not force and newest is not None and base_n is not None and newest > base_n:
            log.info(
                "not refreshing %s: the store has v%d, newer than the job's base v%d", name, newest, base_n
            )
            return None
        with self._lock:
            has_slot = self._lru.slot_for_new() is not None
        if has_slot:
            k = self._refresh_counter.get(job.spec.base_version_id, 0) + 1
            version_id = f"{job.spec.base_version_id}+{self.cfg.replica_id}.{k}"
            try:
                self._install(version_id, name, job.live.snapshot(), job.live.spec.scaling, make_current=True)
            except _NoSlot:
                has_slot = False
            else:
                self._refresh_counter[job.spec.base_version_id] = k
        if not has_slot:
            self._refresh_blocked(job)
            return None
        job.slot_wait_since = None
        job.message = ""
        job.refreshes += 1
        self._job_event("refresh", job, version_id=version_id)
        return version_id

    def _refresh_blocked(self, job: TrainingJob) -> None:
        """No slot for a local refresh: every resident version is pinned by in-flight requests (idle ones
        are evicted, least recently used first). The job keeps training and retries at its next
        improvement; a local job (no round) whose refreshes stay blocked `refresh_slot_wait_s` fails with
        that reason instead of training for nothing. A round job's result goes to the aggregator, not to a
        slot, so it never fails for this."""
        now = self.clock()
        n = self.cfg.max_resident_adapters
        if job.slot_wait_since is None:
            job.slot_wait_since = now
            log.warning("%s: local refresh waits for an adapter slot (all %d pinned)", job.spec.adapter, n)
        waited = now - job.slot_wait_since
        job.message = (
            f"local refresh waiting for an adapter slot for {waited:.0f}s: all {n} slots "
            "(COLLM_MAX_RESIDENT_ADAPTERS) are pinned by in-flight requests"
        )
        if job.spec.round_id is None and waited >= self.cfg.refresh_slot_wait_s:
            job.stop()
            job.state = "failed"
            job.message = (
                f"no adapter slot for a local refresh within {self.cfg.refresh_slot_wait_s:.0f}s: all {n} "
                "slots are pinned by in-flight requests; raise COLLM_MAX_RESIDENT_ADAPTERS"
            )
            self._job_event("failed", job)
        else:
            job.pending_refresh = True  # retried after the next piece of work

    def _job_status(self, job: TrainingJob) -> TrainingJobStatus:
        state = job.state
        if state == "running" and self.training_paused:
            state = "paused"
        return TrainingJobStatus(
            adapter=job.spec.adapter,
            state=state,  # type: ignore[arg-type]
            base_version_id=job.spec.base_version_id,
            round_id=job.spec.round_id,
            tokens_done=job.tokens_done,
            token_budget=job.spec.token_budget,
            steps_done=job.steps_done,
            train_loss=job.train_loss,
            eval_loss=job.eval_loss,
            message=job.message,
        )

    def _job_event(self, kind: str, job: TrainingJob, **kw: Any) -> None:
        if self.on_job_event is None:
            return
        ev = JobEvent(
            kind=kind,
            adapter=job.spec.adapter,
            status=self._job_status(job),
            num_samples=job.samples_seen,
            num_tokens=job.tokens_done,
            round_id=job.spec.round_id,
            base_version=job.spec.base_version,
            train_loss=job.train_loss,
            eval_loss_before=job.eval_loss_before,
            eval_loss_after=job.eval_loss_after,
            **kw,
        )
        try:
            self.on_job_event(ev)
        except Exception:  # noqa: BLE001
            log.exception("job event handler failed")


class _NoSlot(Exception):
    pass
