"""The iteration-level batch scheduler (pure: no torch, no clock, no threads).

vLLM's schedule -> execute -> update loop: every iteration this policy decides which sequences run, how
many tokens each brings, which waiting sequences are admitted and which running ones are preempted.
Guarantees:

* every running sequence that is decoding gets its next token each iteration when the KV pool allows
  (decodes first, oldest first), so a long prompt never stalls running decodes: prompts are cut into
  chunks of at most `prefill_chunk_tokens`, and an iteration never exceeds `max_batch_tokens` (decode
  tokens plus prefill chunks);
* the KV cache is paged (`kv_blocks.BlockManager`): with `kv_admission="paged"` (the default) a sequence
  is admitted when the pool has the blocks its first chunk needs now (plus a small watermark), and it
  takes more blocks as it grows. When the pool runs out, the running sequence that needs a block
  preempts others chosen by `victim` (the latest arrival first, as vLLM does), never one already
  scheduled this iteration; a preempted sequence loses its blocks and returns to the front of the queue
  to recompute its prompt and the tokens it generated (its output so far is kept, so its greedy output is
  unchanged). The oldest running sequence can always proceed, because every request fits the pool alone
  (the engine refuses larger ones), so the plan never deadlocks. Nothing is admitted in an iteration
  that preempted or left a sequence waiting for blocks;
* with `kv_admission="reserve"` the whole sequence (prompt + max_tokens) is reserved at admission
  (`kv_reserve`, in tokens rounded up to whole blocks) and nothing is ever preempted: the baseline the
  paged policy is measured against;
* admission is FCFS from the waiting queue while the running batch has room (`max_batch`); the queue
  itself is bounded by the caller (`max_queue`, refused with 429 before it gets here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from collm_replica.kv_blocks import blocks_for

KvAdmission = Literal["paged", "reserve"]


@dataclass(frozen=True)
class BatchConfig:
    max_batch: int = 16
    max_batch_tokens: int = 256
    prefill_chunk_tokens: int = 128
    kv_budget_tokens: int = 32768  # the pool: kv_budget_tokens // block_size blocks
    block_size: int = 16
    kv_admission: KvAdmission = "paged"
    watermark_frac: float = 0.01  # paged admission leaves this share of the pool free for growth

    def __post_init__(self) -> None:
        if min(self.max_batch, self.max_batch_tokens, self.prefill_chunk_tokens, self.kv_budget_tokens) < 1:
            raise ValueError("batch sizes must be >= 1")
        if self.block_size < 1 or self.kv_budget_tokens < self.block_size:
            raise ValueError("block_size must be >= 1 and the KV budget at least one block")
        if self.kv_admission not in ("paged", "reserve"):
            raise ValueError(f"kv_admission must be 'paged' or 'reserve', not {self.kv_admission!r}")

    @property
    def num_blocks(self) -> int:
        return self.kv_budget_tokens // self.block_size

    @property
    def watermark_blocks(self) -> int:
        return max(1, int(self.num_blocks * self.watermark_frac)) if self.num_blocks > 1 else 0

    def reserve_tokens(self, tokens: int) -> int:
        """A reservation of `tokens` tokens in whole blocks (reserve admission)."""
        return blocks_for(tokens, self.block_size) * self.block_size


@dataclass(frozen=True)
class SeqView:
    """What the scheduler knows of one sequence."""

    seq_id: str
    prompt_len: int
    computed: int  # tokens already in the KV cache
    kv_reserve: int = 0  # reserve admission: KV tokens reserved for the whole sequence
    ready: bool = True  # False while its adapter version is not resident yet
    output_len: int = 0  # tokens generated so far (recomputed with the prompt after a preemption)
    blocks_held: int = 0  # blocks of the KV pool the sequence holds

    @property
    def pending(self) -> int:
        """Known tokens not yet in the KV cache (at least the one a decode feeds)."""
        return max(1, self.prompt_len + self.output_len - self.computed)

    @property
    def prefilling(self) -> bool:
        return self.prompt_len + self.output_len - self.computed > 1


@dataclass
class Plan:
    admitted: list[str] = field(default_factory=list)
    items: list[tuple[str, int]] = field(default_factory=list)  # (seq_id, tokens this iteration)
    preempted: list[str] = field(default_factory=list)  # running sequences that lose their blocks

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.items)

    @property
    def decode_tokens(self) -> int:
        return sum(1 for _, n in self.items if n == 1)


Victim = Callable[[Sequence[SeqView]], SeqView]


def latest_arrival(candidates: Sequence[SeqView]) -> SeqView:
    """The preemption victim: the candidate that arrived last (candidates are in arrival order)."""
    return candidates[-1]


def plan_iteration(
    cfg: BatchConfig,
    running: list[SeqView],
    waiting: list[SeqView],
    kv_reserved: int = 0,
    free_blocks: int | None = None,
    victim: Victim = latest_arrival,
) -> Plan:
    """The work of one iteration. `running` and `waiting` are in arrival order (preempted sequences at
    the front of `waiting`); `kv_reserved` is the running sequences' reservations (reserve admission),
    `free_blocks` the pool's free blocks (paged admission; None: the whole pool less what running
    sequences hold)."""
    if cfg.kv_admission == "reserve":
        return _plan_reserved(cfg, running, waiting, kv_reserved)
    if free_blocks is None:
        free_blocks = cfg.num_blocks - sum(s.blocks_held for s in running)
    plan = Plan()
    budget = cfg.max_batch_tokens
    free = free_blocks
    alive = list(running)
    scheduled: set[str] = set()
    stalled = False

    def take(s: SeqView, n: int) -> bool:
        """Schedule `n` tokens of `s`, preempting later unscheduled sequences for its blocks."""
        nonlocal free, stalled
        need = blocks_for(s.computed + n, cfg.block_size) - s.blocks_held
        while need > free:
            others = [r for r in alive if r.seq_id not in scheduled and r.seq_id != s.seq_id]
            if not others:
                stalled = True  # it waits, keeping its blocks, for sequences ahead of it to finish
                return False
            out = victim(others)
            alive.remove(out)
            plan.preempted.append(out.seq_id)
            free += out.blocks_held
        free -= need
        scheduled.add(s.seq_id)
        plan.items.append((s.seq_id, n))
        return True

    # 1. Decodes first, oldest first: one token per decoding sequence.
    for s in list(alive):
        if budget > 0 and s in alive and not s.prefilling and take(s, 1):
            budget -= 1
    # 2. Prefill (or recompute) chunks of sequences already running, oldest first.
    for s in list(alive):
        if budget > 0 and s in alive and s.prefilling:
            n = min(s.pending, cfg.prefill_chunk_tokens, budget)
            if take(s, n):
                budget -= n
    if plan.preempted or stalled:
        return plan
    # 3. Admit waiting sequences FCFS while the batch, the token budget and the pool have room.
    n_running = len(alive)
    for s in waiting:
        if budget <= 0 or n_running >= cfg.max_batch:
            break
        if not s.ready:
            continue  # its adapter is being fetched; others may go ahead of it
        n = min(s.pending, cfg.prefill_chunk_tokens, budget)
        need = blocks_for(s.computed + n, cfg.block_size) - s.blocks_held
        if need + cfg.watermark_blocks > free:
            break  # FCFS: do not let small requests starve a large one forever
        plan.admitted.append(s.seq_id)
        plan.items.append((s.seq_id, n))
        budget -= n
        free -= need
        n_running += 1
    return plan


def _plan_reserved(
    cfg: BatchConfig, running: list[SeqView], waiting: list[SeqView], kv_reserved: int
) -> Plan:
    """Reserve admission: the whole sequence's KV is reserved at admission, nothing is preempted."""
    plan = Plan()
    budget = cfg.max_batch_tokens
    for s in running:
        if not s.prefilling and budget > 0:
            plan.items.append((s.seq_id, 1))
            budget -= 1
    for s in running:
        if s.prefilling and budget > 0:
            n = min(s.pending, cfg.prefill_chunk_tokens, budget)
            plan.items.append((s.seq_id, n))
            budget -= n
    n_running = len(running)
    for s in waiting:
        if budget <= 0 or n_running >= cfg.max_batch:
            break
        if not s.ready:
            continue
        if kv_reserved + s.kv_reserve > cfg.kv_budget_tokens:
            break
        n = min(s.pending, cfg.prefill_chunk_tokens, budget)
        plan.admitted.append(s.seq_id)
        plan.items.append((s.seq_id, n))
        budget -= n
        kv_reserved += s.kv_reserve
        n_running += 1
    return plan
