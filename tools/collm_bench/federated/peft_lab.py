"""The model of `federated strategies real`: SmolLM2 with two PEFT LoRA adapters, `trainee` (a
participant's local training runs in it, and an aggregate is loaded into it to be evaluated) and
`stacked`, of rank k·r, which serves the exact average of k participants' products B·A (FLoRA-style).

It imports torch and peft: `collm_bench.federated.strategies` loads it for the `real` mode only.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

from collm_aggregator.strategies import WeightedUpdate

# One example as token ids and labels (-100 on the prompt, which is not trained on).
Encoded = tuple[list[int], list[int]]


class PeftLab:
    """The PEFT model, its tokenizer, and each domain's encoded (train, eval) examples."""

    def __init__(self, pm: Any, tok: Any, enc: dict[str, tuple[list[Encoded], list[Encoded]]]) -> None:
        self.pm = pm
        self.tok = tok
        self.enc = enc
        self.domains = list(enc)

    @classmethod
    def load(cls, args: argparse.Namespace, target_modules: list[str]) -> PeftLab:
        """SmolLM2 with `--threads` torch threads (seed 0), each of `--domains` converted from `--source`
        and encoded, and both adapters (rank `--rank`, alpha 2r) on `target_modules`."""
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
        enc = {
            d: ([_encode(tok, e) for e in tr], [_encode(tok, e) for e in ev]) for d, (tr, ev) in data.items()
        }
        r, alpha = args.rank, 2.0 * args.rank
        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0)
        pm = get_peft_model(lm.model, cfg, adapter_name="trainee")
        stack_cfg = LoraConfig(
            r=r * len(domains),
            lora_alpha=alpha * len(domains),
            target_modules=target_modules,
            lora_dropout=0.0,
        )
        pm.add_adapter("stacked", stack_cfg)
        return cls(pm, tok, enc)

    def batch_loss(self, items: list[Encoded]) -> torch.Tensor:
        """The model's mean loss over `items`, padded to the longest."""
        n = max(len(i) for i, _ in items)
        pad = self.tok.pad_token_id or 0
        ids = torch.tensor([i + [pad] * (n - len(i)) for i, _ in items])
        lab = torch.tensor([lb + [-100] * (n - len(lb)) for _, lb in items])
        att = torch.tensor([[1] * len(i) + [0] * (n - len(i)) for i, _ in items])
        return self.pm(input_ids=ids, attention_mask=att, labels=lab).loss

    def set_trainee(self, sd: dict[str, np.ndarray]) -> None:
        res = set_peft_model_state_dict(
            self.pm,
            {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()},
            adapter_name="trainee",
        )
        assert not res.unexpected_keys

    def trainee_state(self) -> dict[str, np.ndarray]:
        return {
            k: v.detach().float().numpy().copy()
            for k, v in get_peft_model_state_dict(self.pm, adapter_name="trainee").items()
        }

    @torch.no_grad()
    def eval_loss(self, adapter: str | None) -> dict[str, float]:
        """Per domain, the held-out loss per label token with `adapter` (None: the base model)."""
        pm = self.pm
        pm.eval()
        out = {}
        for d in self.domains:
            tot = n = 0.0
            items = self.enc[d][1]
            for i in range(0, len(items), 8):
                chunk = items[i : i + 8]
                tokens = sum(sum(1 for x in lb if x != -100) for _, lb in chunk)
                if adapter is None:
                    with pm.disable_adapter():
                        loss = self.batch_loss(chunk)
                else:
                    pm.set_adapter(adapter)
                    loss = self.batch_loss(chunk)
                tot += float(loss) * tokens
                n += tokens
            out[d] = tot / n
        return out

    def train_local(
        self, start: dict[str, np.ndarray], d: str, round_i: int, steps: int, batch: int, lr: float
    ) -> dict[str, np.ndarray]:
        """`steps` AdamW steps of `batch` examples of domain `d` from `start` (batches drawn with a seed of
        the round and the domain); the trained adapter."""
        pm = self.pm
        self.set_trainee(start)
        pm.set_adapter("trainee")
        params = [p for n, p in pm.named_parameters() if "trainee" in n]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        g = np.random.default_rng(round_i * 100 + self.domains.index(d))
        items = self.enc[d][0]
        pm.train()
        for _ in range(steps):
            chosen = [items[j] for j in g.choice(len(items), size=batch, replace=False)]
            loss = self.batch_loss(chosen)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        pm.eval()
        for p in params:
            p.requires_grad_(False)
        return self.trainee_state()

    def set_stacked(self, ups: list[WeightedUpdate]) -> None:
        """Load `ups` into the stacked adapter: A's stacked, B's side by side scaled by the weights, so
        that its B·A is the weighted average of theirs."""
        w = np.array([u.weight for u in ups], dtype=np.float64)
        w /= w.sum()
        sd = {}
        for k in ups[0].tensors:
            if k.endswith("lora_A.weight"):
                sd[k] = np.vstack([u.tensors[k] for u in ups]).astype(np.float32)
            else:
                sd[k] = np.hstack([p * u.tensors[k] for p, u in zip(w, ups, strict=True)]).astype(np.float32)
        res = set_peft_model_state_dict(
            self.pm, {k: torch.from_numpy(v) for k, v in sd.items()}, adapter_name="stacked"
        )
        assert not res.unexpected_keys


def _encode(tok: Any, e: Any, max_len: int = 192) -> Encoded:
    """One example's chat prompt and response (with EOS), cut at `max_len` tokens."""
    prompt = tok.apply_chat_template(e.messages(), add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    resp = tok(e.response + (tok.eos_token or ""), add_special_tokens=False)["input_ids"]
    ids = (prompt + resp)[:max_len]
    labels = ([-100] * len(prompt) + resp)[:max_len]
    return ids, labels
