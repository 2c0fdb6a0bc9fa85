"""Co-executed LoRA fine-tuning: local jobs whose work is cut into pieces that fit between iterations.

A `TrainingJob` trains the *live* copy of one adapter (a `LiveLora` with its own AdamW state) on the
replica's local examples, rendered once through the chat template with the loss on response tokens only.
A micro-step packs whole examples up to `micro_tokens` padded tokens (gradients accumulate until an
optimizer step's worth of tokens, `batch_tokens`), and runs as an `executor.LayerPass`: one decoder layer
forward, one LM-head chunk or one layer backward per *piece*. `work(until_s, ...)` runs pieces while the
cost model predicts that the next one ends before `until_s`, so a micro-step of any length (a long
example, a large micro-batch) fits whatever time the co-scheduler grants, and resumes at the next
iteration; an idle replica chains pieces back to back. `step(max_tokens)` runs one whole micro-step (or
evaluation chunk) at once, for benchmarks and tests.

Phases: a local job evaluates its start weights -> trains until its token budget -> evaluates the result
-> done; every `publish_every_steps` optimizer steps its live copy is evaluated and the job offers it for a
local shadow refresh when its held-out loss improved. A round job only trains, until its token budget or
the round's deadline: the aggregator's promotion gate scores the round's candidate against the current
version on the same held-out examples, so the job's own evaluations would repeat that work with the
replica's training time, and its update reports no losses of its own. A job never writes the bank:
the engine copies `live.snapshot()` into a new slot, so served versions stay immutable.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from collm_common.data import Example
from collm_replica.costs import PieceCosts
from collm_replica.engine.executor import Executor, LayerPass
from collm_replica.lora_bank import LiveLora

EVAL_HEAD_ROWS = 128
# An evaluation batch stops growing when padding would exceed this fraction of its tokens: on a CPU a
# batch of one example is as efficient per token as a larger one, and padded tokens cost as much as real
# ones (8 held-out examples batched to the longest one were 1.8-2.2x their real tokens).
EVAL_PAD_FRAC = 0.125
TRAIN_HEAD_ROWS = 128


@dataclass(frozen=True)
class Rendered:
    example_id: str
    domain: str
    ids: list[int]
    labels: list[int]  # -100 on prompt tokens


def render_example(
    tokenizer: Any, ex: Example, max_len: int, default_domain: str = "default"
) -> Rendered | None:
    """Chat-template the example; loss on the response (and its end-of-turn) only; None if nothing to learn.

    Long examples keep the end of the prompt and the start of the response within `max_len` tokens.
    """
    msgs = ex.messages()
    prompt_text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    full_text = tokenizer.apply_chat_template(
        [*msgs, {"role": "assistant", "content": ex.response}], tokenize=False
    )
    if full_text.startswith(prompt_text):
        p_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
        r_ids = tokenizer.encode(full_text[len(prompt_text) :], add_special_tokens=False)
    else:  # a template that rewrites earlier turns: fall back to prompt + response + EOS
        p_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
        r_ids = tokenizer.encode(ex.response, add_special_tokens=False) + [tokenizer.eos_token_id]
    r_ids = [t for t in r_ids if t is not None]
    if not r_ids or max_len < 2:
        return None
    keep_p = min(len(p_ids), max(max_len // 2, max_len - len(r_ids)))
    p_ids = p_ids[len(p_ids) - keep_p :] if keep_p else []
    r_ids = r_ids[: max_len - len(p_ids)]
    if not r_ids or not p_ids:
        return None
    return Rendered(ex.id, ex.domain or default_domain, p_ids + r_ids, [-100] * len(p_ids) + r_ids)


Renderer = Callable[[Example], Rendered | None]


def collate(batch: list[Rendered], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = max(len(r.ids) for r in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, : len(r.ids)] = torch.tensor(r.ids)
        mask[i, : len(r.ids)] = 1
        labels[i, : len(r.labels)] = torch.tensor(r.labels)
    return ids, mask, labels


def cut(r: Rendered, n: int) -> Rendered:
    """A window of `n` tokens that keeps the end of the prompt and the start of the response."""
    p = next((i for i, x in enumerate(r.labels) if x != -100), len(r.labels))
    keep_p = min(p, max(n // 2, n - (len(r.ids) - p)))
    start = p - keep_p
    return Rendered(r.example_id, r.domain, r.ids[start : start + n], r.labels[start : start + n])


def pack(items: list[Rendered], start: int, max_tokens: int) -> tuple[list[Rendered], int]:
    """Whole examples from `start` (cyclic) whose padded size fits `max_tokens`; at least one.

    An example longer than `max_tokens` is a micro-step of its own, never cut: the micro-step runs in
    pieces, so its length only costs memory (bounded by the rendering's `max_seq_len`), not latency."""
    batch: list[Rendered] = []
    i = start
    longest = 0
    while len(batch) < len(items):
        r = items[i % len(items)]
        size = max(longest, len(r.ids)) * (len(batch) + 1)
        if batch and size > max_tokens:
            break
        batch.append(r)
        longest = max(longest, len(r.ids))
        i += 1
    return batch, i


def eval_set_digests(items: list[Rendered], max_seq_len: int, precision: str = "") -> dict[str, str]:
    """Per domain, a digest of exactly what an evaluation scores (example ids, token ids, labels) and how
    (`precision`, "" for the model's own dtype): two losses with the same digest were measured on the
    same tokens the same way, so they may be compared."""
    seed = f"max_seq_len={max_seq_len};" + (f"precision={precision};" if precision else "")
    hashes: dict[str, Any] = {}
    for r in items:
        h = hashes.setdefault(r.domain, hashlib.sha256(seed.encode()))
        h.update(r.example_id.encode())
        h.update(b"\0")
        h.update(",".join(map(str, r.ids)).encode())
        h.update(b"|")
        h.update(",".join(map(str, r.labels)).encode())
        h.update(b";")
    return {d: h.hexdigest()[:32] for d, h in hashes.items()}


def select_eval_items(items: list[Rendered], max_examples: int, max_tokens: int | None) -> list[Rendered]:
    """The held-out items an evaluation scores: in order, at most `max_examples` per domain, and (when
    set) at most `max_tokens` tokens per domain (at least one example each). Deterministic, so two
    evaluations of the same data score the same items."""
    out: list[Rendered] = []
    count: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for r in items:
        n, t = count.get(r.domain, 0), tokens.get(r.domain, 0)
        if n >= max_examples:
            continue
        if max_tokens is not None and n > 0 and t + len(r.ids) > max_tokens:
            continue
        out.append(r)
        count[r.domain] = n + 1
        tokens[r.domain] = t + len(r.ids)
    return out


@dataclass
class PieceWork:
    """What a bounded piece of background work did."""

    pieces: int = 0
    train_ms: float = 0.0  # wall time of training pieces (forward, head, backward, optimizer)
    eval_ms: float = 0.0  # wall time of evaluation pieces
    train_tokens: int = 0  # tokens of micro-steps completed
    eval_tokens: int = 0  # tokens of evaluation batches completed
    micro_steps: list[tuple[int, float]] = field(default_factory=list)  # (tokens, ms) of completed ones

    @property
    def did_work(self) -> bool:
        """Anything ran: a piece, or a job's wrap-up at its end (which runs no piece of its own: the rest
        of a micro-step and the last optimizer step, `TrainingJob._finish_training`)."""
        return self.pieces > 0 or self.train_ms > 0 or self.eval_ms > 0 or bool(self.micro_steps)


def _run_timed(kind: str, units: int, fn: Callable[[], Any], costs: PieceCosts | None) -> float:
    t0 = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t0) * 1e3
    if costs is not None:
        costs.observe(kind, units, ms)
    return ms


@dataclass
class EvalRun:
    """A held-out evaluation in pieces: per domain, the mean response-token loss of `live` (None: the
    base model) over `items`. Batches of whole examples (up to `chunk_tokens` padded tokens, longest
    first, with at most `EVAL_PAD_FRAC` padding) run as no-grad `LayerPass`es."""

    items: list[Rendered]
    live: LiveLora | None
    chunk_tokens: int
    pos: int = 0
    loss_sum: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    examples: dict[str, int] = field(default_factory=dict)
    eval_set: dict[str, str] = field(default_factory=dict)  # per domain: digest of the items scored
    # Per domain, per example id: (summed response-token loss in nats, response tokens): the promotion
    # gate pairs two versions example by example (`EvalRun.example_losses`).
    by_example: dict[str, dict[str, tuple[float, int]]] = field(default_factory=dict)
    cache_key: tuple[str, str] | None = None  # (weights digest, eval set) when the engine caches it
    _pass: LayerPass | None = None
    _batch: list[Rendered] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Longest first: examples of similar length share a batch (less padding); losses are per example,
        # so the order changes nothing but speed.
        self._order = sorted(self.items, key=lambda r: -len(r.ids))

    @property
    def done(self) -> bool:
        return self.pos >= len(self._order) and self._pass is None

    @property
    def progress(self) -> float:
        """Share of the evaluation done, by tokens: whole batches scored, and the batch in progress by the
        share of the decoder layers its forward has passed."""
        total = sum(len(r.ids) for r in self._order)
        if total == 0 or self.done:
            return 1.0
        taken = sum(len(r.ids) for r in self._order[: self.pos])
        current = sum(len(r.ids) for r in self._batch) if self._pass is not None else 0
        frac = self._pass.forward_frac if self._pass is not None else 0.0
        return (taken - current + current * frac) / total

    def _start(self, executor: Executor, pad_id: int, max_tokens: int | None = None) -> None:
        budget = min(self.chunk_tokens, max_tokens or self.chunk_tokens)
        batch: list[Rendered] = []
        longest = real = 0
        while self.pos < len(self._order):
            r = self._order[self.pos]
            padded = max(longest, len(r.ids)) * (len(batch) + 1)
            if batch and (padded > budget or padded - real - len(r.ids) > EVAL_PAD_FRAC * padded):
                break
            batch.append(r)
            longest = max(longest, len(r.ids))
            real += len(r.ids)
            self.pos += 1
        ids, mask, labels = collate(batch, pad_id)
        self._batch = batch
        self._pass = LayerPass(
            executor, ids, mask, labels, self.live, train=False, head_rows=EVAL_HEAD_ROWS,
            fast=bool(executor.eval_precision),
        )  # fmt: skip

    def next_piece(self, executor: Executor, pad_id: int) -> tuple[str, int] | None:
        """(cost-model kind, units) of the next piece, starting the next batch if needed."""
        if self._pass is None:
            if self.pos >= len(self._order):
                return None
            self._start(executor, pad_id)
        assert self._pass is not None
        kind = self._pass.next_piece
        if kind is None:
            return ("eval_head", 0)  # a batch without labels: finishing it costs nothing
        return ("eval_" + kind, self._pass.next_units())

    def run_piece(
        self, executor: Executor, pad_id: int, costs: PieceCosts | None = None
    ) -> tuple[float, int]:
        """Run the next piece; returns (ms, tokens of a batch it completed)."""
        nxt = self.next_piece(executor, pad_id)
        if nxt is None:
            return 0.0, 0
        p = self._pass
        assert p is not None
        ms = _run_timed(nxt[0], nxt[1], p.run_piece, costs) if p.next_piece is not None else 0.0
        if p.done:
            self._account(p)
            return ms, p.tokens
        return ms, 0

    def _account(self, p: LayerPass) -> None:
        for i, r in enumerate(self._batch):
            self.loss_sum[r.domain] = self.loss_sum.get(r.domain, 0.0) + float(p.example_loss[i])
            self.tokens[r.domain] = self.tokens.get(r.domain, 0) + int(p.example_labels[i])
            self.examples[r.domain] = self.examples.get(r.domain, 0) + 1
            self.by_example.setdefault(r.domain, {})[r.example_id] = (
                float(p.example_loss[i]),
                int(p.example_labels[i]),
            )
        self._pass = None
        self._batch = []

    def step(self, executor: Executor, pad_id: int, max_tokens: int | None = None) -> int:
        """Evaluate the next batch of whole examples at once (at least one; never cut)."""
        if self.done:
            return 0
        if self._pass is None:
            self._start(executor, pad_id, max_tokens)
        p = self._pass
        assert p is not None
        p.run_all()
        self._account(p)
        return p.padded_tokens

    def run_all(self, executor: Executor, pad_id: int) -> EvalRun:
        while not self.done:
            self.step(executor, pad_id)
        return self

    def per_domain(self) -> dict[str, float]:
        return {d: self.loss_sum[d] / self.tokens[d] for d in self.loss_sum if self.tokens[d] > 0}

    def example_losses(self, domain: str) -> tuple[list[float], list[int]]:
        """The domain's per-example summed losses (nats) and response tokens, ordered by example id: the
        same order for every version scored on the same eval set, so two runs pair element by element."""
        rows = sorted(self.by_example.get(domain, {}).items())
        return [loss for _, (loss, _) in rows], [n for _, (_, n) in rows]

    def mean(self) -> float | None:
        n = sum(self.tokens.values())
        return sum(self.loss_sum.values()) / n if n else None


@dataclass
class JobConfig:
    micro_tokens: int = 128
    batch_tokens: int = 512
    max_seq_len: int = 256
    publish_every_steps: int = 4
    eval_max_examples: int = 32
    eval_chunk_tokens: int = 512
    seed: int = 0


@dataclass
class JobSpec:
    adapter: str
    base_version_id: str  # e.g. "medical@v3" (the version the live copy started from)
    base_version: int | None
    live: LiveLora
    token_budget: int
    learning_rate: float = 1e-3
    round_id: int | None = None
    deadline_unix_s: float | None = None


class TrainingJob:
    """One adapter's local job (see module docstring). Runs only in the engine thread."""

    def __init__(
        self,
        spec: JobSpec,
        executor: Executor,
        tokenizer: Any,
        train: list[Example],
        held_out: list[Example],
        cfg: JobConfig,
        wall: Callable[[], float] = time.time,
        render: Renderer | None = None,
    ) -> None:
        self.spec = spec
        self.ex = executor
        self.cfg = cfg
        self.wall = wall
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        rend = render or (lambda e: render_example(tokenizer, e, cfg.max_seq_len))
        self.train_items = [r for e in train if (r := rend(e)) is not None]
        # A round job evaluates nothing itself (module docstring).
        held = held_out[: cfg.eval_max_examples] if spec.round_id is None else []
        self.eval_items = [r for e in held if (r := rend(e)) is not None]
        # Each job its own order of the local examples (a round trains a few hundred tokens: with one
        # order every round of an adapter would train the same first examples, and a round repeated from
        # a held-back candidate's base would train the very same candidate again).
        order = f"{cfg.seed}:{spec.adapter}:{spec.base_version_id}:{spec.round_id}"
        random.Random(order).shuffle(self.train_items)
        self.live = spec.live
        self.opt = torch.optim.AdamW(self.live.parameters(), lr=spec.learning_rate, weight_decay=0.0)
        self.state = "running"
        self.message = ""
        self.tokens_done = 0
        self.samples_seen = 0
        self.steps_done = 0
        self.micro_steps = 0
        self._accum_tokens = 0
        self._accum_loss = 0.0
        self._accum_resp = 0
        self._cursor = 0
        self.train_loss: float | None = None
        self.eval_loss: float | None = None
        self.eval_loss_before: float | None = None
        self.eval_loss_after: float | None = None  # the final evaluation of a finished job
        self.best_eval: float | None = None
        self.refreshes = 0
        self.slot_wait_since: float | None = None  # a local refresh is waiting for a LoRA-bank slot
        self._eval: EvalRun | None = None
        self._eval_purpose = ""
        self._pass: LayerPass | None = None  # the micro-step in progress
        self._pass_batch: list[Rendered] = []
        self._pass_ms = 0.0
        self._wrap_up = PieceWork()  # work of `_finish_training` not yet reported by `work`
        self._wrap_up_bound: tuple[PieceCosts | None, float] = (None, math.inf)
        self._opt_pending = False
        self.pending_refresh = False  # the engine should copy the live weights into a new shadow version
        self.finished_update = False  # a round job finished: the engine hands its weights to the service
        if not self.train_items:
            self.state = "failed"
            self.message = "no local training examples for this adapter"
        elif self.eval_items:
            self._start_eval("before")  # the baseline a later shadow refresh must beat

    # --- status ---------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.state == "running"

    @property
    def in_progress(self) -> bool:
        """A micro-step or an evaluation is half done (the engine keeps feeding this job first)."""
        return self._pass is not None or (self._eval is not None and self._eval._pass is not None)

    def _start_eval(self, purpose: str) -> None:
        self._eval = EvalRun(self.eval_items, self.live, self.cfg.eval_chunk_tokens)
        self._eval_purpose = purpose

    def due(self, deadline_margin_s: float) -> bool:
        """A round job whose deadline (less the margin) has passed: it must wrap up and send its update."""
        return self.active and self._past_deadline(deadline_margin_s)

    def _budget_left(self) -> int:
        return self.spec.token_budget - self.tokens_done

    def _past_deadline(self, margin_s: float) -> bool:
        d = self.spec.deadline_unix_s
        return d is not None and self.wall() >= d - margin_s

    def _drop_pass(self) -> None:
        """Abandon the micro-step in progress. Only before its backward began: parameter gradients
        accumulate during the backward pieces only, so a dropped pass leaves no partial gradient."""
        if self._pass is not None:
            self._pass.release()
        self._pass = None
        self._pass_batch = []
        self._pass_ms = 0.0

    def _finish_training(self, past_deadline: bool = False) -> None:
        """End training: complete the micro-step in progress when its backward began (its gradients are
        half accumulated) or, within the wrap-up bound (`work`), when it is the job's first (dropped, the
        job would send an update of no samples, which the aggregator rejects: the round would lose the
        work of its whole window), else drop it; then a last optimizer step. The work done here is
        reported to the next `work` call's `out`."""
        t0 = time.perf_counter()
        p = self._pass
        costs, bound_ms = self._wrap_up_bound
        first = self.micro_steps == 0 and (costs is None or p is None or p.remaining_ms(costs) <= bound_ms)
        if p is not None and (p.next_piece == "bwd" or first):
            p.run_all()
            tokens, ms = self._complete_micro_step(self._pass_ms + (time.perf_counter() - t0) * 1e3)
            self._wrap_up.train_tokens += tokens
            self._wrap_up.micro_steps.append((tokens, ms))
        self._drop_pass()
        if self._accum_tokens:
            self._optimizer_step()
        self._wrap_up.train_ms += (time.perf_counter() - t0) * 1e3
        self._opt_pending = False
        self._eval = None  # a periodic evaluation still running is superseded
        if self.eval_items and not past_deadline:
            self._start_eval("after")
        else:  # a round's deadline is near: send the update now, without the final evaluation
            self._complete()

    def _complete(self) -> None:
        self.state = "done"
        if self.spec.round_id is not None:
            self.finished_update = True

    # --- work -----------------------------------------------------------------------------------------
    def _next(self, deadline_margin_s: float, micro_tokens: int | None = None) -> tuple[str, int] | None:
        """Advance the job's state machine to its next piece of work: (cost kind, units), or None when
        the job has nothing more to do. Transitions that cost nothing happen here."""
        while self.active:
            if self._eval is not None:
                if self._past_deadline(deadline_margin_s):
                    if self._eval_purpose == "after":
                        self._eval = None
                        self._complete()
                    else:
                        self._finish_training(past_deadline=True)
                    continue
                nxt = self._eval.next_piece(self.ex, self.pad_id)
                if nxt is None:
                    self._eval_finished()
                    continue
                return nxt
            if self._past_deadline(deadline_margin_s):
                self._finish_training(past_deadline=True)
                continue
            if self._opt_pending:
                return ("opt", 1)
            if self._pass is None:
                if self._budget_left() <= 0:
                    self._finish_training()
                    continue
                self._start_micro_step(micro_tokens)
            assert self._pass is not None
            kind = self._pass.next_piece
            if kind is None:
                self._complete_micro_step(self._pass_ms)
                continue
            return (kind, self._pass.next_units())
        return None

    def _run_next(self, kind: str, units: int, costs: PieceCosts | None, out: PieceWork) -> None:
        if kind.startswith("eval_"):
            assert self._eval is not None
            ms, tokens = self._eval.run_piece(self.ex, self.pad_id, costs)
            out.eval_ms += ms
            out.eval_tokens += tokens
            if self._eval.done:
                self._eval_finished()
        elif kind == "opt":
            ms = _run_timed("opt", 1, self._optimizer_step, costs)
            self._opt_pending = False
            out.train_ms += ms
        else:
            assert self._pass is not None
            ms = _run_timed(kind, units, self._pass.run_piece, costs)
            self._pass_ms += ms
            out.train_ms += ms
            if self._pass.done:
                tokens, step_ms = self._complete_micro_step(self._pass_ms)
                out.train_tokens += tokens
                out.micro_steps.append((tokens, step_ms))
        out.pieces += 1

    def work(
        self,
        until_s: float,
        clock: Callable[[], float],
        costs: PieceCosts,
        force_one: bool = False,
        deadline_margin_s: float = 0.0,
        interrupt: Callable[[], bool] | None = None,
        out: PieceWork | None = None,
        yield_at_boundary: bool = False,
        wrap_up_ms: float = math.inf,
    ) -> PieceWork:
        """Run pieces while the next one is predicted to end by `until_s` (on `clock`) and `interrupt()`
        (new requests or commands waiting) is false; with `force_one`, at least one piece whatever the
        prediction (an idle replica must always progress). With `yield_at_boundary` (other jobs are
        waiting), stop once a micro-step or evaluation batch is complete, so jobs take turns. `out` is
        updated piece by piece (others may read it meanwhile). A round job at its deadline completes
        its first micro-step only when the rest is predicted within `wrap_up_ms` (the stall an arrival
        can absorb)."""
        out = out if out is not None else PieceWork()
        self._wrap_up_bound = (costs, wrap_up_ms)
        while True:
            nxt = self._next(deadline_margin_s)
            self._report_wrap_up(out)
            if nxt is None:
                break
            kind, units = nxt
            first = force_one and out.pieces == 0
            if not first and (
                clock() + costs.predict(kind, units) / 1e3 > until_s
                or (interrupt is not None and interrupt())
            ):
                break
            self._run_next(kind, units, costs, out)
            if yield_at_boundary and not self.in_progress:
                break
        return out

    def _report_wrap_up(self, out: PieceWork) -> None:
        w = self._wrap_up
        if w.train_ms or w.micro_steps:
            out.train_ms += w.train_ms
            out.train_tokens += w.train_tokens
            out.micro_steps.extend(w.micro_steps)
            self._wrap_up = PieceWork()

    def step(self, max_tokens: int, deadline_margin_s: float = 0.0) -> int:
        """One whole micro-step (of at most `max_tokens` padded tokens, at least one example) or one
        whole eval batch, at once; returns tokens processed (0 when there was nothing to do)."""
        while True:
            nxt = self._next(deadline_margin_s, max_tokens)
            if nxt is None:
                return 0
            if nxt[0].startswith("eval_"):
                assert self._eval is not None
                n = self._eval.step(self.ex, self.pad_id)
                if self._eval.done:
                    self._eval_finished()
                return n
            if nxt[0] == "opt":
                self._optimizer_step()
                self._opt_pending = False
                continue
            assert self._pass is not None
            t0 = time.perf_counter()
            self._pass.run_all()
            tokens, _ = self._complete_micro_step(self._pass_ms + (time.perf_counter() - t0) * 1e3)
            if self._opt_pending:
                self._optimizer_step()
                self._opt_pending = False
            return tokens

    def _eval_finished(self) -> None:
        assert self._eval is not None
        loss = self._eval.mean()
        purpose = self._eval_purpose
        self._eval = None
        if purpose == "before":
            self.eval_loss_before = loss
            self.best_eval = loss
        elif purpose == "after":
            self.eval_loss = self.eval_loss_after = loss
            self._complete()
        else:  # periodic: offer a shadow refresh when the held-out loss improved
            self.eval_loss = loss
            if loss is not None and (self.best_eval is None or loss < self.best_eval):
                self.best_eval = loss
                self.pending_refresh = True

    def _start_micro_step(self, max_tokens: int | None = None) -> None:
        size = max(8, min(max_tokens or self.cfg.micro_tokens, self._budget_left() + self.cfg.max_seq_len))
        batch, self._cursor = pack(self.train_items, self._cursor, size)
        ids, mask, labels = collate(batch, self.pad_id)
        self._pass = LayerPass(
            self.ex,
            ids,
            mask,
            labels,
            self.live,
            train=True,
            loss_scale=1.0 / self.cfg.batch_tokens,
            head_rows=TRAIN_HEAD_ROWS,
        )
        self._pass_batch = batch
        self._pass_ms = 0.0

    def _complete_micro_step(self, ms: float) -> tuple[int, float]:
        """Account a finished pass: (tokens, ms). Schedules the optimizer step when a batch is full."""
        p = self._pass
        assert p is not None
        tokens, n_resp = p.tokens, p.n_labels
        self._pass = None
        batch, self._pass_batch = self._pass_batch, []
        self._pass_ms = 0.0
        self.micro_steps += 1
        self.tokens_done += tokens
        if n_resp == 0:
            return tokens, ms
        self.samples_seen += len(batch)
        self._accum_tokens += tokens
        self._accum_loss += p.loss_sum
        self._accum_resp += n_resp
        if self._accum_tokens >= self.cfg.batch_tokens:
            self._opt_pending = True
        return tokens, ms

    def _optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps_done += 1
        self.train_loss = self._accum_loss / max(1, self._accum_resp)
        self._accum_loss = 0.0
        self._accum_tokens = 0
        self._accum_resp = 0
        if self.eval_items and self.steps_done % self.cfg.publish_every_steps == 0:
            self._start_eval("periodic")

    def stop(self) -> None:
        if self.state in ("running", "paused"):
            self.state = "stopped"
        self._drop_pass()
