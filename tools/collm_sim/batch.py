"""A simulated replica's requests: its waiting queue, its running batch and their paged KV cache.

The queue is bounded (`max_queue`: a full queue refuses, a 429) and a waiting request is dropped at its
deadline (`request_timeout_s`). Each iteration the replica's `engine.scheduler.plan_iteration` picks
decode tokens and prefill chunks, admits FCFS and preempts by the blocks of the paged KV cache
(`kv_admission`, as the replica: a preempted request goes back to the front of the queue and recomputes
its prompt and output before its next token). A step emits its tokens when it ends: a prompt's last
prefill chunk its first token (TTFT), every decode one more token; a request ends with its output
length, and its latency sample goes to the telemetry's window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from itertools import islice

from collm_common.slo import meets_slo, meets_slo_alone
from collm_sim.config import EngineSpec
from collm_sim.plugins import (
    BatchConfig,
    FinishedSample,
    LatencyWindow,
    RequestView,
    SeqView,
    blocks_for,
    plan_iteration,
    repeated_decodes,
)


class Req:
    """One request's life in the simulation."""

    __slots__ = (
        "idx",
        "sid",
        "arrival_s",
        "prompt_len",
        "out_len",
        "domain",
        "computed",
        "generated",
        "t_first",
        "t_end",
        "status",
        "replica",
        "version",
        "view",
        "reserve",
        "attempts",
        "target",
        "blocks",
        "train_at_arrival",
        "train_at_first",
    )

    def __init__(self, idx: int, arrival_s: float, prompt_len: int, out_len: int, domain: str) -> None:
        self.idx = idx
        self.sid = str(idx)
        self.arrival_s = arrival_s
        self.prompt_len = prompt_len
        self.out_len = out_len
        self.domain = domain
        self.computed = 0
        self.generated = 0
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.status = "pending"
        self.replica: str | None = None
        self.version: str | None = None
        self.reserve = prompt_len + out_len
        # The scheduler's view (None: to be built from the request's state, `seq_view`).
        self.view: SeqView | None = SeqView(self.sid, prompt_len, 0, self.reserve)
        self.attempts = 0
        self.target = (
            prompt_len  # tokens to compute before the next token: the prompt (+ output to recompute)
        )
        self.blocks = 0  # KV blocks held (paged admission)
        # The replica's training so far (ms, `ServingBatch.train_ms_total`) at arrival and first token.
        self.train_at_arrival = 0.0
        self.train_at_first = 0.0

    def seq_view(self) -> SeqView:
        """The scheduler's view of the request: the one set last, or, after `ServingBatch.set_view`, its
        state now (built when a plan first needs it: iterations that reuse a plan never do)."""
        view = self.view
        if view is None:
            view = self.view = SeqView(
                self.sid, self.prompt_len, self.kv_tokens(), self.reserve, output_len=self.generated,
                blocks_held=self.blocks,
            )  # fmt: skip
        return view

    def kv_tokens(self) -> int:
        """Tokens in the KV cache: the prefill done so far, or the prompt and all but the last output."""
        return self.computed if self.computed < self.target else self.prompt_len + self.generated - 1


# One planned step: (items as (request, tokens), decodes, their tokens of context, prefill chunks as
# (tokens, earlier tokens), distinct adapters, tokens, whether it admitted or preempted).
StepPlan = tuple[list[tuple[Req, int]], int, int, list[tuple[int, int]], int, int, bool]


class ServingBatch:
    """The waiting queue, the running batch and the KV cache of one simulated replica. `versions` is the
    cluster's current version of each adapter (read at admission); a finished or timed-out request's
    latency sample goes to `window`, then `on_finish(req)` is told."""

    def __init__(
        self,
        engine: EngineSpec,
        versions: dict[str, int],
        ttft_slo_ms: float | None,
        tpot_slo_ms: float | None,
        request_timeout_s: float,
        window: LatencyWindow,
        on_finish: Callable[[Req], None],
    ) -> None:
        self.cfg = BatchConfig(
            engine.max_batch,
            engine.max_batch_tokens,
            engine.prefill_chunk_tokens,
            engine.kv_budget_tokens,
            block_size=engine.kv_block_tokens,
            kv_admission=engine.kv_admission,  # type: ignore[arg-type]
        )
        self.max_queue = engine.max_queue
        self.versions = versions
        # The workload's SLOs judge a finished request (None: no bound); the engine schedules by the
        # SLOs the requests carry, its defaults for those that carry none.
        self.ttft_slo_ms = ttft_slo_ms
        self.tpot_slo_ms = tpot_slo_ms
        self.ttft_slo_s = (ttft_slo_ms or engine.default_ttft_slo_ms) / 1e3
        self.tpot_slo_s = (tpot_slo_ms or engine.default_tpot_slo_ms) / 1e3
        self.request_timeout_s = request_timeout_s
        self.window = window
        self.on_finish = on_finish
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.by_sid: dict[str, Req] = {}
        self.kv_reserved = 0
        self.blocks_used = 0  # KV blocks held by running requests (paged admission)
        self.preemptions = 0
        self.train_ms_total = 0.0  # the replica's training so far (its owner adds each stretch)

    @property
    def free_blocks(self) -> int:
        return self.cfg.num_blocks - self.blocks_used

    @property
    def kv_used_frac(self) -> float:
        """The KV cache in use, as the replica's telemetry reports it: blocks held (paged admission) or
        tokens reserved (reserve admission)."""
        if self.cfg.kv_admission == "paged":
            return self.blocks_used / self.cfg.num_blocks
        return self.kv_reserved / self.cfg.kv_budget_tokens

    def enqueue(self, req: Req) -> bool:
        """Admission to the waiting queue; False (a 429) when the queue is full."""
        if len(self.waiting) >= self.max_queue:
            return False
        req.train_at_arrival = self.train_ms_total
        self.waiting.append(req)
        return True

    def request_view(self, r: Req) -> RequestView:
        """The request as the engine's background decision sees it (`Sequence.timing`): its SLOs, first
        token, prompt, tokens computed and output so far; `max_tokens` is its output length (the benchmark
        client asks for exactly the trace's output length)."""
        return RequestView(
            r.sid, r.arrival_s, self.ttft_slo_s, self.tpot_slo_s, r.t_first, r.prompt_len, r.computed,
            r.generated, r.out_len,
        )  # fmt: skip

    def plan(self) -> StepPlan:
        """This iteration's inference step by the replica's `plan_iteration`, with its admissions and
        preemptions applied (`StepPlan`)."""
        running = self.running
        free = self.cfg.max_running - len(running)
        wviews = [r.seq_view() for r in islice(self.waiting, free)] if free > 0 and self.waiting else []
        plan = plan_iteration(
            self.cfg, [r.seq_view() for r in running], wviews, self.kv_reserved, self.free_blocks
        )
        if plan.preempted:
            self._preempt(plan.preempted)
        for sid in plan.admitted:
            req = self.waiting.popleft()
            assert req.sid == sid, "admission is FCFS"
            running.append(req)
            self.by_sid[sid] = req
            self.kv_reserved += req.reserve
            v = self.versions.get(req.domain)
            req.version = f"{req.domain}@v{v}" if v else "base"
        items: list[tuple[Req, int]] = []
        n_dec = 0
        dec_context = 0  # tokens of context of the decoding sequences
        chunks: list[tuple[int, int]] = []  # (tokens, earlier tokens) of each prefill chunk
        adapters: set[str] = set()
        by_sid = self.by_sid
        tokens = 0
        for sid, n in plan.items:
            req = by_sid[sid]
            items.append((req, n))
            adapters.add(req.domain)
            tokens += n
            if req.computed >= req.target:
                n_dec += 1
                dec_context += req.prompt_len + req.generated - 1  # the tokens before this one
            else:
                chunks.append((n, req.computed))
        changed = bool(plan.admitted or plan.preempted)
        return items, n_dec, dec_context, chunks, len(adapters), tokens, changed

    def decode_repeats(self, cap: int | None = None) -> int:
        """With every running request decoding and nothing waiting: how many iterations in a row, this
        one first, plan one decode token per request (`scheduler.repeated_decodes`, on the blocks held
        before this iteration's step), none past the first request to finish and at most `cap`; 0 when
        fewer than 2."""
        most = min(r.out_len - r.generated for r in self.running)
        if most < 2:
            return 0
        views = [r.seq_view() for r in self.running]
        k = repeated_decodes(self.cfg, views, (), self.free_blocks, most if cap is None else min(most, cap))
        return k if k >= 2 else 0

    def emit(self, items: list[tuple[Req, int]], t_inf: float) -> tuple[int, int]:
        """The tokens of a step that ended at `t_inf`: prefill progress, first tokens, one more token per
        decode; a request with its whole output finishes. Returns (prefill tokens, tokens generated)."""
        block_size = self.cfg.block_size
        prefilled = generated = grown = 0  # grown: blocks taken by the decoding requests
        for req, n in items:
            if req.computed < req.target:
                req.computed += n
                prefilled += n
                if req.computed < req.target:
                    self.set_view(req)
                    continue
                if req.t_first is None:
                    req.t_first = t_inf
                    req.train_at_first = self.train_ms_total
            req.generated += 1
            generated += 1
            if req.generated >= req.out_len:
                self.finish(req, t_inf, "ok")
            else:  # `set_view` of a decoding request: its KV holds the prompt and all but the last output
                blocks = blocks_for(req.prompt_len + req.generated - 1, block_size)
                grown += blocks - req.blocks
                req.blocks = blocks
                req.view = None
        self.blocks_used += grown
        return prefilled, generated

    def decoded(self, items: list[tuple[Req, int]], m: int) -> None:
        """`m` decode iterations in a row gave every request of `items` one token each (none finishes)."""
        for req, _ in items:
            req.generated += m
            self.set_view(req)

    def set_view(self, req: Req) -> None:
        """After the request's step: the KV blocks it now holds, and its view for the planner to be
        built from its state (`Req.seq_view`)."""
        blocks = blocks_for(req.kv_tokens(), self.cfg.block_size)
        self.blocks_used += blocks - req.blocks
        req.blocks = blocks
        req.view = None

    def _preempt(self, sids: list[str]) -> None:
        """Preempted requests give back their blocks and return to the front of the queue, in arrival
        order, to recompute their prompt and output (as the replica's engine does)."""
        for req in sorted((self.by_sid[s] for s in sids), key=lambda r: r.idx, reverse=True):
            self.running.remove(req)
            del self.by_sid[req.sid]
            self.kv_reserved -= req.reserve
            self.blocks_used -= req.blocks
            req.blocks = 0
            req.computed = 0
            req.target = req.prompt_len + req.generated
            req.view = SeqView(req.sid, req.prompt_len, 0, req.reserve, output_len=req.generated)
            self.waiting.appendleft(req)
        self.preemptions += len(sids)

    def finish(self, req: Req, t: float, status: str) -> None:
        """The request ends at `t`: "ok" (its output done; it leaves the batch) or "timeout" (dropped from
        the queue at its deadline, a miss)."""
        req.t_end = t
        req.status = status
        if status == "ok":
            self.running.remove(req)
            del self.by_sid[req.sid]
            self.kv_reserved -= req.reserve
            self.blocks_used -= req.blocks
            req.blocks = 0
            # As the engine: an answer without tokens has its first token at its end (TTFT = e2e).
            first_s = req.t_first if req.t_first is not None else t
            ttft_ms = (first_s - req.arrival_s) * 1e3
            tpot_ms = None
            if req.generated > 1 and req.t_first is not None:
                tpot_ms = (t - req.t_first) * 1e3 / (req.generated - 1)
            good = meets_slo(ttft_ms, tpot_ms, self.ttft_slo_ms, self.tpot_slo_ms)
            if req.t_first is None:
                req.train_at_first = self.train_ms_total
            alone = good or meets_slo_alone(
                ttft_ms, tpot_ms, req.generated - 1, req.train_at_first - req.train_at_arrival,
                self.train_ms_total - req.train_at_first, self.ttft_slo_ms, self.tpot_slo_ms,
            )  # fmt: skip
            self.window.add(FinishedSample(t, ttft_ms, tpot_ms, good, alone))
        elif status == "timeout":  # as the engine: dropped from the queue at its deadline, a miss
            self.window.add(FinishedSample(t, None, None, False))
        self.on_finish(req)

    def expire(self, now: float) -> None:
        """Drop the waiting requests past their deadline."""
        w = self.waiting
        limit = now - self.request_timeout_s
        while w and w[0].arrival_s < limit:
            self.finish(w.popleft(), now, "timeout")
