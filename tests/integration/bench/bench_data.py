"""Made-up inputs of the benchmark harness tests: a short Azure-format trace and small domain datasets
(the real ones live outside the repository, so the tests run anywhere)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

TRACE = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(
    f"2023-11-16 18:17:{i:02d}.2500000,{200 + 40 * (i % 9)},{30 + 10 * (i % 5)}" for i in range(40)
)


def dataset(root: Path, domain: str) -> Path:
    for split, n in (("train", 24), ("eval", 6)):
        rows = [
            {"id": f"{domain}-{split}-{i}", "domain": domain, "prompt": f"A {domain} question number {i}?",
             "response": f"The {domain} answer is {i * 7}."}
            for i in range(n)
        ]  # fmt: skip
        (root / domain / split).mkdir(parents=True, exist_ok=True)
        (root / domain / split / f"{domain}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root / domain


def harness_inputs(root: Path) -> list[str]:
    """The trace and both domains' datasets written under `root`, as the harness's flags."""
    trace = root / "trace.csv"
    trace.write_text(TRACE)
    math, medical = dataset(root, "math"), dataset(root, "medical")
    return ["--trace", str(trace), "--data", f"math={math}", "--data", f"medical={medical}"]


def run_harness(command: str, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`python -m collm_bench <command> <argv>` from the repository root, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "collm_bench", command, *argv],
        capture_output=True, text=True, timeout=timeout_s, check=False, cwd=REPO,
    )  # fmt: skip
