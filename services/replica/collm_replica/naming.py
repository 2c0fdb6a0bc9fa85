"""The model id a replica serves for a `COLLM_MODEL` spec (no torch import: the launcher uses it too)."""

from __future__ import annotations

from pathlib import Path

SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def served_name(spec: str) -> str:
    """tiny -> tiny, smollm2 -> SmolLM2-135M-Instruct, a .gguf file -> its stem, a directory -> its name."""
    if spec in ("tiny", "smollm2"):
        return "tiny" if spec == "tiny" else SMOLLM2_NAME
    path = Path(spec).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name
