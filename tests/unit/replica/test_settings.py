"""Replica settings validate at construction and describe every field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from collm_replica.engine import EngineConfig
from collm_replica.settings import ReplicaSettings


def test_defaults_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLLM_REPLICA_ID", "edge-7")
    monkeypatch.setenv("COLLM_MODEL", "tiny")
    monkeypatch.setenv("COLLM_LORA_TARGET_MODULES", "q_proj,v_proj")
    s = ReplicaSettings()
    assert s.replica_id == "edge-7" and s.model == "tiny" and s.torch_threads == 1
    assert s.lora_spec.target_modules == ("q_proj", "v_proj") and s.lora_spec.r == 8
    cfg = EngineConfig.from_settings(s)
    assert cfg.replica_id == "edge-7" and cfg.batch.max_batch == s.max_batch
    assert cfg.lora_targets == ("q_proj", "v_proj")


@pytest.mark.parametrize(
    "kw",
    [
        {"replica_id": "bad id"},
        {"lora_target_modules": "q_proj,lm_head"},
        {"lora_r": 32, "lora_max_rank": 16},
        {"train_micro_tokens": 1024, "train_batch_tokens": 512},
        {"ft_share_default": 1.5},
    ],
)
def test_invalid_settings_are_refused(kw: dict) -> None:
    with pytest.raises(ValidationError):
        ReplicaSettings(**kw)


def test_every_field_is_documented() -> None:
    missing = [n for n, f in ReplicaSettings.model_fields.items() if not f.description]
    assert missing == []


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "want"),
    [(False, False, "float32"), (True, False, "bfloat16"), (False, True, "bfloat16")],
)
def test_auto_matmul_dtype_is_bf16_only_where_the_cpu_multiplies_bf16_natively(
    monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx: bool, want: str
) -> None:
    import torch

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert ReplicaSettings().matmul_dtype == want  # the default is auto
    assert ReplicaSettings(matmul_dtype="float32").matmul_dtype == "float32"  # an explicit choice holds
    assert ReplicaSettings(matmul_dtype="bfloat16").matmul_dtype == "bfloat16"


@pytest.mark.parametrize(
    ("flags", "bf16", "want"),
    [
        ({"avx2", "f16c", "fma"}, False, 3),  # an AVX2 CPU multiplying fp32: fp16 copies for steps <= 3
        ({"avx2", "f16c"}, True, 0),  # native bf16 products: off
        ({"avx2"}, False, 0),  # no fp16 loads: off
        (set(), False, 0),  # no /proc/cpuinfo flags (not Linux, not x86): off
    ],
)
def test_auto_small_step_f16_rows_only_where_fp16_copies_pay(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], bf16: bool, want: int
) -> None:
    import torch

    from collm_replica import settings

    monkeypatch.setattr(settings, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert ReplicaSettings().small_step_f16_rows == want  # the default is auto (-1)
    assert ReplicaSettings(small_step_f16_rows=0).small_step_f16_rows == 0  # an explicit choice holds
    assert ReplicaSettings(small_step_f16_rows=5).small_step_f16_rows == 5
    assert EngineConfig.from_settings(ReplicaSettings(small_step_f16_rows=2)).small_step_f16_rows == 2


def test_this_hosts_cpu_flags_are_read() -> None:
    import platform
    from pathlib import Path

    from collm_replica.settings import cpu_flags

    if not Path("/proc/cpuinfo").is_file() or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("flags are read from an x86 Linux /proc/cpuinfo")
    assert "sse2" in cpu_flags()  # every x86-64 CPU has SSE2
