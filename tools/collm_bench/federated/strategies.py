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
from pathlib import Path

import numpy as np

from collm_aggregator.strategies import WeightedUpdate, fedavg, product_error, product_svd
from collm_bench.groups import RESULTS, add_domain_data, add_lr, add_threads, command_line, prog

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
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    from collm_data.converters import CONVERTERS
    from collm_replica.models import load_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t_load = time.perf_counter()
    lm = load_model("smollm2", cache_dir=Path.home() / ".cache" / "collm" / "models")
    print(f"model loaded in {time.perf_counter() - t_load:.1f}s", flush=True)
    tok = lm.tokenizer
    domains = args.domains.split(",")
    src = Path(args.source)
    data = {}
    for d in domains:
        conv = CONVERTERS[d](src / d, limit=args.train_examples, eval_limit=args.eval_examples)
        data[d] = (conv.train, conv.eval)

    def encode(e, max_len: int = 192) -> tuple[list[int], list[int]]:
        prompt = tok.apply_chat_template(e.messages(), add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        resp = tok(e.response + (tok.eos_token or ""), add_special_tokens=False)["input_ids"]
        ids = (prompt + resp)[:max_len]
        labels = ([-100] * len(prompt) + resp)[:max_len]
        return ids, labels

    enc = {d: ([encode(e) for e in tr], [encode(e) for e in ev]) for d, (tr, ev) in data.items()}
    r, alpha = args.rank, 2.0 * args.rank
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(MODULES), lora_dropout=0.0)
    pm = get_peft_model(lm.model, cfg, adapter_name="trainee")
    stack_cfg = LoraConfig(
        r=r * len(domains), lora_alpha=alpha * len(domains), target_modules=list(MODULES), lora_dropout=0.0
    )
    pm.add_adapter("stacked", stack_cfg)

    def batch_loss(items: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        n = max(len(i) for i, _ in items)
        pad = tok.pad_token_id or 0
        ids = torch.tensor([i + [pad] * (n - len(i)) for i, _ in items])
        lab = torch.tensor([lb + [-100] * (n - len(lb)) for _, lb in items])
        att = torch.tensor([[1] * len(i) + [0] * (n - len(i)) for i, _ in items])
        return pm(input_ids=ids, attention_mask=att, labels=lab).loss

    def set_trainee(sd: dict[str, np.ndarray]) -> None:
        res = set_peft_model_state_dict(
            pm, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}, adapter_name="trainee"
        )
        assert not res.unexpected_keys

    def trainee_state() -> dict[str, np.ndarray]:
        return {
            k: v.detach().float().numpy().copy()
            for k, v in get_peft_model_state_dict(pm, adapter_name="trainee").items()
        }

    @torch.no_grad()
    def eval_loss(adapter: str | None) -> dict[str, float]:
        pm.eval()
        out = {}
        for d in domains:
            tot = n = 0.0
            items = enc[d][1]
            for i in range(0, len(items), 8):
                chunk = items[i : i + 8]
                tokens = sum(sum(1 for x in lb if x != -100) for _, lb in chunk)
                if adapter is None:
                    with pm.disable_adapter():
                        loss = batch_loss(chunk)
                else:
                    pm.set_adapter(adapter)
                    loss = batch_loss(chunk)
                tot += float(loss) * tokens
                n += tokens
            out[d] = tot / n
        return out

    def train_local(start: dict[str, np.ndarray], d: str, round_i: int) -> dict[str, np.ndarray]:
        set_trainee(start)
        pm.set_adapter("trainee")
        params = [p for n, p in pm.named_parameters() if "trainee" in n]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
        g = np.random.default_rng(round_i * 100 + domains.index(d))
        items = enc[d][0]
        pm.train()
        for _ in range(args.steps):
            batch = [items[j] for j in g.choice(len(items), size=args.batch, replace=False)]
            loss = batch_loss(batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        pm.eval()
        for p in params:
            p.requires_grad_(False)
        return trainee_state()

    def set_stacked(ups: list[WeightedUpdate]) -> None:
        w = np.array([u.weight for u in ups], dtype=np.float64)
        w /= w.sum()
        sd = {}
        for k in ups[0].tensors:
            if k.endswith("lora_A.weight"):
                sd[k] = np.vstack([u.tensors[k] for u in ups]).astype(np.float32)
            else:
                sd[k] = np.hstack([p * u.tensors[k] for p, u in zip(w, ups, strict=True)]).astype(np.float32)
        res = set_peft_model_state_dict(
            pm, {k: torch.from_numpy(v) for k, v in sd.items()}, adapter_name="stacked"
        )
        assert not res.unexpected_keys

    base = trainee_state()  # PEFT's init: A random, B = 0
    report: dict = {
        "mode": "real",
        "domains": domains,
        "steps": args.steps,
        "lr": args.lr,
        "batch": args.batch,
        "rounds": [],
    }
    base_loss = eval_loss(None)
    print(f"base model held-out loss: {fmt(base_loss)}", flush=True)
    for rnd in range(args.rounds):
        t0 = time.perf_counter()
        ups = [WeightedUpdate(d, train_local(base, d, rnd), float(len(enc[d][0]))) for d in domains]
        t_train = time.perf_counter() - t0
        row: dict = {"round": rnd + 1, "train_seconds": t_train, "base_model": base_loss, "local_only": {}}
        for u in ups:
            set_trainee(u.tensors)
            row["local_only"][u.replica_id] = eval_loss("trainee")
        aggs = {}
        for name, fn in (("fedavg", fedavg), ("product_svd", product_svd)):
            t1 = time.perf_counter()
            aggs[name] = fn(ups)
            dt = time.perf_counter() - t1
            err = product_error(aggs[name], ups, base)
            set_trainee(aggs[name])
            row[name] = {"seconds": dt, **err, "loss": eval_loss("trainee")}
        set_stacked(ups)
        row["exact_average"] = {"loss": eval_loss("stacked")}
        report["rounds"].append(row)
        print(f"round {rnd + 1} (local training {t_train:.0f}s)", flush=True)
        for d, u in zip(domains, ups, strict=True):
            print(f"  local-only {d:17} {fmt(row['local_only'][u.replica_id])}")
        for name in ("fedavg", "product_svd"):
            x = row[name]
            ms = x["seconds"] * 1e3
            print(f"  {name:11} rel_delta={x['rel_delta']:.4f} agg={ms:.0f}ms loss {fmt(x['loss'])}")
        print(f"  exact avg   loss {fmt(row['exact_average']['loss'])}", flush=True)
        base = aggs[args.follow]
    return report


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
