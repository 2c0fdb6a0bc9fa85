"""Turning logits into tokens and tokens into text.

* `sample_token`: greedy (temperature 0), temperature and top-p, with a per-request `torch.Generator`
  (seeded when the request carries a seed, so a seeded request is reproducible whatever it is batched with).
* `IncrementalDetokenizer`: text of newly generated tokens, never a broken UTF-8 character (a token that
  ends inside a multi-byte character is held until the character completes).
* `StopMatcher`: text-level stop strings, matched across token boundaries; the stop string and anything
  after it is never emitted, and text that could still become a stop string is held back until decided.
"""

from __future__ import annotations

from typing import Any

import torch

GREEDY_EPS = 1e-5


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> int:
    """One token id from last-position logits [V]."""
    if temperature <= GREEDY_EPS:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        keep = cum - sorted_p < top_p  # the smallest prefix whose mass reaches top_p (always >= 1 token)
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        choice = torch.multinomial(sorted_p.cpu(), 1, generator=generator)
        return int(idx[int(choice)])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


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
