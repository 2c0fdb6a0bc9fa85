"""The promotion gate's noise, measured: how often each rule publishes a candidate that is no better out of
sample, and how often it publishes one that is.

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench gate noise [--tokens 1024] [--lr 1e-3]
    .venv/bin/python -m collm_bench gate noise --report  # the analysis and table again, from the result
    .venv/bin/python -m collm_bench readme               # the same tables in bench/README.md

Per demo domain (data/demo), on SmolLM2 with the replicas' own training and evaluation code
(`collm_replica.training`):

* the numeric floor: the base model's held-out losses scored twice, in evaluation batches of 512 and of
  128 tokens (other batch compositions and padding): the largest per-token change between two scorings
  of the same weights;
* two candidates A and B trained from v1 (a zero-B LoRA, the base model's behaviour) as a round trains
  them (`--tokens` each, AdamW at `--lr`, optimizer steps of 512 tokens) on the two halves of the
  domain's training pairs: the same recipe on disjoint data of one distribution;
* every example of the held-out split scored by base, A and B (kept in the result file, per example);
* then, for each comparison (A over B, B over A, A over the base) and each rule (z, min gain), 2000
  random splits of the held-out examples into the gate's sample (`--gate-examples`, as 2 replicas x
  32 score) and the rest: how often the rule publishes on the gate's sample, and how often what it
  published is no better on the rest (its paired change there >= 0): the false publications.

Result: `bench/results/gate/noise.json` (committed), the table printed.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from collm_bench.groups import RESULTS, add_lr, add_report, command_line, prog
from collm_bench.readme.gate import paired, table

RESULT = RESULTS / "gate" / "noise.json"


def measure(tokens_budget: int, lr: float) -> dict[str, Any]:
    """Per demo domain: the numeric floor, candidates A and B trained on the two halves of its training
    pairs, and every held-out example's loss under base, A and B."""
    import torch

    from collm_bench.engine.common import load_smollm2
    from collm_common.data import load_dataset
    from collm_common.lora import LoraSpec
    from collm_data.demo import DEMO_DIR, demo_domains
    from collm_replica.engine.executor import Executor
    from collm_replica.lora_bank import LiveLora
    from collm_replica.training import EvalRun, JobConfig, JobSpec, TrainingJob, render_example

    loaded = load_smollm2(1)
    ex = Executor(loaded)
    tok = loaded.tokenizer
    pad = int(tok.pad_token_id or 0)
    out: dict[str, Any] = {}
    for domain in demo_domains():
        t0 = time.time()
        ds = load_dataset(DEMO_DIR / domain, domain=domain)
        items = [r for e in ds.eval if (r := render_example(tok, e, 256))]

        def score(
            live: Any, chunk: int = 512, items: list[Any] = items, domain: str = domain
        ) -> tuple[list[float], list[int]]:
            run = EvalRun(items, live, chunk).run_all(ex, pad)
            return run.example_losses(domain)

        base, tokens = score(None)
        base_128, _ = score(None, 128)
        floor = max(abs(a - b) / n for a, b, n in zip(base, base_128, tokens, strict=True))
        cands = []
        for half in (ds.train[0::2], ds.train[1::2]):
            live = LiveLora.init_new(LoraSpec(), ex.n_layers, ex.shapes, loaded.name, seed=1)
            job = TrainingJob(
                JobSpec(domain, f"{domain}@v1", 1, live, token_budget=tokens_budget, learning_rate=lr),
                ex,
                tok,
                list(half),
                [],
                JobConfig(micro_tokens=128, batch_tokens=512, max_seq_len=256),
            )
            with torch.enable_grad():
                while job.active:
                    if job.step(128) == 0:
                        break
            cands.append(score(live)[0])
        a, b = cands
        all_idx = list(range(len(tokens)))
        out[domain] = {
            "held_out_examples": len(tokens),
            "held_out_tokens": sum(tokens),
            "numeric_floor_nats_per_token": floor,
            "base_loss": sum(base) / sum(tokens),
            "a_vs_base_full": dict(
                zip(("diff_nats", "se_nats"), paired(a, base, tokens, all_idx), strict=True)
            ),
            "a_vs_b_full": dict(zip(("diff_nats", "se_nats"), paired(a, b, tokens, all_idx), strict=True)),
            "examples": {"tokens": tokens, "base": base, "a": a, "b": b},
            "seconds": round(time.time() - t0, 1),
        }
        print(f"{domain}: scored in {out[domain]['seconds']} s", flush=True)
    return out


def main(argv: Sequence[str]) -> int:
    """Measure (unless `--report`), write the result, print the table of the result file."""
    p = argparse.ArgumentParser(prog=prog("gate", "noise"), description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="training tokens of each candidate")
    add_lr(p)
    p.add_argument("--gate-examples", type=int, default=50)
    p.add_argument("--draws", type=int, default=2000)
    add_report(p)
    args = p.parse_args(argv)
    if not args.report:
        result = {
            "command": command_line(["gate", "noise", *argv], lock=True),
            "measured_unix_s": round(time.time()),
            "tokens": args.tokens,
            "lr": args.lr,
            "gate_examples": args.gate_examples,
            "draws": args.draws,
            "domains": measure(args.tokens, args.lr),
        }
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(table(json.loads(RESULT.read_text())))
    return 0
