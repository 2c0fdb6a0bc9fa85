"""A replica's local dataset: instruction/response pairs, in files that people can write by hand.

Formats (a dataset directory holds any number of these files):

* `*.jsonl`: one object per line with `prompt` and `response` (aliases: `instruction`/`input` and
  `output`/`answer`/`completion`), and optional `system`, `domain`, `id`;
* `*.csv`: a header row with the same column names.

`train/` and `eval/` sub-directories, when present, give the held-out split explicitly; otherwise a
stable hash of each example's id decides its split (`eval_fraction`), so the split never changes when
samples are added. Raw data never leaves the replica that reads it.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

PROMPT_KEYS = ("prompt", "instruction", "question", "input")
RESPONSE_KEYS = ("response", "output", "answer", "completion")


@dataclass(frozen=True)
class Example:
    id: str
    prompt: str
    response: str
    system: str | None = None
    domain: str | None = None

    def messages(self) -> list[dict[str, str]]:
        """Chat messages for the chat template (the response is the assistant turn)."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return [*msgs, {"role": "user", "content": self.prompt}]


def _pick(row: dict[str, object], keys: Iterable[str]) -> str | None:
    for k in keys:
        v = row.get(k)
        if isinstance(v, str) and v.strip():
            return v
    return None


def example_from_row(row: dict[str, object], fallback_id: str, domain: str | None = None) -> Example:
    prompt = _pick(row, PROMPT_KEYS)
    response = _pick(row, RESPONSE_KEYS)
    if prompt is None or response is None:
        raise ValueError(f"example {fallback_id}: needs a prompt and a response (got keys {sorted(row)})")
    rid = row.get("id")
    return Example(
        id=str(rid) if rid not in (None, "") else fallback_id,
        prompt=prompt,
        response=response,
        system=row.get("system") if isinstance(row.get("system"), str) else None,
        domain=(row.get("domain") if isinstance(row.get("domain"), str) else None) or domain,
    )


def read_file(path: Path, domain: str | None = None) -> Iterator[Example]:
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                if line.strip():
                    yield example_from_row(json.loads(line), f"{path.stem}-{i}", domain)
    elif path.suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            for i, row in enumerate(csv.DictReader(f)):
                yield example_from_row(dict(row), f"{path.stem}-{i}", domain)


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.suffix in (".jsonl", ".csv") and p.is_file())


def in_eval_split(example_id: str, eval_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(example_id.encode()).digest()[:8], "big")
    return (h / 2**64) < eval_fraction


@dataclass
class LocalDataset:
    train: list[Example]
    eval: list[Example]

    @property
    def domains(self) -> list[str]:
        return sorted({e.domain for e in self.train + self.eval if e.domain})

    def add(self, example: Example, eval_fraction: float = 0.1) -> None:
        (self.eval if in_eval_split(example.id, eval_fraction) else self.train).append(example)


def load_dataset(
    directory: str | Path, eval_fraction: float = 0.1, domain: str | None = None
) -> LocalDataset:
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"dataset directory {d} does not exist")
    if (d / "train").is_dir():
        train = [e for p in _files(d / "train") for e in read_file(p, domain)]
        ev = [e for p in _files(d / "eval") for e in read_file(p, domain)] if (d / "eval").is_dir() else []
        return LocalDataset(train, ev)
    ds = LocalDataset([], [])
    for p in _files(d):
        for e in read_file(p, domain):
            ds.add(e, eval_fraction)
    return ds


def write_jsonl(path: Path, examples: Iterable[Example], append: bool = False) -> int:
    """Write `examples` as JSONL at `path` (its directory created), or append them with `append`;
    returns how many were written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("a" if append else "w", encoding="utf-8") as f:
        for e in examples:
            row = {"id": e.id, "prompt": e.prompt, "response": e.response}
            if e.system:
                row["system"] = e.system
            if e.domain:
                row["domain"] = e.domain
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n
