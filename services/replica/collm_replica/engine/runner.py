"""The model runner: runs one planned step of sequences through the executor.

`ModelRunner.run` turns each sequence's share of the step (its next known tokens) into the executor's
`ForwardItem`s, runs the ragged multi-adapter forward and feeds the step's cost to the cost model
(`costs.StepCosts`). It changes no sequence: the scheduler advances them and the engine samples from
the logits it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from collm_replica.costs import StepCosts
from collm_replica.engine.executor import Executor, ForwardItem
from collm_replica.engine.sequence import Seq


@dataclass(frozen=True)
class StepOutput:
    """One forward of the step: per item, the logits of its last token, and what the step log records
    of it (`t_s`: the engine's clock when it started; `prefill`: (tokens, earlier tokens) of each
    prefill chunk; `decode_context_tokens`: the context before the decoding sequences' new tokens;
    `adapters`: the distinct adapter slots it ran)."""

    logits: list[torch.Tensor]
    t_s: float
    forward_ms: float
    decodes: int
    decode_context_tokens: int
    prefill: list[tuple[int, int]]
    adapters: int


class ModelRunner:
    """Runs the planned steps on `executor` (see the module doc). Counters: `forward_ms_total`, the
    forward passes' wall time; `prefill_tokens_total`, the prefill (and recompute) tokens of client
    requests (the replica's own left out)."""

    def __init__(self, executor: Executor, step_costs: StepCosts, clock: Callable[[], float]) -> None:
        self.executor = executor
        self.step_costs = step_costs
        self.clock = clock
        self.forward_ms_total = 0.0
        self.prefill_tokens_total = 0

    def run(self, work: list[tuple[Seq, int]]) -> StepOutput:
        """The forward of `work` (each sequence, holding its KV blocks, with the number of its next known
        tokens to compute), in the order given."""
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
        return StepOutput(
            logits=logits,
            t_s=t_clock,
            forward_ms=ms,
            decodes=len(work) - len(chunks),
            decode_context_tokens=decode_context,
            prefill=chunks,
            adapters=len({seq.slot for seq, _ in work if seq.slot >= 0}),
        )
