"""The iteration-level batch scheduler (pure: no torch, no asyncio).

vLLM's schedule -> execute -> update loop: every iteration this policy decides which sequences run and how
many tokens each brings. Guarantees:

* every running sequence that is decoding gets its next token each iteration (decodes first), so a long
  prompt never stalls running decodes: prompts are cut into chunks of at most `prefill_chunk_tokens`, and
  an iteration never exceeds `max_batch_tokens` (decode tokens plus prefill chunks);
* admission is FCFS from the waiting queue while the running batch has room (`max_batch`) and the KV
  budget can hold the sequence's reservation (prompt + max_tokens, reserved whole at admission, so a
  running sequence never runs out of KV and nothing is ever preempted);
* the queue itself is bounded by the caller (`max_queue`, refused with 429 before it gets here).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BatchConfig:
    max_batch: int = 16
    max_batch_tokens: int = 256
    prefill_chunk_tokens: int = 128
    kv_budget_tokens: int = 32768

    def __post_init__(self) -> None:
        if min(self.max_batch, self.max_batch_tokens, self.prefill_chunk_tokens, self.kv_budget_tokens) < 1:
            raise ValueError("batch sizes must be >= 1")


@dataclass(frozen=True)
class SeqView:
    """What the scheduler knows of one sequence."""

    seq_id: str
    prompt_len: int
    computed: int  # tokens already in the KV cache
    kv_reserve: int  # tokens of KV reserved for the whole sequence (prompt + max_tokens)
    ready: bool = True  # False while its adapter version is not resident yet

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len


@dataclass
class Plan:
    admitted: list[str] = field(default_factory=list)
    items: list[tuple[str, int]] = field(default_factory=list)  # (seq_id, tokens this iteration)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.items)

    @property
    def decode_tokens(self) -> int:
        return sum(1 for _, n in self.items if n == 1)


def plan_iteration(
    cfg: BatchConfig, running: list[SeqView], waiting: list[SeqView], kv_reserved: int
) -> Plan:
    """The work of one iteration. `running` and `waiting` are in arrival order; `kv_reserved` is the sum
    of the running sequences' reservations."""
    plan = Plan()
    budget = cfg.max_batch_tokens
    # 1. Decodes first: one token per decoding sequence.
    for s in running:
        if not s.prefilling and budget > 0:
            plan.items.append((s.seq_id, 1))
            budget -= 1
    # 2. Prefill chunks of sequences already running, oldest first.
    for s in running:
        if s.prefilling and budget > 0:
            n = min(s.prompt_len - s.computed, cfg.prefill_chunk_tokens, budget)
            plan.items.append((s.seq_id, n))
            budget -= n
    # 3. Admit waiting sequences FCFS while there is room in the batch, the KV budget and the token budget.
    n_running = len(running)
    for s in waiting:
        if budget <= 0 or n_running >= cfg.max_batch:
            break
        if not s.ready:
            continue  # its adapter is being fetched; others may go ahead of it
        if kv_reserved + s.kv_reserve > cfg.kv_budget_tokens:
            break  # FCFS: do not let small requests starve a large one forever
        n = min(s.prompt_len - s.computed, cfg.prefill_chunk_tokens, budget)
        plan.admitted.append(s.seq_id)
        plan.items.append((s.seq_id, n))
        budget -= n
        kv_reserved += s.kv_reserve
        n_running += 1
    return plan
