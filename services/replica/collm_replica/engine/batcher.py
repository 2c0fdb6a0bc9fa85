"""The stateful scheduler: the engine's request queues, admission, preemption and KV blocks.

`Batcher` owns what the pure planner (`scheduler.plan_iteration`) decides over: the inbox of accepted
requests, the waiting queue (arrival order, preempted sequences at its front) and the running
sequences, the paged KV cache's block manager (`kv.BlockManager`, whose blocks' tensors the executor
holds: `executor.KVPool`) and the prefix cache over it (`prefix_cache.PrefixCache`).

* `submit` (any thread, under the engine's lock) refuses a request the replica cannot serve or queue
  (`check_request`, the queue's bound, the predicted wait, a duplicate id) or binds it to an adapter
  version and puts it in the inbox; `take_inbox` (engine thread) moves the inbox to the waiting queue.
* `schedule` plans the iteration on views of the sequences, gives back the blocks of the preempted ones
  (they return to the front of the queue to recompute) and admits the planned ones, sharing the cached
  prefix they start with.
* `work` and `advance` are the step's sequences before and after its forward (each block filled is
  registered in the prefix cache); `fork` gives a request's other choices their copy of the prompt.
* `release` frees a choice's blocks and its hold on its adapter version, exactly once; `expire` and
  `cancelled` take sequences out of the queues for the caller to finish.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from collm_common.wire.inference import Accepted
from collm_replica.costs import LatencyWindow, predicted_queue_wait_s
from collm_replica.engine.executor import Executor
from collm_replica.engine.kv import BlockManager, OutOfBlocks
from collm_replica.engine.prefix_cache import NO_HIT, PrefixCache
from collm_replica.engine.scheduler import Plan, SeqView, plan_iteration
from collm_replica.engine.sequence import Seq, SeqMaker
from collm_replica.engine.slots import Slots
from collm_replica.engine.types import (
    BASE,
    EngineConfig,
    EngineRefusal,
    EngineRequest,
    EventSink,
    NotResident,
)
from collm_replica.errors import context_length_exceeded


def check_request(req: EngineRequest, cfg: EngineConfig, max_model_len: int) -> None:
    """Raise EngineRefusal (400) for a request this replica can never serve: an empty prompt, no token
    to generate, more tokens than the model's context or the KV pool holds (all `n` choices at once)."""
    n = len(req.prompt_ids)
    if n == 0:
        raise EngineRefusal(400, "the prompt is empty", param="prompt")
    if req.max_tokens < 1:
        raise EngineRefusal(400, "max_tokens must be >= 1", param="max_tokens")
    if n + req.max_tokens > max_model_len:
        # OpenAI's code and vLLM's wording, which clients match to tell a context overflow from
        # other bad input; `param` (messages or prompt) is the caller's to name.
        raise context_length_exceeded(max_model_len, n, req.max_tokens)
    pool_tokens = cfg.batch.num_blocks * cfg.batch.block_size
    if cfg.batch.reserve_tokens(n + req.max_tokens) > pool_tokens:
        raise EngineRefusal(
            400,
            f"prompt + max_tokens = {n + req.max_tokens} tokens exceeds this replica's KV cache of "
            f"{pool_tokens} tokens",
            param="max_tokens",
        )
    if req.n > 1 and (
        req.n > cfg.batch.max_running or req.n * cfg.batch.reserve_tokens(n + req.max_tokens) > pool_tokens
    ):
        raise EngineRefusal(
            400,
            f"n={req.n} choices of prompt + max_tokens = {n + req.max_tokens} tokens do not fit this "
            f"replica at once (at most {cfg.batch.max_running} sequences, {pool_tokens} KV tokens)",
            param="n",
        )


class Batcher:
    """The queues, admission, preemption and KV blocks of one engine (see the module doc).

    `lock` (the engine's) guards the inbox, `n_waiting` (inbox and waiting queue), `active` (requests in
    flight by id), the slot table and `window`; the rest belongs to the engine thread. `stopping` set:
    `submit` refuses with 503. Counters: `arrivals_total` (client requests accepted),
    `preemptions_total` (sequences preempted)."""

    def __init__(
        self,
        cfg: EngineConfig,
        executor: Executor,
        slots: Slots,
        make: SeqMaker,
        window: LatencyWindow,
        lock: threading.Lock,
        stopping: threading.Event,
        clock: Callable[[], float],
        max_model_len: int,
    ) -> None:
        self.cfg = cfg
        self.slots = slots
        self.make = make
        self.window = window
        self.lock = lock
        self._stopping = stopping
        self.clock = clock
        self._started_s = clock()
        self.max_model_len = max_model_len
        b = cfg.batch
        self.blocks = BlockManager(b.num_blocks, b.block_size, cfg.prefix_caching)
        self.kv_pool = executor.attach_kv_pool(self.blocks)
        self.prefix = PrefixCache(self.blocks, cfg.prefix_caching)
        self.inbox: deque[Seq] = deque()
        self.n_waiting = 0
        self.active: dict[str, Seq] = {}
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []
        self.kv_reserved = 0  # reserve admission: tokens reserved by running sequences (whole blocks)
        self.arrivals_total = 0
        self.preemptions_total = 0

    # --- admission (any thread) -----------------------------------------------------------------------
    def submit(self, req: EngineRequest, sink: EventSink) -> Accepted:
        """Queue a request or raise EngineRefusal / NotResident. The sink gets `Accepted` (synchronously,
        before any other event)."""
        check_request(req, self.cfg, self.max_model_len)
        if req.grammar is not None:
            self.make.grammars.check(req.grammar, req.grammar_param)
        with self.lock:
            if self._stopping.is_set():
                raise EngineRefusal(503, "the replica is shutting down", "service_unavailable")
            if self.n_waiting >= self.cfg.max_queue:
                raise EngineRefusal(
                    429, f"the replica's queue is full ({self.cfg.max_queue} waiting)", "rate_limit_exceeded"
                )
            self._refuse_a_wait_past_the_slo(req)
            if req.request_id in self.active:
                raise EngineRefusal(
                    400, f"request id {req.request_id!r} is already in flight", param="request_id"
                )
            version_id, slot = BASE, -1
            if req.adapter is not None:
                bound = self.slots.resolve(req.adapter, req.version_id)
                if bound is None:
                    raise NotResident(req.version_id or req.adapter)
                version_id, slot = bound, self.slots.acquire(bound)
            seq = self.make(req, sink, version_id, slot, self.clock())
            seq.chain = self.prefix.chain(self.slots.cache_salt(version_id))
            accepted = Accepted(
                request_id=req.request_id,
                replica_id=self.cfg.replica_id,
                adapter_version_id=version_id,
                prompt_tokens=len(req.prompt_ids),
                queue_position=self.n_waiting,
            )
            sink(accepted)
            self.inbox.append(seq)
            self.active[req.request_id] = seq
            self.n_waiting += 1
            if not req.internal:
                self.arrivals_total += 1
        if req.span is not None:
            req.span.set_attribute("collm.adapter.version", version_id)
            req.span.add_event("queued", {"queue_position": accepted.queue_position})
        return accepted

    def _refuse_a_wait_past_the_slo(self, req: EngineRequest) -> None:
        """With `admit_wait_slo_factor`: 429 when the predicted queue wait exceeds that many times the
        request's TTFT SLO (called under the lock, which guards the latency window)."""
        factor = self.cfg.admit_wait_slo_factor
        if factor is None:
            return
        now = self.clock()
        span_s = min(self.cfg.slo_window_s, now - self._started_s)
        wait_s = predicted_queue_wait_s(self.n_waiting, self.window.finished_since(now - span_s), span_s)
        slo_s = (req.ttft_slo_ms or self.cfg.default_ttft_slo_ms) / 1e3
        if wait_s is not None and wait_s > factor * slo_s:
            raise EngineRefusal(
                429,
                f"the replica's queue ({self.n_waiting} waiting) is about {wait_s:.1f}s of work, more than "
                f"{factor:g} x this request's TTFT SLO of {slo_s:.1f}s",
                "rate_limit_exceeded",
            )

    def in_flight(self, request_id: str) -> bool:
        with self.lock:
            return request_id in self.active

    # --- the engine thread ----------------------------------------------------------------------------
    def take_inbox(self) -> list[Seq]:
        """Move the accepted requests to the end of the waiting queue; returns them."""
        with self.lock:
            new = list(self.inbox)
            self.inbox.clear()
        self.waiting.extend(new)
        return new

    def schedule(self, now: float) -> Plan:
        """Plan this iteration (`scheduler.plan_iteration`), preempt and admit as planned; returns the
        plan, whose items the step runs."""
        plan = plan_iteration(
            self.cfg.batch, *self._views(), self.kv_reserved, free_blocks=self.blocks.num_free
        )
        self._preempt(plan.preempted)
        by_id = {s.id: s for s in self.waiting}
        for sid in plan.admitted:
            self._admit(by_id[sid], now)
        return plan

    def _views(self) -> tuple[list[SeqView], list[SeqView]]:
        """The running and waiting sequences as the plan sees them. With the prefix cache, a running
        sequence gives back on preemption only the blocks it holds alone, and a waiting one counts the
        cached prefix it would share at admission (kept in `seq.hit` for the admission)."""
        b = self.cfg.batch
        if not self.prefix.enabled:
            return [s.view(b) for s in self.running], [s.view(b) for s in self.waiting]
        blocks = self.blocks
        running = [s.view(b, blocks.exclusive(s.kv.seq_id) if s.kv else 0) for s in self.running]
        room = b.max_running - len(self.running)  # admission takes at most the first `room` waiting
        for i, s in enumerate(self.waiting):
            s.hit = self.prefix.lookup(s.chain, s.known_tokens()) if i < room else NO_HIT
        return running, [s.view(b, hit=s.hit) for s in self.waiting]

    def _admit(self, seq: Seq, now: float) -> None:
        """Move `seq` from the waiting queue to the running sequences, sharing the cached prefix it
        starts with (`seq.hit`, found by this iteration's plan)."""
        self.waiting.remove(seq)
        with self.lock:
            self.n_waiting -= 1
        if seq.t_admit is None:
            seq.t_admit = now
        seq.kv = self.kv_pool.sequence(seq.reserve)
        seq.computed = seq.kv.length = self.prefix.take(
            seq.kv.seq_id, seq.chain, seq.hit, seq.prompt_len + len(seq.output)
        )
        seq.hit = NO_HIT
        self.kv_reserved += self.cfg.batch.reserve_tokens(seq.reserve)
        self.running.append(seq)
        if seq.req.span is not None:
            seq.req.span.add_event("prefill_start", {"queue_ms": (now - seq.t_arrival) * 1e3})

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
        with self.lock:
            self.n_waiting += len(out)

    def work(self, items: list[tuple[str, int]]) -> list[tuple[Seq, int]]:
        """The running sequences of a plan's items with their tokens, by adapter slot (each adapter one
        contiguous segment of the batch)."""
        by_id = {s.id: s for s in self.running}
        return sorted(((by_id[sid], n) for sid, n in items), key=lambda x: x[0].slot)

    def advance(self, seq: Seq, n: int) -> bool:
        """`seq` computed `n` more tokens: the blocks they filled are registered in the prefix cache.
        Returns whether all its known tokens are computed (its last logits give its next token)."""
        seq.computed += n
        if seq.chain is not None and seq.kv is not None:
            self.prefix.record(seq.kv.seq_id, seq.chain, seq.known_tokens, seq.computed)
        return seq.computed >= seq.prompt_len + len(seq.output)

    def fork(self, parent: Seq) -> list[Seq]:
        """Choices 1..n-1 of `parent`'s request, at the end of its prompt: each gets a copy of the
        prompt's KV blocks, or, when the pool has too few free blocks, goes to the front of the queue to
        recompute the prompt like a preempted sequence. They sample their first token from the parent's
        logits (the caller does)."""
        g = parent.group
        g.forked = True
        ready: list[Seq] = []
        queued: list[Seq] = []
        for i in range(1, g.n):
            with self.lock:
                slot = self.slots.acquire(parent.version_id) if parent.version_id != BASE else -1
            child = self.make(
                parent.req, parent.sink, parent.version_id, slot, parent.t_arrival, index=i, group=g
            )
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
            with self.lock:
                self.n_waiting += len(queued)
        return ready

    def _unqueue(self, seq: Seq) -> None:
        self.waiting.remove(seq)
        with self.lock:
            self.n_waiting -= 1

    def expire(self, wall_s: float) -> list[Seq]:
        """Take the waiting sequences past their deadline at `wall_s` (unix s) out of the queue."""
        out = [
            s for s in self.waiting if s.req.deadline_unix_s is not None and wall_s > s.req.deadline_unix_s
        ]
        for seq in out:
            self._unqueue(seq)
        return out

    def cancelled(self, request_id: str) -> list[Seq]:
        """Take the choices of request `request_id` still waiting out of the queue; returns them and
        those running (none when the request is not in flight)."""
        first = self.active.get(request_id)
        if first is None:
            return []
        out = []
        for seq in list(first.group.seqs):
            if seq.done:
                continue
            if seq in self.waiting:
                self._unqueue(seq)
            elif seq not in self.running:  # still in the inbox (cannot happen: the inbox is drained first)
                continue
            out.append(seq)
        return out

    def release(self, seq: Seq) -> None:
        """Free the choice's KV reservation and its hold on the adapter version (exactly once); the
        request leaves the active set with its last choice."""
        if seq.done:
            return
        seq.done = True
        if seq in self.running:
            self.running.remove(seq)
            self.kv_reserved -= self.cfg.batch.reserve_tokens(seq.reserve)
        elif seq in self.waiting:
            self._unqueue(seq)
        if seq.kv is not None:
            seq.kv.free()
        seq.kv = None
        g = seq.group
        with self.lock:
            if g.forked and all(s.done for s in g.seqs):
                self.active.pop(seq.req.request_id, None)
            self.slots.release(seq.version_id)
