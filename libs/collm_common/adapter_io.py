"""Bringing LoRA adapters in and out: PEFT adapter directories <-> CoLLM adapter blobs.

`import_peft_dir(path)` reads `adapter_config.json` + `adapter_model.safetensors` (what
`PeftModel.save_pretrained` writes) and returns `AdapterWeights` ready for `encode_adapter`, after
checking that it is something a replica can serve: a plain LoRA (no DoRA, no bias, no
`modules_to_save`, no per-layer rank or alpha patterns), on supported target modules of a decoder
layer (`model.layers.N.self_attn.q_proj`, ...), with one rank no larger than `max_rank`, every A/B pair
complete, floating point, finite and shaped [r, in] / [out, r] with the same in/out features in every
layer, and, when asked, the expected base model and tensor shapes (`check_shapes`, `check_base_dims`).
rsLoRA's scaling (alpha / sqrt(r)) is folded into an equivalent plain alpha, so the served function is
unchanged. Pickled `adapter_model.bin` files are refused (they can run code when loaded); convert them
to safetensors first.

Every refusal is an `AdapterImportError` whose message says why: `AdapterNotFound` when the path names
nothing (missing, a missing or non-directory component, a symlink loop, a name too long),
`AdapterAccessDenied` when this process may not read it, the base class for content that is not an
adapter CoLLM can serve. Nothing else escapes for bad input.

`export_peft_dir(blob, out_dir)` writes a directory that `peft.PeftModel.from_pretrained` loads.
"""

from __future__ import annotations

import errno
import json
import math
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from collm_common.lora import PEFT_PREFIX, AdapterWeights, LoraSpec, decode_adapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
if TYPE_CHECKING:
    import torch

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A LoRA matrix of a decoder layer, as PEFT names it (an optional adapter name before `.weight`).
_KEY = re.compile(
    r"^base_model\.model\.(?P<module>model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<name>\w+))"
    r"\.lora_(?P<which>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$"
)
# Where each projection sits in a Llama-architecture decoder layer (what replicas serve).
MODULE_PARENTS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# The path names nothing: a missing file or component, a component that is not a directory, a symlink
# loop, a name longer than the file system allows.
_NOT_FOUND = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG)


class AdapterImportError(ValueError):
    """A directory that cannot be imported, with a reason fit for an error reply."""


class AdapterNotFound(AdapterImportError):
    """The path names nothing that exists."""


class AdapterAccessDenied(AdapterImportError):
    """The path exists, but this process may not read it."""


def shown(path: str | Path, limit: int = 160) -> str:
    """`path` for a message: a long one keeps its start and end, so that the reason after it survives
    an error header's length limit."""
    text = str(path)
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-limit // 3 :]}"


def path_error(directory: Path, exc: OSError) -> AdapterImportError:
    """An OS error met while reading the adapter `directory` (or a file in it), as the refusal that says
    what is wrong: nothing there, not readable, or not readable for another reason."""
    reason = exc.strerror or str(exc)
    failed = Path(exc.filename) if isinstance(exc.filename, str) else directory
    if failed == directory:
        what = "the path"
    else:
        what = shown(failed.relative_to(directory) if failed.is_relative_to(directory) else failed)
    if exc.errno in _NOT_FOUND:
        return AdapterNotFound(f"{what} does not exist ({reason})")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return AdapterAccessDenied(f"{what} is not readable by the aggregator ({reason})")
    return AdapterImportError(f"{what} cannot be read ({reason})")


def same_base_model(a: str, b: str) -> bool:
    """Whether two base-model names denote the same model: equal, or equal last path components
    (`HuggingFaceTB/SmolLM2-135M-Instruct` and `/models/SmolLM2-135M-Instruct`), case-insensitively."""
    if a == b:
        return True
    last = (a.rstrip("/").rsplit("/", 1)[-1].lower(), b.rstrip("/").rsplit("/", 1)[-1].lower())
    return bool(last[0]) and last[0] == last[1]


def _is_file(path: Path) -> bool:
    """Whether `path` is a regular file; missing is False, any other OS error propagates."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError as exc:
        if exc.errno in _NOT_FOUND:
            return False
        raise


def _config(path: Path) -> dict:
    cfg_path = path / CONFIG_FILE
    if not _is_file(cfg_path):
        raise AdapterImportError(f"no {CONFIG_FILE}: not a PEFT adapter directory")
    try:
        cfg = json.loads(cfg_path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8, bad JSON, an integer of too many digits
        raise AdapterImportError(f"{CONFIG_FILE} is not readable JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise AdapterImportError(f"{CONFIG_FILE} must hold a JSON object")
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
    except (KeyError, TypeError, ValueError, OverflowError):
        raise AdapterImportError("adapter_config.json needs an integer r and a numeric lora_alpha") from None
    if not 1 <= r <= max_rank:
        raise AdapterImportError(f"rank r={r} is outside 1..{max_rank}")
    if not math.isfinite(alpha) or alpha <= 0:
        raise AdapterImportError(f"lora_alpha={alpha} must be a positive number")
    if cfg.get("use_rslora"):
        alpha = alpha * math.sqrt(r)  # rsLoRA scales by alpha/sqrt(r); a plain alpha' = alpha*sqrt(r) matches
    targets = cfg.get("target_modules")
    if targets is not None and not isinstance(targets, str):
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise AdapterImportError(f"target_modules must be a list of module names, not {targets!r}")
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
    d = Path(path)
    try:
        cfg, raw = _read_dir(d)
    except OSError as exc:
        raise path_error(d, exc) from None
    r, alpha = _check_config(cfg, supported_modules, max_rank)
    tensors, modules = _lora_tensors(raw, supported_modules)
    _check_pairs(tensors, r)
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


def _read_dir(d: Path) -> tuple[dict, bytes]:
    """(config, raw safetensors bytes) of a PEFT directory; OS errors propagate."""
    if not stat.S_ISDIR(d.stat().st_mode):
        raise AdapterImportError("the path is a file, not a PEFT adapter directory")
    cfg = _config(d)
    weights_path = d / WEIGHTS_FILE
    if not _is_file(weights_path):
        if (d / "adapter_model.bin").exists():
            raise AdapterImportError("adapter_model.bin (pickle) is refused; save the adapter as safetensors")
        raise AdapterImportError(f"no {WEIGHTS_FILE} in the directory")
    return cfg, weights_path.read_bytes()


def _lora_tensors(raw: bytes, supported_modules: Sequence[str]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The decoded LoRA matrices under their canonical names, and the module names they target."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        loaded = load(raw)
    except (SafetensorError, ValueError, TypeError, RuntimeError) as exc:
        raise AdapterImportError(f"{WEIGHTS_FILE} is not a readable safetensors file: {exc}") from None
    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    for key, t in loaded.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterImportError(
                f"tensor {key!r} is not a LoRA A/B weight of a decoder layer "
                "(base_model.model.model.layers.N.<self_attn|mlp>.<module>.lora_A|lora_B.weight)"
            )
        module_name = m["name"]
        if module_name not in supported_modules:
            raise AdapterImportError(f"tensor {key!r} targets {module_name!r}, which is not supported")
        parent = MODULE_PARENTS.get(module_name)
        if parent is not None and m["parent"] != parent:
            raise AdapterImportError(f"tensor {key!r}: {module_name} belongs to {parent}, not {m['parent']}")
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in FLOAT_DTYPES:
            raise AdapterImportError(
                f"tensor {key!r} has dtype {dtype}, expected one of {list(FLOAT_DTYPES)}"
            )
        if t.dim() != 2:
            raise AdapterImportError(f"tensor {key!r} has {t.dim()} dimensions, expected 2")
        if 0 in t.shape:
            raise AdapterImportError(f"tensor {key!r} is empty (shape {tuple(t.shape)})")
        if not torch.isfinite(t).all():
            raise AdapterImportError(f"tensor {key!r} holds NaN or Inf values")
        canonical = f"{PEFT_PREFIX}{m['module']}.lora_{m['which']}.weight"
        if canonical in tensors:
            raise AdapterImportError(f"tensor {canonical!r} appears twice (several adapters in one file?)")
        tensors[canonical] = t.to(torch.float32).contiguous()
        modules.add(module_name)
    if not tensors:
        raise AdapterImportError(f"{WEIGHTS_FILE} holds no LoRA tensors")
    return tensors, modules


def _check_pairs(tensors: Mapping[str, torch.Tensor], r: int) -> None:
    """Every A has its B, both of rank r, and a module has the same in/out features in every layer."""
    for key, t in tensors.items():
        if key.endswith(".lora_A.weight"):
            b = tensors.get(key.replace(".lora_A.weight", ".lora_B.weight"))
            if b is None:
                raise AdapterImportError(f"{key} has no matching lora_B")
            if t.shape[0] != r or b.shape[1] != r:
                raise AdapterImportError(
                    f"{key}: rank {t.shape[0]}/{b.shape[1]} differs from r={r} in the config"
                )
        elif key.replace(".lora_B.weight", ".lora_A.weight") not in tensors:
            raise AdapterImportError(f"{key} has no matching lora_A")
    seen: dict[str, tuple[str, tuple[int, int]]] = {}
    for layer_module, dims in module_dims({k: tuple(v.shape) for k, v in tensors.items()}).items():
        name = layer_module.rsplit(".", 1)[-1]
        first = seen.setdefault(name, (layer_module, dims))
        if first[1] != dims:
            raise AdapterImportError(
                f"{layer_module} has in/out features {dims}, but {first[0]} has {first[1]}: "
                "a base model's layers all have the same shapes"
            )


def module_dims(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adapted module (`model.layers.N.self_attn.q_proj`), from the shapes of
    its complete A [r, in] / B [out, r] pair; what the base model fixes, whatever the rank."""
    out = {}
    for key, a in shapes.items():
        if not key.endswith(".lora_A.weight"):
            continue
        b = shapes.get(key.replace(".lora_A.weight", ".lora_B.weight"))
        if b is not None and len(a) == 2 and len(b) == 2:
            out[key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")] = (int(a[1]), int(b[0]))
    return out


def check_base_dims(got: Mapping[str, tuple[int, ...]], reference: Mapping[str, tuple[int, ...]]) -> None:
    """Raise AdapterImportError unless every module of `got` has the in/out features that `reference`,
    another adapter on the same base model, shows for that kind of module (`q_proj`, ...); the rank may
    differ, and modules the reference does not adapt are not checked."""
    known: dict[str, tuple[int, int]] = {}
    for layer_module, dims in module_dims(reference).items():
        known.setdefault(layer_module.rsplit(".", 1)[-1], dims)
    for layer_module, dims in sorted(module_dims(got).items()):
        want = known.get(layer_module.rsplit(".", 1)[-1])
        if want is not None and dims != want:
            raise AdapterImportError(
                f"{layer_module} has in/out features {dims}; the base model's are {want}"
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
