"""The machine a benchmark ran on, as its result files record it: figures of CPU-bound runs compare only
between hosts of one kind (the vector extensions decide the replicas' matmul precision and speed)."""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The vector extensions llama.cpp and torch pick their kernels by.
CPU_FLAGS = ("avx2", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")


def host_info() -> dict[str, Any]:
    """This machine: its CPU's model name, its CPUs, which of `CPU_FLAGS` it has, the Python version."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    pairs = (ln.partition(":") for ln in text.splitlines())
    info = {k.strip(): v.strip() for k, sep, v in pairs if sep}
    return {
        "cpu": info.get("model name", platform.processor() or "unknown"),
        "cpus": os.cpu_count(),
        "flags": [f for f in CPU_FLAGS if f in info.get("flags", "").split()],
        "python": platform.python_version(),
    }


def host_line(host: Mapping[str, Any]) -> str:
    """`AMD EPYC (2 CPUs; float32 products, fp16 copies for steps of <= 3 tokens; CPU: avx2, f16c)`: a host
    in one line, for a results table, with the replicas' precision where the result recorded it
    (`matmul_dtype`, `small_step_f16_rows`)."""
    dtype = host.get("matmul_dtype")
    products = f"{products_phrase(dtype, host.get('small_step_f16_rows'))}; " if dtype else ""
    return f"{host.get('cpu', 'unknown')} ({host.get('cpus', '?')} CPUs; {products}CPU: {flags_phrase(host)})"


def products_phrase(matmul_dtype: str, small_step_f16_rows: int | None) -> str:
    """`float32 products, fp16 copies for steps of <= 3 tokens`: the replicas' precision in words."""
    small = f", fp16 copies for steps of <= {small_step_f16_rows} tokens" if small_step_f16_rows else ""
    return f"{matmul_dtype} products{small}"


def flags_phrase(host: Mapping[str, Any]) -> str:
    """The recorded CPU flags, comma-separated."""
    return ", ".join(host.get("flags", ())) or "none of those recorded"
