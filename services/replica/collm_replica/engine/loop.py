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
2. `scheduler.plan_iteration` picks decode tokens and prefill chunks within the token budget and the
   paged KV pool (admitting, and preempting when the pool runs out, by blocks: `kv.BlockManager`); with
   the prefix cache (`prefix_cache`, setting `prefix_caching`), an admitted sequence shares the cached
   full blocks its tokens start with and computes only the rest, and every full block computed is
   registered for later requests;
3. the co-scheduler decides how much background time fits after this step (the slack of every request,
   from the cost model's estimates of this step and the next: `scheduler.decide_background`);
4. the executor runs the ragged multi-adapter batch; tokens are sampled, detokenized, stop-checked and
   streamed;
5. background work runs in pieces of about one decoder layer (`executor.LayerPass`) while the next
   piece is predicted to end within that time: first federated evaluations (on a publication's critical
   path; at least one piece per iteration, so they progress under any load), then training micro-steps
   (which resume at the next iteration where they stopped). An idle replica chains pieces back to back.

Adapter identity: a request is bound at admission to an exact version id (`base`, `name@vN`, or a local
refresh `name@vN+<replica>.<k>`), which pins its slot until it finishes; `Accepted` and `Finished` carry
that id.

The parts: `types` (settings, requests, events, the snapshot), `slots.Slots` (the adapter slot table),
`scheduler` (the batch plan and the background-work decision, pure), `kv` (the block manager),
`prefix_cache` (the blocks' content keys and the hit counters), `executor` (the model's forward over
the paged KV pool, and training passes), `background.Evaluations` and `background.Training` (the work
between iterations). `Engine` composes them and runs the loop.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from collm_common.data import Example, LocalDataset
from collm_common.lora import AdapterWeights
from collm_common.slo import meets_slo
from collm_common.step_log import BackgroundWork, InferenceStep
from collm_common.wire.inference import (
    Accepted,
    ChoiceFinish,
    Finished,
    GenerateError,
    TokenChunk,
    TokenLogprob,
    TopLogprob,
)
from collm_common.wire.telemetry import TrainingJobStatus
from collm_replica.constrain import Constraint, Grammars
from collm_replica.cosched import CoScheduler, TrainCost, effective_share, make_coscheduler
from collm_replica.costs import FinishedSample, LatencyWindow, PieceCosts, StepCosts, predicted_queue_wait_s
from collm_replica.engine.background import Evaluations, Examples, Training
from collm_replica.engine.executor import Executor, ForwardItem, SeqKV
from collm_replica.engine.kv import OutOfBlocks
from collm_replica.engine.prefix_cache import NO_HIT, BlockChain, PrefixCache, PrefixHit
from collm_replica.engine.scheduler import (
    ArrivalHistory,
    BackgroundInput,
    BackgroundSettings,
    BatchConfig,
    JobView,
    Plan,
    RequestView,
    SeqView,
    decide_background,
    plan_iteration,
)
from collm_replica.engine.slots import Slots
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
)
from collm_replica.errors import context_length_exceeded
from collm_replica.lora_bank import LoraBank
from collm_replica.models import LoadedModel
from collm_replica.sampling import IncrementalDetokenizer, Sampler, StopMatcher, TokenLogprobs, token_logprobs
from collm_replica.training import TRAIN_HEAD_ROWS, EvalRun, JobSpec, PieceWork, TrainingJob

log = logging.getLogger(__name__)


class _Group:
    """The choices of one request: choice 0 prefills the prompt, the other `n - 1` fork from it at its
    first token. They share one numbering of chunks, and one `Finished` goes out once all have ended."""

    __slots__ = ("n", "seqs", "chunk_seq", "ends", "forked", "failed")

    def __init__(self, n: int) -> None:
        self.n = n
        self.seqs: list[_Seq] = []
        self.chunk_seq = 0
        self.ends: dict[int, ChoiceFinish] = {}
        self.forked = n == 1  # no more choices will be created
        self.failed = False

    def next_chunk(self) -> int:
        self.chunk_seq += 1
        return self.chunk_seq - 1

    @property
    def all_ended(self) -> bool:
        return len(self.ends) == self.n


class _Seq:
    __slots__ = (
        "req", "sink", "version_id", "slot", "prompt_len", "computed", "output", "kv", "reserve", "sampler",
        "detok", "stops", "t_arrival", "t_admit", "t_first", "t_last", "ttft_slo", "tpot_slo",
        "done", "eos", "id", "index", "group", "constraint", "chain", "hit",
    )  # fmt: skip

    def __init__(self, req: EngineRequest, sink: EventSink, version_id: str, slot: int, tokenizer: Any,
                 eos: set[int], cfg: EngineConfig, now: float, vocab_size: int,
                 index: int = 0, group: _Group | None = None,
                 constraint: Constraint | None = None) -> None:  # fmt: skip
        self.req = req
        self.constraint = constraint
        self.index = index
        self.id = req.request_id if index == 0 else f"{req.request_id}/{index}"
        self.group = group or _Group(req.n)
        self.group.seqs.append(self)
        self.sink = sink
        self.version_id = version_id
        self.slot = slot
        self.prompt_len = len(req.prompt_ids)
        self.computed = 0
        self.output: list[int] = []
        self.kv: SeqKV | None = None
        self.reserve = self.prompt_len + req.max_tokens
        self.sampler = Sampler(req.sampling_config(index), req.prompt_ids, vocab_size)
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopMatcher(req.stop)
        self.t_arrival = now
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.ttft_slo = (req.ttft_slo_ms or cfg.default_ttft_slo_ms) / 1e3
        self.tpot_slo = (req.tpot_slo_ms or cfg.default_tpot_slo_ms) / 1e3
        self.done = False
        self.eos = set() if req.ignore_eos else eos
        self.chain: BlockChain | None = None  # its KV blocks' keys (None: the prefix cache is off)
        self.hit: PrefixHit = NO_HIT  # waiting: the cached prefix found when this iteration was planned

    def view(self, cfg: BatchConfig, freeable: int | None = None, hit: PrefixHit = NO_HIT) -> SeqView:
        """What the scheduler sees; `freeable`: the blocks a preemption gives back (None: all it holds);
        `hit`: a waiting sequence's cached prefix, counted as computed and held."""
        return SeqView(
            self.id,
            self.prompt_len,
            self.computed + hit.tokens,
            kv_reserve=cfg.reserve_tokens(self.reserve),
            output_len=len(self.output),
            blocks_held=(len(self.kv.blocks) if self.kv is not None else 0) + len(hit.blocks),
            freeable_blocks=freeable,
            revive_blocks=hit.revived,
        )

    def known_tokens(self) -> list[int]:
        """The prompt and the output so far."""
        return self.req.prompt_ids + self.output if self.output else self.req.prompt_ids

    def next_tokens(self, n: int) -> list[int]:
        """The `n` known tokens after those in the KV cache (prompt, then output after a preemption)."""
        c = self.computed
        if c + n <= self.prompt_len:
            return self.req.prompt_ids[c : c + n]
        return (self.req.prompt_ids + self.output)[c : c + n]

    def timing(self) -> RequestView:
        """The request as the background decision sees it."""
        return RequestView(
            self.id,
            self.t_arrival,
            self.ttft_slo,
            self.tpot_slo,
            self.t_first,
            self.prompt_len,
            self.computed,
            len(self.output),
            self.req.max_tokens,
        )


class _Serving:
    """The request side of the engine: the command queue into the engine thread, admission (`submit`),
    cancellation, deadlines, executing a planned step, tokens, finishing and releasing. `Engine` owns
    the state these methods use (declared here)."""

    cfg: EngineConfig
    tok: Any
    eos_ids: set[int]
    max_model_len: int
    executor: Executor
    slots: Slots
    prefix: PrefixCache
    clock: Callable[[], float]
    wall: Callable[[], float]
    step_log: Callable[[InferenceStep | BackgroundWork], None] | None
    step_costs: StepCosts
    window: LatencyWindow
    waiting: list[_Seq]
    running: list[_Seq]
    kv_reserved: int
    preemptions_total: int
    generated_tokens_total: int
    prefill_tokens_total: int
    arrivals_total: int
    forward_ms_total: float
    _train_decision: tuple[float, str | None]
    _lock: threading.Lock
    _inbox: deque[_Seq]
    _n_waiting: int
    _active: dict[str, _Seq]
    _stop: threading.Event
    _wake: threading.Event
    _cmds: queue.SimpleQueue[Callable[[], None]]

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

    def _refuse_a_wait_past_the_slo(self, req: EngineRequest) -> None:
        """With `admit_wait_slo_factor`: 429 when the predicted queue wait exceeds that many times the
        request's TTFT SLO (called under the lock, which guards the latency window)."""
        factor = self.cfg.admit_wait_slo_factor
        if factor is None:
            return
        now = self.clock()
        span_s = min(self.cfg.slo_window_s, now - self._started_s)
        wait_s = predicted_queue_wait_s(self._n_waiting, self.window.finished_since(now - span_s), span_s)
        slo_s = (req.ttft_slo_ms or self.cfg.default_ttft_slo_ms) / 1e3
        if wait_s is not None and wait_s > factor * slo_s:
            raise EngineRefusal(
                429,
                f"the replica's queue ({self._n_waiting} waiting) is about {wait_s:.1f}s of work, more than "
                f"{factor:g} x this request's TTFT SLO of {slo_s:.1f}s",
                "rate_limit_exceeded",
            )

    def _news(self) -> bool:
        """New requests or commands are waiting: background work yields to the next iteration."""
        return bool(self._inbox) or not self._cmds.empty()

    def submit(self, req: EngineRequest, sink: EventSink) -> Accepted:
        """Admit a request into the queue or raise EngineRefusal / NotResident. The sink gets `Accepted`
        (synchronously, before any other event), then the stream."""
        n = len(req.prompt_ids)
        limit = self.max_model_len
        if n == 0:
            raise EngineRefusal(400, "the prompt is empty", param="prompt")
        if req.max_tokens < 1:
            raise EngineRefusal(400, "max_tokens must be >= 1", param="max_tokens")
        if n + req.max_tokens > limit:
            # OpenAI's code and vLLM's wording, which clients match to tell a context overflow from
            # other bad input; `param` (messages or prompt) is the caller's to name.
            raise context_length_exceeded(limit, n, req.max_tokens)
        pool_tokens = self.cfg.batch.num_blocks * self.cfg.batch.block_size
        if self.cfg.batch.reserve_tokens(n + req.max_tokens) > pool_tokens:
            raise EngineRefusal(
                400,
                f"prompt + max_tokens = {n + req.max_tokens} tokens exceeds this replica's KV cache of "
                f"{pool_tokens} tokens",
                param="max_tokens",
            )
        if req.n > 1 and (
            req.n > self.cfg.batch.max_batch
            or req.n * self.cfg.batch.reserve_tokens(n + req.max_tokens) > pool_tokens
        ):
            raise EngineRefusal(
                400,
                f"n={req.n} choices of prompt + max_tokens = {n + req.max_tokens} tokens do not fit this "
                f"replica at once (at most {self.cfg.batch.max_batch} sequences, {pool_tokens} KV tokens)",
                param="n",
            )
        if req.grammar is not None:
            self.grammars.check(req.grammar, req.grammar_param)
        with self._lock:
            if self._stop.is_set():
                raise EngineRefusal(503, "the replica is shutting down", "service_unavailable")
            if self._n_waiting >= self.cfg.max_queue:
                raise EngineRefusal(
                    429, f"the replica's queue is full ({self.cfg.max_queue} waiting)", "rate_limit_exceeded"
                )
            self._refuse_a_wait_past_the_slo(req)
            if req.request_id in self._active:
                raise EngineRefusal(
                    400, f"request id {req.request_id!r} is already in flight", param="request_id"
                )
            version_id, slot = BASE, -1
            if req.adapter is not None:
                bound = self.slots.resolve(req.adapter, req.version_id)
                if bound is None:
                    raise NotResident(req.version_id or req.adapter)
                version_id, slot = bound, self.slots.acquire(bound)
            seq = _Seq(
                req, sink, version_id, slot, self.tok, self.eos_ids, self.cfg, self.clock(), self.vocab_size,
                constraint=self._constraint(req),
            )  # fmt: skip
            seq.chain = self.prefix.chain(self.slots.cache_salt(version_id))
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
            if not req.internal:
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

    def _fail_running(self, message: str) -> None:
        for seq in list(self.running):
            self._fail(seq, 500, message)

    def _preempt(self, seq_ids: list[str]) -> None:
        """Preempted sequences give back their KV blocks and return to the front of the queue, in
        arrival order, to recompute their prompt and output so far when readmitted."""
        if not seq_ids:
            return
        by_id = {s.id: s for s in self.running}
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
        first = self._active.get(request_id)
        if first is None:
            return
        for seq in list(first.group.seqs):
            if seq.done:
                continue
            if seq in self.waiting:
                self.waiting.remove(seq)
                with self._lock:
                    self._n_waiting -= 1
            elif seq not in self.running:  # still in the inbox (cannot happen: the inbox is drained first)
                continue
            self._finish(seq, "cancelled", self.clock())

    # --- execution ------------------------------------------------------------------------------------
    def _execute(self, items: list[tuple[str, int]]) -> None:
        t_start = time.perf_counter()
        by_id = {s.id: s for s in self.running}
        work = sorted(((by_id[sid], n) for sid, n in items), key=lambda x: x[0].slot)
        fitems = []
        prefill_tokens = 0
        chunks: list[tuple[int, int]] = []  # (tokens, earlier tokens) of each prefill chunk
        decode_context = 0  # tokens of context before the decoding sequences' new tokens
        internal_prefill = 0  # of prefill_tokens, the replica's own (left out of the serving counters)
        for seq, n in work:
            assert seq.kv is not None
            toks = seq.next_tokens(n)
            if seq.prompt_len + len(seq.output) - seq.computed > 1:  # a prefill (or recompute) chunk
                prefill_tokens += len(toks)
                internal_prefill += len(toks) if seq.req.internal else 0
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
        self.prefill_tokens_total += prefill_tokens - internal_prefill
        now = self.clock()
        for (seq, n), lg in zip(work, logits, strict=True):
            if seq.done:
                continue
            seq.computed += n
            if seq.chain is not None and seq.kv is not None:
                self.prefix.record(seq.kv.seq_id, seq.chain, seq.known_tokens, seq.computed)
            if seq.computed < seq.prompt_len + len(seq.output):
                continue  # more prompt (or recompute) chunks to come
            try:
                choices = [seq] if seq.group.forked else [seq, *self._fork(seq)]
                for choice in choices:
                    self._sample(choice, lg, now)
            except Exception as exc:  # noqa: BLE001 - fail this request, keep the batch
                log.exception("request %s failed", seq.req.request_id)
                self._fail(seq, 500, f"generation failed: {type(exc).__name__}")
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

    def _constraint(self, req: EngineRequest) -> Constraint | None:
        return self.grammars.constraint(req.grammar) if req.grammar is not None else None

    def _sample(self, seq: _Seq, logits: torch.Tensor, now: float) -> None:
        """Pick `seq`'s next token from its last-position logits (shared by a request's choices at a
        fork: never changed in place): penalties, then the grammar's mask, then sampling."""
        processed = seq.sampler.process(logits)
        if seq.constraint is not None:
            processed = seq.constraint.mask(processed)
        tok = seq.sampler.pick(processed)
        seq.sampler.observe(tok)
        if seq.constraint is not None:
            seq.constraint.advance(tok)
        lp = None if seq.req.logprobs is None else token_logprobs(logits, tok, seq.req.logprobs)
        self._on_token(seq, tok, now, lp)

    def _fork(self, parent: _Seq) -> list[_Seq]:
        """Choices 1..n-1 of `parent`'s request, at the end of its prompt: each gets a copy of the
        prompt's KV blocks, or, when the pool has too few free blocks, goes to the front of the queue to
        recompute the prompt like a preempted sequence. They sample their first token from the parent's
        logits (the caller does)."""
        g = parent.group
        g.forked = True
        ready: list[_Seq] = []
        queued: list[_Seq] = []
        for i in range(1, g.n):
            with self._lock:
                slot = self.slots.acquire(parent.version_id) if parent.version_id != BASE else -1
            child = _Seq(
                parent.req, parent.sink, parent.version_id, slot, self.tok, self.eos_ids, self.cfg,
                parent.t_arrival, self.vocab_size, index=i, group=g, constraint=self._constraint(parent.req),
            )  # fmt: skip
            child.t_admit = parent.t_admit
            child.chain = parent.chain.fork() if parent.chain is not None else None
            child.kv = self.kv_pool.sequence(child.reserve)
            assert parent.kv is not None
            try:
                if child.chain is not None:  # the prefix cache: share the prompt's full blocks
                    self.kv_pool.fork_prefix(parent.kv, child.kv, parent.computed)
                else:
                    child.kv.ensure(parent.computed)
                    self.kv_pool.copy_prefix(parent.kv, child.kv, parent.computed)
            except OutOfBlocks:
                child.kv.free()
                child.kv = None
                queued.append(child)
            else:
                child.computed = parent.computed
                self.kv_reserved += self.cfg.batch.reserve_tokens(child.reserve)
                self.running.append(child)
            ready.append(child)
        if queued:
            self.waiting[:0] = queued
            with self._lock:
                self._n_waiting += len(queued)
        return ready

    def _on_token(self, seq: _Seq, tok: int, now: float, lp: TokenLogprobs | None = None) -> None:
        if seq.t_first is None:
            seq.t_first = now
            if seq.req.span is not None:
                seq.req.span.add_event("first_token", {"ttft_ms": (now - seq.t_arrival) * 1e3})
        seq.t_last = now
        seq.output.append(tok)
        if not seq.req.internal:
            self.generated_tokens_total += 1
        if tok in seq.eos:
            tail = seq.stops.flush()
            if tail:
                self._chunk(seq, [], tail)
            self._finish(seq, "stop", now)
            return
        text = seq.stops.push(seq.detok.push(tok))
        if seq.stops.stopped:
            self._chunk(seq, [tok], text, lp)
            self._finish(seq, "stop", now)
            return
        if seq.constraint is not None and seq.constraint.complete:  # the grammar admits nothing more
            self._chunk(seq, [tok], text + seq.stops.flush(), lp)
            self._finish(seq, "stop", now)
            return
        if len(seq.output) >= seq.req.max_tokens:
            self._chunk(seq, [tok], text + seq.stops.flush(), lp)
            self._finish(seq, "length", now)
            return
        self._chunk(seq, [tok], text, lp)

    def _chunk(self, seq: _Seq, token_ids: list[int], text: str, lp: TokenLogprobs | None = None) -> None:
        logprobs = None if lp is None else [self._wire_logprob(lp)]
        seq.sink(
            TokenChunk(
                request_id=seq.req.request_id,
                seq=seq.group.next_chunk(),
                token_ids=token_ids,
                text=text,
                logprobs=logprobs,
                index=seq.index,
            )
        )

    def _token_text(self, token_id: int) -> str:
        return str(self.tok.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def _wire_logprob(self, lp: TokenLogprobs) -> TokenLogprob:
        tb = self.grammars.token_bytes
        return TokenLogprob(
            token_id=lp.token_id,
            token=self._token_text(lp.token_id),
            logprob=lp.logprob,
            top=[
                TopLogprob(token_id=t, token=self._token_text(t), logprob=v, token_bytes=tb(t))
                for t, v in lp.top
            ],
            token_bytes=tb(lp.token_id),
        )

    def _completion_tokens(self, seq: _Seq) -> int:
        return sum(1 for t in seq.output if t not in seq.eos)

    def _finish(self, seq: _Seq, reason: str, now: float) -> None:
        """Choice `seq` ended; when it was the request's last, its `Finished` goes out."""
        if seq.done:
            return
        g = seq.group
        g.ends[seq.index] = ChoiceFinish(
            index=seq.index,
            finish_reason=reason,  # type: ignore[arg-type]
            completion_tokens=self._completion_tokens(seq),
        )
        if not g.forked:  # ended before its first token: the other choices never start
            g.forked = True
            for i in range(1, g.n):
                g.ends[i] = ChoiceFinish(index=i, finish_reason=reason, completion_tokens=0)  # type: ignore[arg-type]
        self._release(seq)
        if g.all_ended and not g.failed:
            self._finished(g.seqs[0], now)

    def _finished(self, seq: _Seq, now: float) -> None:
        """The request's `Finished`: choice 0's reason and timings, the choices' tokens summed."""
        g = seq.group
        ends = [g.ends[i] for i in range(g.n)]
        reason = ends[0].finish_reason
        completion = sum(e.completion_tokens for e in ends)
        e2e_ms = ((seq.t_last or now) - seq.t_arrival) * 1e3
        # No token at all: the answer's first token counts as out at its end (TTFT = e2e).
        ttft_ms = (seq.t_first - seq.t_arrival) * 1e3 if seq.t_first is not None else e2e_ms
        tpot_ms = (e2e_ms - ttft_ms) / (len(seq.output) - 1) if len(seq.output) > 1 else 0.0
        queue_ms = ((seq.t_admit or now) - seq.t_arrival) * 1e3
        seq.sink(
            Finished(
                request_id=seq.req.request_id,
                seq=g.next_chunk(),
                finish_reason=reason,
                prompt_tokens=seq.prompt_len,
                completion_tokens=completion,
                adapter_version_id=seq.version_id,
                replica_id=self.cfg.replica_id,
                queue_ms=queue_ms,
                ttft_ms=ttft_ms,
                tpot_ms=tpot_ms,
                e2e_ms=e2e_ms,
                choices=ends if g.n > 1 else None,
            )
        )
        if seq.req.internal:
            pass
        elif reason in ("stop", "length"):
            tpot = tpot_ms if len(seq.output) > 1 else None
            good = meets_slo(ttft_ms, tpot, seq.ttft_slo * 1e3, seq.tpot_slo * 1e3)
            with self._lock:
                self.window.add(FinishedSample(now, ttft_ms, tpot_ms if len(seq.output) > 1 else None, good))
        elif reason == "deadline":  # dropped from the queue at its deadline: a miss, without latencies
            with self._lock:
                self.window.add(FinishedSample(now, None, None, False))
        span = seq.req.span
        if span is not None:
            span.add_event("finished", {"finish_reason": reason, "completion_tokens": completion})
            span.set_attribute("collm.finish_reason", reason)
            span.set_attributes(  # GenAI semantic conventions (collm_replica.observe sets the request's)
                {
                    "gen_ai.usage.input_tokens": seq.prompt_len,
                    "gen_ai.usage.output_tokens": completion,
                    "gen_ai.response.finish_reasons": tuple(e.finish_reason for e in ends),
                }
            )
            span.end()

    def _fail(self, seq: _Seq, code: int, message: str) -> None:
        """The request of `seq` fails: one error event, and every choice of it is released."""
        self._emit_error(seq, code, message)
        seq.group.forked = True
        for s in list(seq.group.seqs):
            self._release(s)

    def _emit_error(self, seq: _Seq, code: int, message: str, type_: str = "server_error") -> None:
        g = seq.group
        if g.failed or (g.forked and all(s.done for s in g.seqs)):
            return
        g.failed = True
        with contextlib.suppress(Exception):
            seq.sink(GenerateError(request_id=seq.req.request_id, code=code, type=type_, message=message))
        if seq.req.span is not None:
            seq.req.span.add_event("error", {"code": code, "message": message})
            seq.req.span.end()

    def _release(self, seq: _Seq) -> None:
        """Free the choice's KV reservation and its hold on the adapter version (exactly once); the
        request leaves the active set with its last choice."""
        if seq.done:
            return
        seq.done = True
        if seq in self.running:
            self.running.remove(seq)
            self.kv_reserved -= self.cfg.batch.reserve_tokens(seq.reserve)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            with self._lock:
                self._n_waiting -= 1
        if seq.kv is not None:
            seq.kv.free()
        seq.kv = None
        g = seq.group
        with self._lock:
            if g.forked and all(s.done for s in g.seqs):
                self._active.pop(seq.req.request_id, None)
            self.slots.release(seq.version_id)


class Engine(_Serving):
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
        self.vocab_size = int(loaded.config.vocab_size)
        self.grammars = Grammars(loaded.tokenizer, self.vocab_size)
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
        self.on_job_event = on_job_event
        self.clock = clock
        self._started_s = clock()
        self.wall = wall
        self.step_log = step_log  # told every inference step and stretch of background work (`step_log`)
        # The training budget decided for the iteration in progress and what bounded it (for the step log).
        self._train_decision: tuple[float, str | None] = (0.0, None)

        self._lock = threading.Lock()
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
        self.kv_pool = self.executor.init_kv_pool(
            self.cfg.batch.num_blocks, self.cfg.batch.block_size, caching=self.cfg.prefix_caching
        )
        self.prefix = PrefixCache(self.kv_pool.blocks, self.cfg.prefix_caching)
        self.preemptions_total = 0
        self._share: float | None = None
        self._share_expires: float | None = None
        self._spend = 0.0  # with the coordinator's share: its spend beyond the slack (`cosched`)
        self._arrivals = ArrivalHistory(self.cfg.slo_window_s)
        self._prompt_tokens_ewma = 64.0  # prompt length of recent arrivals (the next one's, as a guess)
        self.iteration = 0
        self._settings = BackgroundSettings(
            batch=self.cfg.batch,
            train_guard_frac=self.cfg.train_guard_frac,
            train_slack_frac=self.cfg.train_slack_frac,
            train_slo_reserve_frac=self.cfg.train_slo_reserve_frac,
            micro_tokens=self.cfg.job.micro_tokens,
            batch_tokens=self.cfg.job.batch_tokens,
            train_spend_stretch_frac=self.cfg.train_spend_stretch_frac,
        )

        # Costs and counters.
        self.step_costs = StepCosts()
        self.piece_costs = PieceCosts()
        self.window = LatencyWindow(self.cfg.slo_window_s)
        self.generated_tokens_total = 0
        self.prefill_tokens_total = 0
        self.arrivals_total = 0
        self.infer_ms_total = 0.0  # wall time of inference iterations (forward, sampling, streaming)
        self.forward_ms_total = 0.0  # of which the model's forward passes
        self.longest_background_ms = 0.0  # longest stretch of background work between two iterations
        # Iterations that served with a training job active, by what bounded their training time
        # (`cosched.Limit`; "policy" for co-schedulers that do not say).
        self.train_limits: dict[str, int] = {}

        # The adapter slot table and the background work.
        self.slots = Slots(
            self.cfg, self.bank, self.executor.n_layers, self.executor.shapes, self._lock, clock
        )
        self.examples = Examples(dataset or LocalDataset([], []), self.tok, self.cfg)
        self.evals = Evaluations(
            self.cfg,
            self.executor,
            loaded,
            self.examples,
            self.piece_costs,
            clock,
            wall,
            self._min_ttft_slo_ms,
            self._news,
            self._log_background,
        )
        self.training = Training(
            self.cfg, self.executor, self.examples, self.slots, self.piece_costs, self.cosched, self._lock,
            clock, wall, self._min_ttft_slo_ms, self._news, self._log_background, self._emit_job_event,
        )  # fmt: skip

    # --- state kept by the parts ----------------------------------------------------------------------
    @property
    def dataset(self) -> LocalDataset:
        return self.examples.dataset

    @property
    def jobs(self) -> dict[str, TrainingJob]:
        return self.training.jobs

    @property
    def training_paused(self) -> bool:
        return self.training.paused

    @property
    def ft_tokens_total(self) -> int:
        return self.training.ft_tokens_total

    @property
    def train_ms_total(self) -> float:
        """Wall time of training pieces."""
        return self.training.train_ms_total

    @property
    def eval_ms_total(self) -> float:
        """Wall time of evaluation pieces (requests and jobs' own evaluations)."""
        return self.evals.ms_total + self.training.eval_ms_total

    @property
    def prefix_cache_queries_total(self) -> int:
        """Known tokens of the sequences admitted, looked up in the prefix cache (0 when it is off)."""
        return self.prefix.queries_total

    @property
    def prefix_cache_hits_total(self) -> int:
        """Of `prefix_cache_queries_total`, the tokens taken from the cache instead of computed."""
        return self.prefix.hits_total

    @property
    def ft_loss(self) -> float | None:
        return self.training.ft_loss

    @property
    def last_work(self) -> PieceWork | None:
        """The last stretch of training (for tests and benchmarks)."""
        return self.training.last_work

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

        def apply() -> None:
            self._share = share
            self._spend = spend
            self._share_expires = self.clock() + ttl_s

        return self._call(apply)

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
        t_asked = self.clock()
        self._command(
            lambda: self.evals.enqueue(
                fut,
                candidates,
                max_examples,
                adapter,
                max_tokens,
                digests,
                priority,
                deadline_unix_s,
                t_asked,
            )
        )
        return fut

    def snapshot(self) -> EngineSnapshot:
        now = self.clock()
        share, source = effective_share(now, self._share, self._share_expires, self.cfg.ft_share_default)
        with self._lock:
            latency = self.window.summary(now)
            adapters = self.slots.resident(lambda name: name in self.jobs and self.jobs[name].active)
            queue_len = self._n_waiting
            live = self.training.live_work  # a stretch of training in progress counts as it goes
            ft_tokens_total = self.training.ft_tokens_total + (live.train_tokens if live else 0)
            train_ms_total = self.training.train_ms_total + (live.train_ms if live else 0.0)
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
            ft_spend=self._spend if source == "coordinator" else 0.0,
            ft_loss=self.ft_loss,
            training_paused=self.training_paused,
            latency=latency,
            decode_step_ms=decode.get(max(decode)) if decode else None,
            prefill_ms_per_token=prefill_ms,
            train_step_ms=self.training.train_step_ms,
            jobs=[self.training.job_status(j) for j in list(self.jobs.values())],
            adapters=adapters,
            local_samples=len(self.dataset.train) + len(self.dataset.eval),
            domains=self.dataset.domains,
            train_limits=dict(self.train_limits),
            prefix_cache_queries_total=self.prefix.queries_total,
            prefix_cache_hits_total=self.prefix.hits_total,
        )

    # ===================================================================================== internals
    def _log_background(self, work: BackgroundWork) -> None:
        if self.step_log is not None:
            self.step_log(work)

    def _emit_job_event(self, event: JobEvent) -> None:
        if self.on_job_event is not None:
            self.on_job_event(event)

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

    def _iteration(self) -> bool:
        self._wake.clear()
        now = self.clock()
        with self._lock:
            while self._inbox:
                seq = self._inbox.popleft()
                self.waiting.append(seq)
                if not seq.req.internal:
                    self._arrivals.record(now, seq.ttft_slo * 1e3)
                self._prompt_tokens_ewma = 0.9 * self._prompt_tokens_ewma + 0.1 * seq.prompt_len
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            cmd()
        self.slots.run_pending()
        self._expire(now)
        self.iteration += 1

        b = self.cfg.batch
        plan = plan_iteration(b, *self._views(), self.kv_reserved, free_blocks=self.kv_pool.blocks.num_free)
        self._preempt(plan.preempted)
        by_id = {s.id: s for s in self.waiting}
        for sid in plan.admitted:
            seq = by_id[sid]
            self.waiting.remove(seq)
            with self._lock:
                self._n_waiting -= 1
            if seq.t_admit is None:
                seq.t_admit = now
            seq.kv = self.kv_pool.sequence(seq.reserve)
            seq.computed = seq.kv.length = self.prefix.take(
                seq.kv.seq_id, seq.chain, seq.hit, seq.prompt_len + len(seq.output)
            )
            seq.hit = NO_HIT
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
        if self.evals:
            worked = self.evals.work(now + (step_ms + eval_ms) / 1e3) or worked
        if train_ms > 0 and job is not None:
            force = idle and not self.evals  # pending evaluations come first, even when idle
            worked = self.training.work(job, now + (step_ms + train_ms) / 1e3, force_one=force) or worked
        # A round job past its deadline (less the margin) wraps up and sends its update whatever this
        # iteration granted training (a zero share, no slack, training paused): the wrap-up is bounded (at
        # most the backward of the micro-step in progress, or a first micro-step's rest within the guard,
        # and one optimizer step: `TrainingJob._finish_training`), and an update held back would cost the
        # whole round its participant.
        for due in [j for j in self.training.active_jobs() if j.due(self.cfg.round_deadline_margin_s)]:
            worked = self.training.work(due, now, force_one=False) or worked
        bg_ms = (time.perf_counter() - t_bg) * 1e3
        if bg_ms > self.longest_background_ms:
            self.longest_background_ms = bg_ms
        return worked

    # --- scheduling helpers ---------------------------------------------------------------------------
    def _views(self) -> tuple[list[SeqView], list[SeqView]]:
        """The running and waiting sequences as the plan sees them. With the prefix cache, a running
        sequence gives back on preemption only the blocks it holds alone, and a waiting one counts the
        cached prefix it would share at admission (kept in `seq.hit` for the admission)."""
        b = self.cfg.batch
        if not self.prefix.enabled:
            return [s.view(b) for s in self.running], [s.view(b) for s in self.waiting]
        blocks = self.kv_pool.blocks
        running = [s.view(b, blocks.exclusive(s.kv.seq_id) if s.kv else 0) for s in self.running]
        room = b.max_batch - len(self.running)  # admission takes at most the first `room` waiting
        for i, s in enumerate(self.waiting):
            s.hit = self.prefix.lookup(s.chain, s.known_tokens()) if i < room else NO_HIT
        return running, [s.view(b, hit=s.hit) for s in self.waiting]

    def _min_ttft_slo_ms(self) -> float:
        """The tightest TTFT SLO of present requests and of those that arrived within the SLO window
        (`scheduler.ArrivalHistory`), now."""
        present = [s.ttft_slo * 1e3 for s in (*self.running, *self.waiting)]
        return self._arrivals.min_ttft_slo_ms(self.clock(), present, self.cfg.default_ttft_slo_ms)

    def _decide_background(
        self, now: float, plan: Plan
    ) -> tuple[float, float, float, TrainingJob | None, bool]:
        """(predicted inference ms, training ms, evaluation ms, the job to train, idle) of this iteration
        (`scheduler.decide_background` on the engine's state)."""
        jobs = self.training.active_jobs()
        share, source = effective_share(now, self._share, self._share_expires, self.cfg.ft_share_default)
        fixed, per = self.piece_costs.micro_step(self.executor.n_layers, head_rows=TRAIN_HEAD_ROWS)
        min_ttft_ms = self._min_ttft_slo_ms()
        margin_s = self.cfg.round_deadline_margin_s
        inp = BackgroundInput(
            now_s=now,
            share=share,
            running=[s.timing() for s in self.running],
            waiting=[s.timing() for s in self.waiting],
            plan_items=plan.items,
            plan_tokens=plan.tokens,
            step_ms=self.step_costs.line.predict(plan.tokens) if plan.tokens else 0.0,
            decode_step_ms=self.step_costs.decode_at(max(1, len(self.running))),
            prefill_ms_per_token=self.step_costs.prefill_ms_per_token(),
            train=TrainCost(fixed, per),
            min_ttft_slo_ms=min_ttft_ms,
            prompt_tokens_guess=round(self._prompt_tokens_ewma),
            arrivals_within_ttft=self._arrivals.likely_arrivals(min_ttft_ms / 1e3),
            jobs=[JobView(due=j.due(margin_s), in_progress=j.in_progress) for j in jobs],
            training_paused=self.training.paused,
            evals_pending=bool(self.evals),
            iteration=self.iteration,
            job_rr=self.training.job_rr,
            spend=self._spend if source == "coordinator" else 0.0,
        )
        d = decide_background(inp, self._settings, self.cosched)
        self.training.job_rr = d.job_rr
        self._train_decision = (max(0.0, d.train_ms), d.limit) if d.has_job else (0.0, None)
        if d.has_job and not d.idle:  # what bounded training while serving (observability)
            self.train_limits[d.limit] = self.train_limits.get(d.limit, 0) + 1
        job = jobs[d.job] if d.job is not None else None
        return d.step_ms, d.train_ms, d.eval_ms, job, d.idle
