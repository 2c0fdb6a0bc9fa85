"""Which grammar library constrains the replica's sampler: llguidance, xgrammar and outlines-core measured
on the default model's tokenizer (SmolLM2, 49152 tokens) over the JSON-schema suite
(`collm_bench.schemas`, 22 schemas).

Per library: grammar compile time per schema; the per-token cost at batch 16 (16 sequences, each with
its own schema's matcher: compute the allowed-token mask, apply it to that sequence's logits, advance by
the chosen token), and correctness: random walks that pick uniformly among the allowed tokens until the
matcher accepts (or 400 tokens), every finished walk's text parsed as JSON and validated against its
schema (`jsonschema`). A library that cannot compile a schema scores it as unsupported.

    PYTHONPATH=/tmp/glibs flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench engine grammar-libs

(writes `bench/results/engine/grammar_libs.json`).
The libraries are installed for the run only (`pip install --target DIR xgrammar apache-tvm-ffi
outlines-core llguidance --no-deps`) and found on `PYTHONPATH=DIR`, ahead of the environment's own;
the replica depends on the chosen one alone. A library that does not import is recorded as an error.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from collm_bench.engine.common import load_smollm2, save_result
from collm_bench.groups import prog
from collm_bench.schemas import SCHEMAS
from collm_common.stats import percentile

MAX_WALK_TOKENS = 400


class Lib:
    """One library behind a common face: compile(schema) -> state factory; per-state mask/advance."""

    name: str

    def compile(self, schema: dict[str, Any]) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def allowed(self, m: Any) -> np.ndarray: ...  # bool [V]
    def advance(self, m: Any, token: int) -> None: ...

    eos: int
    vocab: int

    def accepting(self, m: Any) -> bool:
        """The grammar may end here: the end-of-sequence token is allowed."""
        return bool(self.allowed(m)[self.eos])


def _unpack(words: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)


class LLGuidance(Lib):
    name = "llguidance"

    def __init__(self, hf_tok: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)
        self.vocab = vocab
        self.eos = hf_tok.eos_token_id

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        err, _ = self.ll.LLMatcher.validate_grammar_with_warnings(grammar, self.tok)
        if err:
            raise ValueError("grammar error")
        return grammar

    def matcher(self, compiled: Any) -> Any:
        m = self.ll.LLMatcher(self.tok, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def allowed(self, m: Any) -> np.ndarray:
        return _unpack(np.frombuffer(m.compute_bitmask(), dtype=np.int32), self.vocab)

    def advance(self, m: Any, token: int) -> None:
        if not m.consume_token(token):
            raise ValueError(m.get_error())


class XGrammar(Lib):
    name = "xgrammar"

    def __init__(self, hf_tok: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab = vocab
        self.eos = hf_tok.eos_token_id
        self.mask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def allowed(self, m: Any) -> np.ndarray:
        m.fill_next_token_bitmask(self.mask, 0)
        return _unpack(self.mask[0].numpy(), self.vocab)

    def advance(self, m: Any, token: int) -> None:
        if not m.accept_token(token):
            raise ValueError("token refused")


def _byte_vocab(hf_tok: Any) -> dict[Any, list[int]]:
    """Token id -> its bytes, for byte-level BPE tokenizers (GPT-2's byte-to-unicode table inverted)."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    decoder = {chr(c): b for b, c in zip(bs, cs, strict=True)}
    out: dict[Any, list[int]] = {}
    special = set(hf_tok.all_special_ids)
    for token, i in hf_tok.get_vocab().items():
        if i in special:
            continue
        raw = bytes(decoder[ch] for ch in token) if all(ch in decoder for ch in token) else token.encode()
        out.setdefault(raw, []).append(i)
    return out


class OutlinesCore(Lib):
    name = "outlines-core"

    def __init__(self, hf_tok: Any, vocab: int) -> None:
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = oc
        self.regex_of = build_regex_from_schema
        self.vocabulary = oc.Vocabulary(hf_tok.eos_token_id, _byte_vocab(hf_tok))
        self.vocab = vocab
        self.eos = hf_tok.eos_token_id

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.oc.Index(self.regex_of(json.dumps(schema)), self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def allowed(self, m: Any) -> np.ndarray:
        mask = np.zeros(self.vocab, dtype=bool)
        mask[np.asarray(m.get_tokens(), dtype=np.int64)] = True
        return mask

    def advance(self, m: Any, token: int) -> None:
        m.advance(token)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def walk(lib: Lib, compiled: Any, rng: random.Random, hf_tok: Any) -> tuple[str | None, int]:
    """Uniform choices among allowed tokens until the matcher accepts; (text or None, tokens)."""
    m = lib.matcher(compiled)
    ids: list[int] = []
    special = set(hf_tok.all_special_ids)
    for _ in range(MAX_WALK_TOKENS):
        if lib.accepting(m):
            return hf_tok.decode(ids), len(ids)
        allowed = np.flatnonzero(lib.allowed(m))
        allowed = [int(t) for t in allowed if int(t) not in special]
        if not allowed:
            return None, len(ids)
        tok = rng.choice(allowed)
        lib.advance(m, tok)
        ids.append(tok)
    return None, len(ids)


def measure(lib: Lib, hf_tok: Any, walks: int, steps: int, batch: int) -> dict[str, Any]:
    import jsonschema

    compiled: dict[str, Any] = {}
    compile_ms: dict[str, float] = {}
    unsupported: dict[str, str] = {}
    for name, schema in SCHEMAS.items():
        try:
            c, ms = _timed(lambda s=schema: lib.compile(s))
            lib.matcher(c)
        except Exception as exc:  # noqa: BLE001 - a schema the library cannot take
            unsupported[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
            continue
        compiled[name], compile_ms[name] = c, ms
    rng = random.Random(0)
    valid = invalid = unfinished = 0
    failures: list[str] = []
    for name, c in compiled.items():
        for _ in range(walks):
            try:
                text, _n = walk(lib, c, rng, hf_tok)
            except Exception as exc:  # noqa: BLE001 - a matcher error counts against the library
                failures.append(f"{name}: {type(exc).__name__}")
                invalid += 1
                continue
            if text is None:
                unfinished += 1
                continue
            try:
                jsonschema.validate(json.loads(text), SCHEMAS[name])
                valid += 1
            except Exception as exc:  # noqa: BLE001
                invalid += 1
                failures.append(f"{name}: {text[:80]!r} ({type(exc).__name__})")
    # Per-token cost at `batch`: each sequence its own schema's matcher; mask, apply, advance.
    names = list(compiled)
    vocab = lib.vocab
    logits = torch.randn(batch, vocab)
    per_token_us: list[float] = []
    mats = [lib.matcher(compiled[names[i % len(names)]]) for i in range(batch)]
    special = sorted(hf_tok.all_special_ids)
    for _ in range(steps):
        t0 = time.perf_counter()
        for i, m in enumerate(mats):
            mask = lib.allowed(m)
            if mask[lib.eos]:  # this sequence's JSON may end: start it again
                mats[i] = m = lib.matcher(compiled[names[i % len(names)]])
                mask = lib.allowed(m)
            mask[special] = False
            row = logits[i].masked_fill(~torch.from_numpy(mask), float("-inf"))
            lib.advance(m, int(torch.argmax(row + torch.rand(vocab))))
        per_token_us.append((time.perf_counter() - t0) * 1e6 / batch)
    return {
        "schemas": len(SCHEMAS),
        "compiled": len(compiled),
        "unsupported": unsupported,
        "compile_ms_median": round(statistics.median(compile_ms.values()), 2) if compile_ms else None,
        "compile_ms_max": round(max(compile_ms.values()), 2) if compile_ms else None,
        "walks": {"valid": valid, "invalid": invalid, "unfinished": unfinished},
        "failures": failures[:10],
        "mask_us_per_token_batch16_median": round(statistics.median(per_token_us), 1),
        "mask_us_per_token_batch16_p90": round(percentile(per_token_us, 90), 1),
    }


def main(argv: Sequence[str]) -> int:
    """Measure every library that imports, write the result."""
    ap = argparse.ArgumentParser(
        prog=prog("engine", "grammar-libs"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--walks", type=int, default=5, help="random walks per schema")
    ap.add_argument("--steps", type=int, default=60, help="timed batch steps")
    args = ap.parse_args(argv)

    hf_tok = load_smollm2().tokenizer
    vocab = len(hf_tok)
    results: dict[str, Any] = {}
    for cls in (LLGuidance, XGrammar, OutlinesCore):
        try:
            lib, init_ms = _timed(lambda c=cls: c(hf_tok, vocab))
        except Exception as exc:  # noqa: BLE001
            results[cls.name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        res = measure(lib, hf_tok, args.walks, args.steps, 16)
        res["tokenizer_init_ms"] = round(init_ms, 1)
        results[cls.name] = res
        print(cls.name, json.dumps(res), flush=True)
    save_result(
        "grammar_libs",
        {
            "tokenizer": "SmolLM2-135M-Instruct",
            "vocab": vocab,
            "batch": 16,
            "walks_per_schema": args.walks,
            "versions": {n: _version(n) for n in ("llguidance", "xgrammar", "outlines_core")},
            "results": results,
        },
    )
    return 0


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module.replace("_", "-"))
    except PackageNotFoundError:
        return None
