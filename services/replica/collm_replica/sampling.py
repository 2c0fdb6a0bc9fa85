"""Turning logits into tokens and tokens into text.

* `Sampler`: one request's sampling, a pure pipeline over its last-position logits [V]:
  `process` (penalties and logit bias on the model's logits, then temperature, then min-p, top-k and top-p
  filtering, in vLLM's order) and `pick` (greedy at temperature 0, else a draw from the filtered
  distribution with the request's own `torch.Generator`, seeded when the request carries a seed, so a
  seeded request is reproducible whatever it is batched with). Definitions, as OpenAI and vLLM state them:
  - `presence_penalty` p and `frequency_penalty` f (-2..2) act on the tokens generated so far:
    `logit[t] -= f * count[t] + p * (count[t] > 0)`;
  - `repetition_penalty` r (> 0; 1 = off) acts on every token of the prompt and the output: a positive
    logit is divided by r, a negative one multiplied by r (Keskar et al., as transformers and vLLM apply it);
  - `logit_bias` adds its value (-100..100) to the logit of each listed token id;
  - `min_p` m (0..1) drops tokens whose probability is below m times the most likely token's;
  - `top_k` k (0 or -1 = off) keeps the k most likely tokens; `top_p` keeps the smallest set of most
    likely tokens whose mass reaches it (always at least one).
  Greedy decoding (temperature 0) takes the argmax of the penalised, biased logits.
* `token_logprobs`: the log-probability of the chosen token and the `n` most likely ones, from the raw
  model distribution (log-softmax of the logits before any penalty, bias, temperature or filter: vLLM's
  default, `logprobs_mode="raw_logprobs"`).
* `IncrementalDetokenizer`: text of newly generated tokens, never a broken UTF-8 character (a token that
  ends inside a multi-byte character is held until the character completes).
* `StopMatcher`: text-level stop strings, matched across token boundaries; the stop string and anything
  after it is never emitted, and text that could still become a stop string is held back until decided.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingConfig:
    """One request's sampling fields (ranges are validated at the edge and on the wire)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_EPS

    @property
    def penalised(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
        )


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def apply_penalties(
    logits: torch.Tensor,
    cfg: SamplingConfig,
    output_counts: torch.Tensor | None,
    seen_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Penalties and logit bias on float logits [V] (a new tensor). `output_counts` [V]: how often each
    token was generated; `seen_mask` [V] bool: tokens of the prompt or the output."""
    out = logits.float().clone()
    if cfg.repetition_penalty != 1.0 and seen_mask is not None:
        r = cfg.repetition_penalty
        penalised = torch.where(out > 0, out / r, out * r)
        out = torch.where(seen_mask, penalised, out)
    if output_counts is not None and (cfg.frequency_penalty != 0.0 or cfg.presence_penalty != 0.0):
        out -= cfg.frequency_penalty * output_counts + cfg.presence_penalty * (output_counts > 0).float()
    if cfg.logit_bias:
        ids = torch.tensor(list(cfg.logit_bias.keys()), dtype=torch.long)
        out[ids] += torch.tensor(list(cfg.logit_bias.values()), dtype=out.dtype)
    return out


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """`probs` [V] with the tokens min-p, top-k and top-p drop set to 0 (not renormalised: a multinomial
    draw needs no normalisation). At least the most likely token always remains."""
    if min_p > 0.0:
        probs = torch.where(probs < min_p * probs.max(), torch.zeros_like(probs), probs)
    if top_k > 0 and top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        keep = cum - sorted_p < top_p * cum[-1]  # the smallest prefix whose mass reaches top_p
        drop = idx[~keep]
        probs = probs.clone()
        probs[drop] = 0.0
    return probs


class Sampler:
    """One sequence's sampling state: its config, generator and the token counts penalties need
    (`vocab_size` is the logits' width, the model's `config.vocab_size`)."""

    __slots__ = ("cfg", "gen", "_counts", "_seen")

    def __init__(self, cfg: SamplingConfig, prompt_ids: Sequence[int], vocab_size: int) -> None:
        self.cfg = cfg
        self.gen = None if cfg.greedy else make_generator(cfg.seed)
        needs_counts = cfg.presence_penalty != 0.0 or cfg.frequency_penalty != 0.0
        self._counts = torch.zeros(vocab_size) if needs_counts else None
        self._seen: torch.Tensor | None = None
        if cfg.repetition_penalty != 1.0:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool)
            ids = [t for t in prompt_ids if 0 <= t < vocab_size]
            if ids:
                self._seen[torch.tensor(ids, dtype=torch.long)] = True

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalised and biased logits [V] (float); the input itself when nothing applies."""
        if not self.cfg.penalised:
            return logits
        return apply_penalties(logits, self.cfg, self._counts, self._seen)

    def pick(self, logits: torch.Tensor) -> int:
        """One token id from processed logits [V]."""
        cfg = self.cfg
        if cfg.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
        probs = filter_probs(probs, cfg.top_k, cfg.top_p, cfg.min_p)
        return int(torch.multinomial(probs.cpu(), 1, generator=self.gen))

    def sample(self, logits: torch.Tensor) -> int:
        return self.pick(self.process(logits))

    def observe(self, token_id: int) -> None:
        """Count a generated token (for the penalties)."""
        if self._counts is not None and token_id < self._counts.numel():
            self._counts[token_id] += 1
        if self._seen is not None and token_id < self._seen.numel():
            self._seen[token_id] = True


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the `top` most likely (id, logprob) pairs, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(raw_logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprobs:
    """Log-probabilities from the raw model distribution (log-softmax of unprocessed logits)."""
    lp = torch.log_softmax(raw_logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if top_n > 0:
        vals, ids = torch.topk(lp, min(top_n, lp.numel()))
        top = [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
    return TokenLogprobs(token_id, float(lp[token_id]), top)


class IncrementalDetokenizer:
    """vLLM-style prefix/read offsets: decode a short window, emit only complete new characters."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        return ""


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Text now safe to emit; sets `stopped` when a stop string appeared (it is not emitted)."""
        if self.stopped:
            return ""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out = self.pending[: min(hits)]
            self.pending = ""
            self.stopped = True
            return out
        # Hold back the longest tail that is a prefix of some stop string.
        keep = 0
        for k in range(min(self._hold, len(self.pending)), 0, -1):
            tail = self.pending[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out

    def flush(self) -> str:
        """At the end of generation (length or EOS): what was held back is not a stop string."""
        if self.stopped:
            return ""
        out, self.pending = self.pending, ""
        return out
