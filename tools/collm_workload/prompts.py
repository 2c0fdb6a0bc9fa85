"""Prompts of (approximately) a requested token length, built from real domain text.

Text sources, per domain (a directory each):

* the public datasets in `shared/data/domains/<domain>/` read as they are: every `*.jsonl` / `*.csv`
  file whose rows give a prompt and a response (GSM8K `question`/`answer`, MedQuAD `question`/`answer`,
  BANKING77 `text`/`category`, HumanEval `prompt`/`canonical_solution`); other files are skipped;
* any local dataset directory in the `collm_common.data` format (`prompt`/`response` JSONL or CSV, with
  optional `train/` and `eval/` sub-directories), for instance what `collm_data` converts.

A prompt is a short instruction, reference question/answer pairs from the same domain, and a final
question. The reference pairs fill the token budget; the last one is cut (at a token boundary when a
tokenizer is given) so that the prompt lands on the requested length. Short budgets get only the final
question, cut to fit. The builder is deterministic for a given numpy Generator.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from collm_common.data import Example, example_from_row
from collm_workload.tokens import TokenCounter

# Column aliases for the raw public files; collm_common.data already knows prompt/question/answer/...
_ALIASES = {"text": "prompt", "category": "response", "canonical_solution": "response"}
HEADER = (
    "Answer the last question. Earlier questions to the same {domain} service are shown with their "
    "answers for reference.\n\n"
)
# A cut reference pair shorter than this many tokens is left out rather than sent as a stub.
_MIN_PARTIAL_TOKENS = 8


class PromptError(ValueError):
    pass


def _rows(path: Path) -> Iterator[dict[str, object]]:
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    obj = json.loads(line)
                    if isinstance(obj, dict):
                        yield obj
    elif path.suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                # Ragged rows put their extra cells under the key None: keep the named columns only.
                yield {k: v for k, v in row.items() if isinstance(k, str)}


def read_domain_dir(directory: str | Path, domain: str, max_examples: int = 5000) -> list[Example]:
    """Prompt/response pairs from every readable file under `directory` (sorted, so runs repeat)."""
    d = Path(directory)
    if not d.is_dir():
        raise PromptError(f"domain {domain!r}: directory {d} does not exist")
    out: list[Example] = []
    for path in sorted(p for p in d.rglob("*") if p.is_file() and p.suffix in (".jsonl", ".csv")):
        for i, row in enumerate(_rows(path)):
            aliased = dict(row)
            for src, dst in _ALIASES.items():
                if src in row and dst not in row:
                    aliased[dst] = row[src]
            try:
                ex = example_from_row(aliased, f"{path.stem}-{i}", domain)
            except ValueError:
                break  # not a prompt/response file (a schema table, say): skip the whole file
            out.append(ex)
            if len(out) >= max_examples:
                return out
    if not out:
        raise PromptError(f"domain {domain!r}: no prompt/response examples under {d}")
    return out


def discover_domains(domains_dir: str | Path) -> list[str]:
    d = Path(domains_dir)
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))


def parse_mix(spec: str | None, available: list[str]) -> dict[str, float]:
    """`medical=0.5,math=0.5` -> normalised weights; None or empty -> equal weights over `available`."""
    if not spec:
        if not available:
            raise PromptError("no domains available for the mix")
        return {d: 1.0 / len(available) for d in available}
    weights: dict[str, float] = {}
    for part in spec.split(","):
        name, sep, value = part.strip().partition("=")
        if not name:
            continue
        try:
            w = float(value) if sep else 1.0
        except ValueError as e:
            raise PromptError(f"mix entry {part!r}: weight must be a number") from e
        if w < 0:
            raise PromptError(f"mix entry {part!r}: weight must be >= 0")
        weights[name] = weights.get(name, 0.0) + w
    total = sum(weights.values())
    if not weights or total <= 0:
        raise PromptError(f"mix {spec!r} has no positive weight")
    return {k: v / total for k, v in weights.items() if v > 0}


@dataclass(frozen=True)
class BuiltPrompt:
    text: str
    estimated_tokens: int
    example_id: str


class PromptBuilder:
    def __init__(
        self, corpora: Mapping[str, list[Example]], counter: TokenCounter, chat: bool = True
    ) -> None:
        for name, exs in corpora.items():
            if not exs:
                raise PromptError(f"domain {name!r} has no examples")
        self.corpora = dict(corpora)
        self.counter = counter
        self.chat = chat
        self._piece_tokens: dict[tuple[str, int], int] = {}

    def _piece(self, domain: str, idx: int) -> tuple[str, int]:
        ex = self.corpora[domain][idx]
        text = f"Question: {ex.prompt.strip()}\nAnswer: {ex.response.strip()}\n\n"
        key = (domain, idx)
        if key not in self._piece_tokens:
            self._piece_tokens[key] = self.counter.count(text, domain)
        return text, self._piece_tokens[key]

    def build(self, domain: str, target_tokens: int, rng: np.random.Generator) -> BuiltPrompt:
        if domain not in self.corpora:
            raise PromptError(f"no text for domain {domain!r} (have {sorted(self.corpora)})")
        exs = self.corpora[domain]
        overhead = self.counter.chat_overhead() if self.chat else 0
        budget = max(1, target_tokens - overhead)
        final_idx = int(rng.integers(len(exs)))
        final = f"Question: {exs[final_idx].prompt.strip()}\nAnswer:"
        header = HEADER.format(domain=domain.replace("_", " "))
        fixed = self.counter.count(header, domain) + self.counter.count(final, domain)
        if budget < fixed:
            text = self.counter.truncate(final, budget, domain) or final[:1]
        else:
            remaining = budget - fixed
            pieces: list[str] = []
            # Bounded: every iteration either appends a whole piece (remaining shrinks) or ends the loop.
            while remaining > 0:
                piece, n = self._piece(domain, int(rng.integers(len(exs))))
                if n <= 0:
                    continue
                if n <= remaining:
                    pieces.append(piece)
                    remaining -= n
                    continue
                if remaining >= _MIN_PARTIAL_TOKENS:
                    pieces.append(self.counter.truncate(piece, remaining - 1, domain).rstrip() + "\n\n")
                break
            text = header + "".join(pieces) + final
        return BuiltPrompt(text, self.counter.count(text, domain) + overhead, exs[final_idx].id)
