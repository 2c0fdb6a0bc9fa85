"""Constrained decoding: a sequence's output follows a grammar (structured outputs, tool calls).

The grammar library is llguidance (`python -m collm_bench engine grammar-libs` measures it beside
xgrammar and outlines-core on the default tokenizer and the 22-schema suite of `collm_bench.schemas`;
result in `bench/results/engine/grammar_libs.json`): every random walk under its masks parsed and validated,
grammars compile in well under a millisecond (so each sequence compiles its own, with no cache), and it
reads JSON schemas and Lark grammars alike.

`Grammars` holds llguidance's view of the model's tokenizer (built on first use: about half a second),
which also gives each token's raw bytes (logprobs' `bytes`), and checks a request's grammar at admission
(an invalid one is a 400 naming the request field it came from). `Constraint` is one sequence's matcher:
`mask` sets every token the grammar does not allow next to -inf (end-of-sequence is allowed only where the
grammar may end), `advance` consumes the chosen token, and `complete` says the grammar admits nothing
more, so the sequence ends with "stop".
"""

from __future__ import annotations

import re
import threading
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from collm_replica.errors import ReplicaError


class Constraint:
    """One sequence's grammar state."""

    __slots__ = ("_m", "_vocab")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self._vocab = vocab_size

    def allowed(self) -> torch.Tensor:
        """Bool [V]: the tokens the grammar allows next."""
        words = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[: self._vocab].astype(bool)
        return torch.from_numpy(bits)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] with the disallowed tokens at -inf (a new tensor)."""
        return logits.masked_fill(~self.allowed(), float("-inf"))

    def advance(self, token_id: int) -> None:
        if not self._m.consume_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}: {self._m.get_error()}")

    @property
    def complete(self) -> bool:
        """Nothing but the end of the sequence may follow."""
        return bool(self._m.is_stopped())


class Grammars:
    """llguidance over one model's tokenizer; thread-safe."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._tok: Any = None
        self._lock = threading.Lock()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._tok is None:
                self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size)
            return self._tok

    def token_bytes(self, token_id: int) -> bytes:
        """The token's raw bytes (a byte-level token of a multi-byte character is that one byte)."""
        return bytes(self._tokenizer().decode_bytes([token_id]))

    def check(self, lark: str, param: str) -> None:
        """400 (naming `param`) unless `lark` is a grammar llguidance can run."""
        try:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(lark, self._tokenizer())
        except Exception as exc:  # noqa: BLE001 - any failure to read the grammar is the request's
            msg = f"{param}: the grammar could not be compiled: {exc}"
            raise ReplicaError(400, msg, param=param) from None
        if is_error:
            detail = grammar_error_text(messages[0]) if messages else "invalid grammar"
            raise ReplicaError(400, f"{param}: unsupported or invalid schema: {detail}", param=param)

    def constraint(self, lark: str) -> Constraint:
        m = llguidance.LLMatcher(self._tokenizer(), lark, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return Constraint(m, self.vocab_size)


def grammar_error_text(message: str) -> str:
    """llguidance's error without what is internal to CoLLM: its first line, less the position in the
    grammar CoLLM wrote (`at 1(8): `); the lines after it quote that grammar."""
    first = message.strip().splitlines()[0] if message.strip() else "invalid grammar"
    return re.sub(r"^at \d+\(\d+\):\s*", "", first)
