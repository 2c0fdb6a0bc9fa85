"""Which aggregation strategy should be the default? FedAvg (A and B averaged separately) vs product-SVD.

Two measurements, both on SmolLM2-135M's LoRA shapes (30 layers; q_proj/o_proj 576x576, k_proj/v_proj
576->192; r=8, alpha=16):

1. `synthetic` (seconds, no model): participants' adapters drawn around a common base, sweeping how far
   they moved (relative change of A and B) and how different they are (heterogeneity). For each aggregate:
   the distance of its B·A from the exact average of the participants' B·A, relative to the norm of the
   average change from the base (`rel_delta`: how much of what the round meant to apply is lost or
   distorted), and the aggregation time.
2. `real` (minutes, heavy: run under `flock /tmp/collm-heavy.lock`): SmolLM2 with real local training.
   Three participants, each on a different real domain (converted from ../shared/data/domains), train the
   same base adapter for `--steps` AdamW steps per round for `--rounds` rounds. After each round: the same
   distances, and the held-out loss per domain of the base model, of each participant's own update, of the
   FedAvg aggregate, of the product-SVD aggregate and of the exact average (served as a rank-3r stacked
   adapter, FLoRA-style, which equals the average of the products exactly). The next round starts from the
   aggregate of the strategy being followed (`--follow`).

    .venv/bin/python -m collm_bench federated strategies synthetic
    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench federated strategies real --rounds 2

Results are printed and written as JSON under bench/results/federated/ (`strategies_<mode>.json`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from collm_aggregator.strategies import WeightedUpdate, fedavg, product_error, product_svd
from collm_bench.groups import RESULTS, add_domain_data, add_lr, add_threads, command_line, prog

if TYPE_CHECKING:
    from collm_bench.federated.peft_lab import PeftLab

FEDERATED_RESULTS = RESULTS / "federated"
SMOL = {"layers": 30, "hidden": 576, "kv": 192}
MODULES = {
    "q_proj": ("hidden", "hidden"),
    "k_proj": ("hidden", "kv"),
    "v_proj": ("hidden", "kv"),
    "o_proj": ("hidden", "hidden"),
}


def key(layer: int, module: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_{which}.weight"


# --- synthetic ------------------------------------------------------------------------------------------
def synthetic_base(rng: np.random.Generator, r: int, trained: bool) -> dict[str, np.ndarray]:
    """PEFT's init (A ~ kaiming-uniform, B = 0), or an adapter after some training (B != 0)."""
    out = {}
    for layer in range(SMOL["layers"]):
        for m, (i, o) in MODULES.items():
            n_in, n_out = SMOL[i], SMOL[o]
            bound = 1 / math.sqrt(n_in)
            out[key(layer, m, "A")] = rng.uniform(-bound, bound, (r, n_in)).astype(np.float32)
            b = rng.standard_normal((n_out, r)) * (0.02 if trained else 0.0)
            out[key(layer, m, "B")] = b.astype(np.float32)
    return out


def synthetic_updates(
    rng: np.random.Generator, base: dict[str, np.ndarray], k: int, move: float, hetero: float
) -> list[WeightedUpdate]:
    """k participants: base + (shared direction + hetero * own direction), scaled to a relative change `move`
    of A and an absolute change of B of the same order as A's entries times `move`."""
    shared = {n: rng.standard_normal(v.shape) for n, v in base.items()}
    ups = []
    for j in range(k):
        t = {}
        for n, v in base.items():
            d = shared[n] + hetero * rng.standard_normal(v.shape)
            d /= np.linalg.norm(d) + 1e-12
            if n.endswith("lora_A.weight"):
                scale = move * np.linalg.norm(v)
            else:  # B: the change that training makes (B starts at 0, so scale by A's typical norm)
                a_norm = np.linalg.norm(base[n.replace("lora_B", "lora_A")])
                scale = move * a_norm
            t[n] = (v + scale * d).astype(np.float32)
        ups.append(WeightedUpdate(f"p{j}", t, float(100 * (j + 1))))
    return ups


def run_synthetic(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(0)
    rows = []
    for trained in (False, True):
        base = synthetic_base(rng, args.rank, trained)
        for move in (0.01, 0.05, 0.2):
            for hetero in (0.0, 1.0, 3.0):
                ups = synthetic_updates(rng, base, args.participants, move, hetero)
                row = {"base": "trained" if trained else "peft_init", "move": move, "hetero": hetero}
                for name, fn in (("fedavg", fedavg), ("product_svd", product_svd)):
                    t0 = time.perf_counter()
                    agg = fn(ups)
                    dt = time.perf_counter() - t0
                    err = product_error(agg, ups, base)
                    row[name] = {"rel_delta": err["rel_delta"], "rel_avg": err["rel_avg"], "seconds": dt}
                rows.append(row)
                fa, ps = row["fedavg"], row["product_svd"]
                print(
                    f"{row['base']:9} move={move:<5} hetero={hetero:<4} "
                    f"fedavg rel_delta={fa['rel_delta']:.4f} ({fa['seconds'] * 1e3:.0f} ms)  "
                    f"product_svd rel_delta={ps['rel_delta']:.4f} ({ps['seconds'] * 1e3:.0f} ms)",
                    flush=True,
                )
    return {"mode": "synthetic", "participants": args.participants, "rank": args.rank, "rows": rows}


# --- real -----------------------------------------------------------------------------------------------
def run_real(args: argparse.Namespace) -> dict:
    from collm_bench.federated.peft_lab import PeftLab

    lab = PeftLab.load(args, list(MODULES))
    base = lab.trainee_state()  # PEFT's init: A random, B = 0
    report: dict = {
        "mode": "real",
        "domains": lab.domains,
        "steps": args.steps,
        "lr": args.lr,
        "batch": args.batch,
        "rounds": [],
    }
    base_loss = lab.eval_loss(None)
    print(f"base model held-out loss: {fmt(base_loss)}", flush=True)
    for rnd in range(args.rounds):
        row, aggs = real_round(lab, args, base, rnd, base_loss)
        report["rounds"].append(row)
        print_round(row, lab.domains)
        base = aggs[args.follow]
    return report


def real_round(
    lab: PeftLab, args: argparse.Namespace, base: dict[str, np.ndarray], rnd: int, base_loss: dict[str, float]
) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
    """Round `rnd` (from 0) from `base`: each domain's local training, then the held-out losses of each
    local update, of each aggregate (with its distances and time) and of the exact average, beside the
    base model's `base_loss`; and the aggregates."""
    t0 = time.perf_counter()
    ups = [
        WeightedUpdate(
            d, lab.train_local(base, d, rnd, args.steps, args.batch, args.lr), float(len(lab.enc[d][0]))
        )
        for d in lab.domains
    ]
    t_train = time.perf_counter() - t0
    row: dict = {"round": rnd + 1, "train_seconds": t_train, "base_model": base_loss, "local_only": {}}
    for u in ups:
        lab.set_trainee(u.tensors)
        row["local_only"][u.replica_id] = lab.eval_loss("trainee")
    aggs = {}
    for name, fn in (("fedavg", fedavg), ("product_svd", product_svd)):
        t1 = time.perf_counter()
        aggs[name] = fn(ups)
        dt = time.perf_counter() - t1
        err = product_error(aggs[name], ups, base)
        lab.set_trainee(aggs[name])
        row[name] = {"seconds": dt, **err, "loss": lab.eval_loss("trainee")}
    lab.set_stacked(ups)
    row["exact_average"] = {"loss": lab.eval_loss("stacked")}
    return row, aggs


def print_round(row: dict, domains: list[str]) -> None:
    """A round's losses (and the aggregates' distances and times), one line each."""
    print(f"round {row['round']} (local training {row['train_seconds']:.0f}s)", flush=True)
    for d in domains:
        print(f"  local-only {d:17} {fmt(row['local_only'][d])}")
    for name in ("fedavg", "product_svd"):
        x = row[name]
        ms = x["seconds"] * 1e3
        print(f"  {name:11} rel_delta={x['rel_delta']:.4f} agg={ms:.0f}ms loss {fmt(x['loss'])}")
    print(f"  exact avg   loss {fmt(row['exact_average']['loss'])}", flush=True)


def fmt(losses: dict[str, float]) -> str:
    mean = sum(losses.values()) / len(losses)
    return " ".join(f"{d}={v:.4f}" for d, v in losses.items()) + f" | mean={mean:.4f}"


def main(argv: Sequence[str]) -> int:
    """Run the `synthetic` or `real` comparison, write the result file."""
    p = argparse.ArgumentParser(prog=prog("federated", "strategies"), description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    s = sub.add_parser("synthetic", parents=[shared], help="adapters drawn around a base: seconds, no model")
    s.add_argument("--participants", type=int, default=3)
    r = sub.add_parser("real", parents=[shared], help="SmolLM2 trained on real domains: minutes, heavy")
    add_domain_data(r, train_examples=400, eval_examples=48)
    r.add_argument("--steps", type=int, default=20)
    r.add_argument("--batch", type=int, default=4)
    add_lr(r)
    r.add_argument("--rounds", type=int, default=2)
    add_threads(r, 2)
    r.add_argument("--follow", choices=("fedavg", "product_svd"), default="product_svd")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = run_synthetic(args) if args.mode == "synthetic" else run_real(args)
    command = command_line(["federated", "strategies", *argv], lock=args.mode == "real")
    report = {"command": command, **report}
    FEDERATED_RESULTS.mkdir(parents=True, exist_ok=True)
    out = FEDERATED_RESULTS / f"strategies_{args.mode}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
