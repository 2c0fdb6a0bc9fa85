"""Bringing LoRA adapters in and out: PEFT adapter directories <-> CoLLM adapter blobs.

`import_peft_dir(path)` reads `adapter_config.json` + `adapter_model.safetensors` (what
`PeftModel.save_pretrained` writes) and returns `AdapterWeights` ready for `encode_adapter`, after
checking that it is something a replica can serve: a plain LoRA (no DoRA, no bias, no
`modules_to_save`, no per-layer rank or alpha patterns), on supported target modules, with one rank no
larger than `max_rank`, every A/B pair complete and shaped [r, in] / [out, r], and, when asked, the
expected base model and tensor shapes. rsLoRA's scaling (alpha / sqrt(r)) is folded into an equivalent
plain alpha, so the served function is unchanged. Pickled `adapter_model.bin` files are refused (they
can run code when loaded); convert them to safetensors first.

`export_peft_dir(blob, out_dir)` writes a directory that `peft.PeftModel.from_pretrained` loads.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from collm_common.lora import PEFT_PREFIX, AdapterWeights, LoraSpec, decode_adapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$"
)


class AdapterImportError(ValueError):
    """A directory that cannot be imported, with a reason fit for an error reply."""


def same_base_model(a: str, b: str) -> bool:
    """Whether two base-model names denote the same model: equal, or equal last path components
    (`HuggingFaceTB/SmolLM2-135M-Instruct` and `/models/SmolLM2-135M-Instruct`), case-insensitively."""
    if a == b:
        return True
    last = (a.rstrip("/").rsplit("/", 1)[-1].lower(), b.rstrip("/").rsplit("/", 1)[-1].lower())
    return bool(last[0]) and last[0] == last[1]


def _config(path: Path) -> dict:
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise AdapterImportError(f"{path} has no {CONFIG_FILE}: not a PEFT adapter directory")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterImportError(f"{cfg_path} is not readable JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise AdapterImportError(f"{cfg_path} must hold a JSON object")
    return cfg


def _check_config(cfg: dict, supported: Sequence[str], max_rank: int) -> tuple[int, float]:
    """(r, effective alpha) of a config that CoLLM can serve, else AdapterImportError."""
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise AdapterImportError(f"only LoRA adapters can be imported (peft_type={cfg.get('peft_type')!r})")
    refusals = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "adapters with modules_to_save (full extra layers) are not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "layers_to_transform": "adapters on a subset of layers (layers_to_transform) are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D models such as GPT-2) is not supported",
        "lora_bias": "LoRA bias terms are not supported",
    }
    for key, why in refusals.items():
        if cfg.get(key):
            raise AdapterImportError(why)
    if cfg.get("bias", "none") not in ("none", None):
        raise AdapterImportError(f"bias={cfg.get('bias')!r} is not supported (only 'none')")
    try:
        r = int(cfg["r"])
        alpha = float(cfg.get("lora_alpha", r))
    except (KeyError, TypeError, ValueError):
        raise AdapterImportError("adapter_config.json needs an integer r and a numeric lora_alpha") from None
    if not 1 <= r <= max_rank:
        raise AdapterImportError(f"rank r={r} is outside 1..{max_rank}")
    if not math.isfinite(alpha) or alpha <= 0:
        raise AdapterImportError(f"lora_alpha={alpha} must be a positive number")
    if cfg.get("use_rslora"):
        alpha = alpha * math.sqrt(r)  # rsLoRA scales by alpha/sqrt(r); a plain alpha' = alpha*sqrt(r) matches
    targets = cfg.get("target_modules")
    listed = [targets] if isinstance(targets, str) else list(targets or [])
    unknown = [t for t in listed if t not in supported and isinstance(targets, list)]
    if unknown:
        raise AdapterImportError(f"target modules {unknown} are not supported (supported: {list(supported)})")
    return r, alpha


def import_peft_dir(
    path: str | Path,
    *,
    expected_base_model: str | None = None,
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
    supported_modules: Sequence[str] = SUPPORTED_TARGETS,
    max_rank: int = 64,
) -> AdapterWeights:
    """Read and validate a PEFT LoRA directory (see module docstring). Tensors come back as float32."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(path)
    if not d.is_dir():
        raise AdapterImportError(f"{d} is not a directory")
    cfg = _config(d)
    r, alpha = _check_config(cfg, supported_modules, max_rank)
    weights_path = d / WEIGHTS_FILE
    if not weights_path.is_file():
        if (d / "adapter_model.bin").exists():
            raise AdapterImportError("adapter_model.bin (pickle) is refused; save the adapter as safetensors")
        raise AdapterImportError(f"{d} has no {WEIGHTS_FILE}")
    try:
        raw = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterImportError(f"{weights_path} is not a readable safetensors file: {exc}") from None

    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    for key, t in raw.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterImportError(f"tensor {key!r} is not a LoRA A/B weight of a PEFT causal-LM adapter")
        module_name = m["module"].rsplit(".", 1)[-1]
        if module_name not in supported_modules:
            raise AdapterImportError(f"tensor {key!r} targets {module_name!r}, which is not supported")
        if t.dim() != 2:
            raise AdapterImportError(f"tensor {key!r} has {t.dim()} dimensions, expected 2")
        if not torch.isfinite(t).all():
            raise AdapterImportError(f"tensor {key!r} holds NaN or Inf values")
        canonical = f"{PEFT_PREFIX}{m['module']}.lora_{m['which']}.weight"
        if canonical in tensors:
            raise AdapterImportError(f"tensor {canonical!r} appears twice (several adapters in one file?)")
        tensors[canonical] = t.to(torch.float32).contiguous()
        modules.add(module_name)
    if not tensors:
        raise AdapterImportError(f"{weights_path} holds no LoRA tensors")
    for key, t in tensors.items():
        if key.endswith(".lora_A.weight"):
            b_key = key.replace(".lora_A.weight", ".lora_B.weight")
            b = tensors.get(b_key)
            if b is None:
                raise AdapterImportError(f"{key} has no matching lora_B")
            if t.shape[0] != r or b.shape[1] != r:
                raise AdapterImportError(
                    f"{key}: rank {t.shape[0]}/{b.shape[1]} differs from r={r} in the config"
                )
        elif key.replace(".lora_B.weight", ".lora_A.weight") not in tensors:
            raise AdapterImportError(f"{key} has no matching lora_A")
    if expected_shapes is not None:
        check_shapes({k: tuple(v.shape) for k, v in tensors.items()}, expected_shapes)
    base_model = str(cfg.get("base_model_name_or_path") or "")
    if expected_base_model is not None:
        if base_model and not same_base_model(base_model, expected_base_model):
            raise AdapterImportError(
                f"adapter was trained on {base_model!r}, "
                f"not on the expected base model {expected_base_model!r}"
            )
        base_model = expected_base_model
    ordered = tuple(m for m in supported_modules if m in modules)
    return AdapterWeights(
        tensors=tensors, spec=LoraSpec(r=r, alpha=alpha, target_modules=ordered), base_model=base_model
    )


def check_shapes(got: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> None:
    """Raise AdapterImportError unless `got` has exactly the tensor names and shapes of `expected`."""
    if set(expected) != set(got):
        missing = sorted(set(expected) - set(got))[:3]
        extra = sorted(set(got) - set(expected))[:3]
        raise AdapterImportError(f"tensors differ from the adapter's (missing {missing}, extra {extra})")
    for k, shape in expected.items():
        if tuple(got[k]) != tuple(shape):
            raise AdapterImportError(f"{k} has shape {tuple(got[k])}, expected {tuple(shape)}")


def export_peft_dir(
    source: bytes | AdapterWeights, out_dir: str | Path, base_model: str | None = None
) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` for `PeftModel.from_pretrained`."""
    from safetensors.torch import save_file

    weights = decode_adapter(source) if isinstance(source, bytes | bytearray) else source
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = base_model or weights.base_model
    (out / CONFIG_FILE).write_text(
        json.dumps(weights.spec.peft_config(model), indent=2) + "\n", encoding="utf-8"
    )
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in sorted(weights.tensors.items())}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out
