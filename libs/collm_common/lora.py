"""The adapter blob format: LoRA tensors in safetensors, with their configuration inside.

A blob is a safetensors file (bytes) whose tensors use PEFT's state-dict names
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, shape [r, in];
`...lora_B.weight`, shape [out, r]) and whose header metadata holds the LoRA configuration and the base
model it was trained on. A blob is therefore self-describing: it can be exported as a PEFT adapter
directory and a PEFT directory can be imported as a blob, with no other record needed.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

META_CONFIG = "collm.lora_config"
META_BASE_MODEL = "collm.base_model"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    """Shape of a LoRA adapter; every version of one adapter keeps the same spec."""

    r: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "target_modules": list(self.target_modules)})

    @classmethod
    def from_json(cls, text: str) -> LoraSpec:
        d = json.loads(text)
        return cls(r=int(d["r"]), alpha=float(d["alpha"]), target_modules=tuple(d["target_modules"]))

    def peft_config(self, base_model: str) -> dict[str, Any]:
        """An `adapter_config.json` that PEFT loads (`PeftModel.from_pretrained`)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.r,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "target_modules": list(self.target_modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "init_lora_weights": True,
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
        }


@dataclass
class AdapterWeights:
    tensors: dict[str, torch.Tensor]
    spec: LoraSpec
    base_model: str
    extra: dict[str, str] = field(default_factory=dict)


def encode_adapter(weights: AdapterWeights) -> bytes:
    from safetensors.torch import save

    meta = {META_CONFIG: weights.spec.to_json(), META_BASE_MODEL: weights.base_model, **weights.extra}
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in sorted(weights.tensors.items())}
    return save(tensors, metadata=meta)


def read_metadata(blob: bytes) -> dict[str, str]:
    """The safetensors header metadata, without loading tensors."""
    if len(blob) < 8:
        raise ValueError("not a safetensors blob (too short)")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise ValueError("not a safetensors blob (bad header length)")
    header = json.loads(blob[8 : 8 + n])
    return dict(header.get("__metadata__") or {})


def decode_adapter(blob: bytes) -> AdapterWeights:
    """Tensors, spec and base model of a blob; raises ValueError for anything that is not an adapter."""
    from safetensors.torch import load

    meta = read_metadata(blob)
    if META_CONFIG not in meta:
        raise ValueError("blob carries no LoRA configuration (collm.lora_config)")
    spec = LoraSpec.from_json(meta[META_CONFIG])
    extra = {k: v for k, v in meta.items() if k not in (META_CONFIG, META_BASE_MODEL)}
    return AdapterWeights(
        tensors=load(blob), spec=spec, base_model=meta.get(META_BASE_MODEL, ""), extra=extra
    )


def lora_key(layer: int, module_path: str, which: str) -> str:
    """PEFT state-dict name of one LoRA matrix, e.g. lora_key(0, "self_attn.q_proj", "A")."""
    if which not in ("A", "B"):
        raise ValueError("which must be 'A' or 'B'")
    return f"{PEFT_PREFIX}model.layers.{layer}.{module_path}.lora_{which}.weight"
