"""The engine's sequences: `Seq`, one choice of a request from admission to its end, and `Group`, the
choices of one request. `SeqMaker` builds them with what every sequence needs (tokenizer, end-of-sequence
ids, settings, grammars).

A `Seq` carries the state every part of the engine reads: the scheduler's (`computed`, `kv`, `hit`,
`chain`), the sampler's (`sampler`, `constraint`, `output`), the output processor's (`detok`, `stops`)
and the request's timings; each part changes only its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from collm_common.wire.inference import ChoiceFinish
from collm_replica.constrain import Constraint, Grammars
from collm_replica.engine.executor import SeqKV
from collm_replica.engine.prefix_cache import NO_HIT, BlockChain, PrefixHit
from collm_replica.engine.scheduler import BatchConfig, RequestView, SeqView
from collm_replica.engine.types import EngineConfig, EngineRequest, EventSink
from collm_replica.sampling import IncrementalDetokenizer, Sampler, StopMatcher, TokenLogprobs, token_logprobs


class Group:
    """The choices of one request: choice 0 prefills the prompt, the other `n - 1` fork from it at its
    first token. They share one numbering of chunks, and one `Finished` goes out once all have ended."""

    __slots__ = ("n", "seqs", "chunk_seq", "ends", "forked", "failed")

    def __init__(self, n: int) -> None:
        self.n = n
        self.seqs: list[Seq] = []
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


class Seq:
    """One choice of a request (see the module doc); `id` is the request id for choice 0 and
    `request_id/index` for the others."""

    __slots__ = (
        "req", "sink", "version_id", "slot", "prompt_len", "computed", "output", "kv", "reserve", "sampler",
        "detok", "stops", "t_arrival", "t_admit", "t_first", "t_last", "ttft_slo", "tpot_slo",
        "done", "eos", "id", "index", "group", "constraint", "chain", "hit", "train_ms_arrival",
        "train_ms_first",
    )  # fmt: skip

    def __init__(self, req: EngineRequest, sink: EventSink, version_id: str, slot: int, tokenizer: Any,
                 eos: set[int], cfg: EngineConfig, now: float, vocab_size: int,
                 index: int = 0, group: Group | None = None,
                 constraint: Constraint | None = None) -> None:  # fmt: skip
        self.req = req
        self.constraint = constraint
        self.index = index
        self.id = req.request_id if index == 0 else f"{req.request_id}/{index}"
        self.group = group or Group(req.n)
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
        # The replica's training so far (ms, `Training.train_ms_total`) when the engine took the request
        # in and at its first token: what it trained while the request was in flight (`meets_slo_alone`).
        self.train_ms_arrival = 0.0
        self.train_ms_first: float | None = None
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

    def sample(self, logits: torch.Tensor) -> tuple[int, TokenLogprobs | None]:
        """The next token from the last-position `logits` (shared by a request's choices at a fork:
        never changed in place): penalties, then the grammar's mask, then sampling; the sampler and the
        grammar advance past it. With the token, its logprobs when the request asks for them."""
        processed = self.sampler.process(logits)
        if self.constraint is not None:
            processed = self.constraint.mask(processed)
        tok = self.sampler.pick(processed)
        self.sampler.observe(tok)
        if self.constraint is not None:
            self.constraint.advance(tok)
        return tok, None if self.req.logprobs is None else token_logprobs(logits, tok, self.req.logprobs)

    def record(self, tok: int, now: float) -> None:
        """Append the sampled token `tok` to the output, at `now` (the first one is the TTFT's end)."""
        if self.t_first is None:
            self.t_first = now
            if self.req.span is not None:
                self.req.span.add_event("first_token", {"ttft_ms": (now - self.t_arrival) * 1e3})
        self.t_last = now
        self.output.append(tok)

    def completion_tokens(self) -> int:
        """Output tokens, end-of-sequence tokens not counted."""
        return sum(1 for t in self.output if t not in self.eos)


@dataclass
class SeqMaker:
    """Builds the sequences of admitted requests and of their forked choices (`eos_ids`: the
    end-of-sequence ids of those built from now on)."""

    tokenizer: Any
    eos_ids: set[int]
    cfg: EngineConfig
    vocab_size: int
    grammars: Grammars

    def __call__(
        self,
        req: EngineRequest,
        sink: EventSink,
        version_id: str,
        slot: int,
        now: float,
        index: int = 0,
        group: Group | None = None,
    ) -> Seq:
        """Choice `index` of `req` bound to `version_id` in LoRA slot `slot` (-1: the base model), arrived
        at `now`, in `group` (None: a new group), with the request's grammar constraint if it has one."""
        constraint = self.grammars.constraint(req.grammar) if req.grammar is not None else None
        return Seq(
            req, sink, version_id, slot, self.tokenizer, self.eos_ids, self.cfg, now, self.vocab_size,
            index=index, group=group, constraint=constraint,
        )  # fmt: skip
