"""Co-executed LoRA fine-tuning: local jobs cut into micro-steps that fit between inference iterations.

A `TrainingJob` trains the *live* copy of one adapter (a `LiveLora` with its own AdamW state) on the
replica's local examples, rendered through the chat template with the loss on response tokens only.
`step(max_tokens)` does one bounded piece of work: a training micro-step of at most `max_tokens` tokens
(gradients accumulate until an optimizer step's worth of tokens, `train_batch_tokens`), or one chunk of a
held-out evaluation. The engine calls it between iterations when its co-scheduler allows.

Phases: (round jobs) evaluate the start weights -> train until the token budget (or the round's deadline)
-> evaluate the result -> done. Every `publish_every_steps` optimizer steps the live copy is evaluated and
the job offers it for a local shadow refresh when its held-out loss improved. A job never writes the bank:
the engine copies `live.snapshot()` into a new slot, so served versions stay immutable.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from collm_common.data import Example

from collm_replica.executor import Executor
from collm_replica.lora_bank import LiveLora


@dataclass(frozen=True)
class Rendered:
    example_id: str
    domain: str
    ids: list[int]
    labels: list[int]  # -100 on prompt tokens

    @property
    def response_tokens(self) -> int:
        return sum(1 for x in self.labels if x != -100)


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
    """Examples from `start` (cyclic) whose padded size fits `max_tokens`; at least one, cut to fit."""
    batch: list[Rendered] = []
    i = start
    longest = 0
    while len(batch) < len(items):
        r = items[i % len(items)]
        size = max(longest, len(r.ids)) * (len(batch) + 1)
        if batch and size > max_tokens:
            break
        if not batch and len(r.ids) > max_tokens:
            r = cut(r, max_tokens)
        batch.append(r)
        longest = max(longest, len(r.ids))
        i += 1
    return batch, i


@dataclass
class EvalRun:
    """A held-out evaluation done in chunks: per domain, the mean response-token loss of `weights`."""

    items: list[Rendered]
    live: LiveLora | None
    chunk_tokens: int
    pos: int = 0
    loss_sum: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    examples: dict[str, int] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.pos >= len(self.items)

    def step(self, executor: Executor, pad_id: int, max_tokens: int | None = None) -> int:
        """Evaluate the next whole examples that fit `max_tokens` (at least one; never cut)."""
        if self.done:
            return 0
        budget = min(self.chunk_tokens, max_tokens or self.chunk_tokens)
        batch: list[Rendered] = []
        longest = 0
        while self.pos < len(self.items):
            r = self.items[self.pos]
            if batch and max(longest, len(r.ids)) * (len(batch) + 1) > budget:
                break
            batch.append(r)
            longest = max(longest, len(r.ids))
            self.pos += 1
        ids, mask, labels = collate(batch, pad_id)
        with torch.no_grad():
            logits = executor.train_forward(ids, mask, self.live)
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        tgt = labels[:, 1:]
        valid = tgt != -100
        nll = -logp.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
        for i, r in enumerate(batch):
            self.loss_sum[r.domain] = self.loss_sum.get(r.domain, 0.0) + float(nll[i].sum())
            self.tokens[r.domain] = self.tokens.get(r.domain, 0) + int(valid[i].sum())
            self.examples[r.domain] = self.examples.get(r.domain, 0) + 1
        return int(ids.numel())

    def run_all(self, executor: Executor, pad_id: int) -> EvalRun:
        while not self.done:
            self.step(executor, pad_id)
        return self

    def per_domain(self) -> dict[str, float]:
        return {d: self.loss_sum[d] / self.tokens[d] for d in self.loss_sum if self.tokens[d] > 0}

    def mean(self) -> float | None:
        n = sum(self.tokens.values())
        return sum(self.loss_sum.values()) / n if n else None


@dataclass
class JobConfig:
    micro_tokens: int = 64
    batch_tokens: int = 512
    max_seq_len: int = 256
    publish_every_steps: int = 4
    eval_max_examples: int = 32
    eval_chunk_tokens: int = 256
    seed: int = 0


@dataclass
class JobSpec:
    adapter: str
    base_version_id: str  # e.g. "medical@v3" (the version the live copy started from)
    base_version: int | None
    live: LiveLora
    token_budget: int
    learning_rate: float = 2e-4
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
    ) -> None:
        self.spec = spec
        self.ex = executor
        self.cfg = cfg
        self.wall = wall
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.train_items = [
            r for e in train if (r := render_example(tokenizer, e, cfg.max_seq_len)) is not None
        ]
        self.eval_items = [
            r
            for e in held_out[: cfg.eval_max_examples]
            if (r := render_example(tokenizer, e, cfg.max_seq_len))
        ]
        random.Random(cfg.seed).shuffle(self.train_items)
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
        self._eval: EvalRun | None = None
        self._eval_purpose = ""
        self.last_kind = ""  # what the last step did: "train" (a micro-step) or "eval" (an eval chunk)
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

    def _start_eval(self, purpose: str) -> None:
        self._eval = EvalRun(self.eval_items, self.live, self.cfg.eval_chunk_tokens)
        self._eval_purpose = purpose

    def _budget_left(self) -> int:
        return self.spec.token_budget - self.tokens_done

    def _past_deadline(self, margin_s: float) -> bool:
        d = self.spec.deadline_unix_s
        return d is not None and self.wall() >= d - margin_s

    def _finish_training(self, past_deadline: bool = False) -> None:
        if self._accum_tokens:
            self._optimizer_step()
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
    def step(self, max_tokens: int, deadline_margin_s: float = 0.0) -> int:
        """One micro-step or one eval chunk; returns tokens processed (0 when there was nothing to do)."""
        if not self.active:
            return 0
        self.last_kind = "eval"
        if self._eval is not None:
            if self._past_deadline(deadline_margin_s):
                if self._eval_purpose == "after":
                    self._eval = None
                    self._complete()
                else:
                    self._finish_training(past_deadline=True)
                return 0
            n = self._eval.step(self.ex, self.pad_id, max_tokens)
            if self._eval.done:
                self._eval_finished()
            return n
        if self._past_deadline(deadline_margin_s):
            self._finish_training(past_deadline=True)
            return 0
        if self._budget_left() <= 0:
            self._finish_training()
            return 0
        self.last_kind = "train"
        return self._micro_step(min(max_tokens, self._budget_left() + self.cfg.max_seq_len))

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

    def _micro_step(self, max_tokens: int) -> int:
        batch, self._cursor = pack(self.train_items, self._cursor, max(8, max_tokens))
        ids, mask, labels = collate(batch, self.pad_id)
        loss_sum, n_resp = self.ex.response_loss(ids, mask, labels, self.live)
        if n_resp == 0:
            return int(mask.sum())
        (loss_sum / self.cfg.batch_tokens).backward()
        tokens = int(mask.sum())
        self.micro_steps += 1
        self.tokens_done += tokens
        self.samples_seen += len(batch)
        self._accum_tokens += tokens
        self._accum_loss += float(loss_sum.detach())
        self._accum_resp += n_resp
        if self._accum_tokens >= self.cfg.batch_tokens:
            self._optimizer_step()
        return int(ids.numel())

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
