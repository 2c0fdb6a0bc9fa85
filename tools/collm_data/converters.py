"""Converters from the public domain datasets to CoLLM's local dataset format (`collm_common.data`).

Each converter reads the files of one domain folder (as laid out in `shared/data/domains/<domain>/`, see
its README) and returns instruction/response `Example`s split into train and held-out eval:

* math (GSM8K: gsm8k_train.jsonl, gsm8k_test.jsonl): word problem -> worked solution without the
  calculator annotations, ending "The answer is N."; split = the dataset's train/test.
* medical (MedQuAD: medquad_niddk_ninds_cdc.jsonl): consumer-health question -> answer cut to
  `max_words` at a sentence end; split by focus topic (hash), so a topic is never on both sides.
* customer_support (BANKING77: banking77_train.csv, banking77_test.csv): "Classify ...: <query>" ->
  intent label; split = the dataset's train/test.
* code (humaneval.jsonl, text2sql_advising.json): function stub -> body (split by task id hash), and
  question -> SQL with the template variables substituted (split = the dataset's question split;
  "exclude" questions are dropped).

Every example carries its `domain` and a stable `id`. `limit` keeps the first N examples of each source
split in a stable hash order (diverse, reproducible), not the first N lines of a file. The data itself is
never part of CoLLM: converters read it from wherever it lies and write to a directory given by the user.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from collm_common.data import Example


@dataclass
class Converted:
    domain: str
    train: list[Example] = field(default_factory=list)
    eval: list[Example] = field(default_factory=list)
    sources: dict[str, dict[str, object]] = field(default_factory=dict)


class SourceMissing(FileNotFoundError):
    pass


def _need(path: Path) -> Path:
    if not path.is_file():
        raise SourceMissing(f"{path} not found (is the domain folder complete?)")
    return path


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


def _in_eval(key: str, fraction: float) -> bool:
    return _hash(key) / 2**64 < fraction


def _take(examples: Iterable[Example], limit: int | None) -> list[Example]:
    items = list(examples)
    if limit is None or limit >= len(items):
        return items
    # Salted: the selection must not correlate with `collm_common.data.in_eval_split` (the same sha256
    # of the id, unsalted), or a limited train file re-split by hash would land entirely in eval.
    return sorted(items, key=lambda e: _hash("collm_data.take:" + e.id))[:limit]


def _jsonl(path: Path) -> Iterable[dict]:
    with _need(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


# --- math: GSM8K ----------------------------------------------------------------------------------------
_CALC = re.compile(r"<<[^>]*>>")
_FINAL = re.compile(r"\n?####\s*(.+?)\s*$")


def gsm8k_response(answer: str) -> str:
    """Drop the calculator annotations (`<<48/2=24>>`) and turn `#### 72` into a sentence."""
    text = _CALC.sub("", answer).strip()
    m = _FINAL.search(text)
    if m:
        text = text[: m.start()].rstrip() + f"\nThe answer is {m.group(1)}."
    return text


def convert_math(src: Path, limit: int | None = None, eval_limit: int | None = None) -> Converted:
    out = Converted("math")
    for split, name in (("train", "gsm8k_train.jsonl"), ("eval", "gsm8k_test.jsonl")):
        rows = [
            Example(
                id=f"gsm8k-{split}-{i}",
                prompt=r["question"].strip(),
                response=gsm8k_response(r["answer"]),
                domain="math",
            )
            for i, r in enumerate(_jsonl(src / name))
        ]
        kept = _take(rows, limit if split == "train" else eval_limit)
        getattr(out, split).extend(kept)
        out.sources[name] = {
            "split": split,
            "rows": len(rows),
            "kept": len(kept),
            "licence": "MIT (GSM8K, OpenAI)",
        }
    return out


# --- medical: MedQuAD -----------------------------------------------------------------------------------
def truncate_words(text: str, max_words: int) -> str:
    """At most `max_words` words, cut at the last sentence end inside the limit when there is one."""
    words = text.split()
    if len(words) <= max_words:
        return text.strip()
    cut = " ".join(words[:max_words])
    end = max(cut.rfind(". "), cut.rfind(".\n"), cut.rfind("? "), cut.rfind("! "))
    return cut[: end + 1] if end > len(cut) // 2 else cut + " ..."


def convert_medical(
    src: Path,
    limit: int | None = None,
    eval_limit: int | None = None,
    eval_fraction: float = 0.1,
    max_words: int = 160,
) -> Converted:
    out = Converted("medical")
    name = "medquad_niddk_ninds_cdc.jsonl"
    train, ev = [], []
    n = 0
    for r in _jsonl(src / name):
        n += 1
        if not (r.get("question") and r.get("answer")):
            continue
        e = Example(
            # qids repeat across the collections (NIDDK, NINDS, CDC): the source makes them unique.
            id=f"medquad-{str(r.get('source', '')).lower()}-{r.get('id', n)}",
            prompt=r["question"].strip(),
            response=truncate_words(r["answer"], max_words),
            domain="medical",
        )
        (ev if _in_eval(f"focus:{r.get('focus', e.id)}", eval_fraction) else train).append(e)
    out.train, out.eval = _take(train, limit), _take(ev, eval_limit)
    out.sources[name] = {
        "rows": n,
        "train": len(out.train),
        "eval": len(out.eval),
        "licence": "CC BY 4.0 (MedQuAD)",
    }
    return out


# --- customer support: BANKING77 ----------------------------------------------------------------------------
BANKING_PROMPT = "Classify this online-banking support request by its intent: {text}"


def convert_customer_support(src: Path, limit: int | None = None, eval_limit: int | None = None) -> Converted:
    out = Converted("customer_support")
    for split, name in (("train", "banking77_train.csv"), ("eval", "banking77_test.csv")):
        with _need(src / name).open(encoding="utf-8", newline="") as f:
            rows = [
                Example(
                    id=f"banking77-{split}-{i}",
                    prompt=BANKING_PROMPT.format(text=r["text"].strip()),
                    response=r["category"].strip(),
                    domain="customer_support",
                )
                for i, r in enumerate(csv.DictReader(f))
                if r.get("text") and r.get("category")
            ]
        kept = _take(rows, limit if split == "train" else eval_limit)
        getattr(out, split).extend(kept)
        out.sources[name] = {
            "split": split,
            "rows": len(rows),
            "kept": len(kept),
            "licence": "CC BY 4.0 (BANKING77)",
        }
    return out


# --- code: HumanEval + Advising text-to-SQL --------------------------------------------------------------
HUMANEVAL_PROMPT = "Complete the body of this Python function.\n\n{prompt}"
SQL_PROMPT = "Write an SQL query for the university course-advising database: {question}"


def substitute(text: str, variables: dict[str, str]) -> str:
    """Replace placeholder tokens (`department0`, `number0`) by their values, longest names first."""
    for name in sorted(variables, key=len, reverse=True):
        text = re.sub(rf"\b{re.escape(name)}\b", variables[name], text)
    return text


def convert_code(
    src: Path, limit: int | None = None, eval_limit: int | None = None, eval_fraction: float = 0.2
) -> Converted:
    out = Converted("code")
    he_train, he_eval = [], []
    rows = list(_jsonl(src / "humaneval.jsonl"))
    for r in rows:
        e = Example(
            id=f"humaneval-{r['task_id'].replace('/', '-')}",
            prompt=HUMANEVAL_PROMPT.format(prompt=r["prompt"]),
            response=r["canonical_solution"],
            domain="code",
        )
        (he_eval if _in_eval(r["task_id"], eval_fraction) else he_train).append(e)
    he_train, he_eval = _take(he_train, limit), _take(he_eval, eval_limit)
    out.sources["humaneval.jsonl"] = {
        "rows": len(rows),
        "train": len(he_train),
        "eval": len(he_eval),
        "licence": "MIT (HumanEval, OpenAI)",
    }

    items = json.loads(_need(src / "text2sql_advising.json").read_text(encoding="utf-8"))
    sql_train, sql_eval = [], []
    for i, item in enumerate(items):
        sql = item["sql"][0]
        # A variable that the question does not mention ("sql-only", empty in the sentence) takes the
        # template's example value (e.g. department0 -> EECS).
        defaults = {v["name"]: str(v.get("example", "")) for v in item.get("variables", [])}
        for j, s in enumerate(item.get("sentences", [])):
            split = s.get("question-split")
            if split == "exclude":
                continue
            variables = {
                k: (str(v) if v != "" else defaults.get(k, "")) for k, v in (s.get("variables") or {}).items()
            }
            e = Example(
                id=f"advising-{i}-{j}",
                prompt=SQL_PROMPT.format(question=substitute(s["text"], variables)),
                response=substitute(sql, variables),
                domain="code",
            )
            (sql_train if split == "train" else sql_eval).append(e)
    sql_train, sql_eval = _take(sql_train, limit), _take(sql_eval, eval_limit)
    out.sources["text2sql_advising.json"] = {
        "templates": len(items),
        "train": len(sql_train),
        "eval": len(sql_eval),
        "licence": "CC BY 4.0 (Advising, text2sql-data)",
    }
    out.train = he_train + sql_train
    out.eval = he_eval + sql_eval
    return out


CONVERTERS: dict[str, Callable[..., Converted]] = {
    "math": convert_math,
    "medical": convert_medical,
    "customer_support": convert_customer_support,
    "code": convert_code,
}
