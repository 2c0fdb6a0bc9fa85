"""Decode throughput with grammar-constrained requests in the batch: 16 requests decoding together on
SmolLM2, none constrained (the baseline) vs half of them constrained by a JSON schema (an array of at
least 50 objects with an integer and an enum: every one of the 64 tokens is under the mask), the other
half free. Same process, same prompts, alternated `--reps` times; the ratio is of decode tokens per
second (all generated tokens over the wall time of the batch).

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench engine constrained

(writes `bench/results/engine/constrained_decode.json`).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import Any

from collm_bench.engine.common import load_smollm2, save_result, submit, token_prompts, wait_all
from collm_bench.groups import add_output_tokens, add_prompt_tokens, prog
from collm_common.structured import json_schema_grammar
from collm_replica.engine import Engine, EngineConfig, EngineRequest
from collm_replica.engine.cosched import NoTraining

SCHEMA = {
    "type": "array",
    "minItems": 50,
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "tag": {"enum": ["alpha", "beta", "gamma"]}},
        "required": ["id", "tag"],
        "additionalProperties": False,
    },
}


def run(eng: Engine, prompts: list[list[int]], constrained: int, tokens: int, tag: str) -> dict[str, Any]:
    """One batch: every prompt at once, the first `constrained` under `SCHEMA`; tokens, wall, tokens/s."""
    grammar = json_schema_grammar(SCHEMA)
    reqs = [
        EngineRequest(
            f"{tag}{i}",
            p,
            max_tokens=tokens,
            temperature=1.0,
            seed=i,
            ignore_eos=True,
            grammar=grammar if i < constrained else None,
        )
        for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    traces = [submit(eng, r) for r in reqs]
    wait_all(traces)
    wall_s = time.perf_counter() - t0
    generated = sum(len(t.token_times) for t in traces)
    reasons = sorted({t.finished.finish_reason for t in traces if t.finished is not None})
    return {
        "tokens": generated,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(generated / wall_s, 2),
        "finish": reasons,
    }


def main(argv: Sequence[str]) -> int:
    """Alternate the unconstrained and the half-constrained batch, write the result, print the ratio."""
    ap = argparse.ArgumentParser(
        prog=prog("engine", "constrained"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--batch", type=int, default=16)
    add_output_tokens(ap, 64)
    add_prompt_tokens(ap, 64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    loaded = load_smollm2()
    prompts = token_prompts(loaded, args.batch, args.prompt_tokens)
    cfg = EngineConfig()
    cfg = dataclasses.replace(
        cfg, batch=dataclasses.replace(cfg.batch, max_batch=max(cfg.batch.max_batch, args.batch))
    )
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "half": []}
    with Engine(loaded, cfg, NoTraining()) as eng:
        run(eng, prompts, args.batch // 2, 4, "warm")  # llguidance's tokenizer view, the first masks
        for r in range(args.reps):
            for name, k in (("none", 0), ("half", args.batch // 2)):
                runs[name].append(run(eng, prompts, k, args.output_tokens, f"{name}{r}-"))
                print(name, runs[name][-1], flush=True)
    med = {name: statistics.median(x["tokens_per_s"] for x in rs) for name, rs in runs.items()}
    save_result(
        "constrained_decode",
        {
            "model": loaded.name,
            "batch": args.batch,
            "constrained": args.batch // 2,
            "max_tokens": args.output_tokens,
            "prompt_tokens": args.prompt_tokens,
            "schema": SCHEMA,
            "runs": runs,
            "tokens_per_s_median": med,
            "half_vs_none": round(med["half"] / med["none"], 3),
        },
    )
    print("half constrained / none:", round(med["half"] / med["none"], 3))
    return 0
