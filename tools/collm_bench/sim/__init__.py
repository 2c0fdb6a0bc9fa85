"""The simulator's own benchmarks: `python -m collm_bench sim speed|routing-check` (`collm_bench.groups`).
Both replay a trace (prompts x0.25, outputs x0.5: `workload_base`) under a calibration
(`load_calibration`) and write bench/results/sim/<name>.json."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from collm_common.calibration import Calibration


def workload_base(args: argparse.Namespace) -> dict[str, Any]:
    """The `WorkloadSpec` fields both benchmarks share: trace arrivals of `--trace`, prompts scaled by
    0.25 and outputs by 0.5, within a 2048-token context."""
    return {"arrivals": "trace", "trace": args.trace, "traces_dir": str(args.traces_dir), "input_scale": 0.25,
            "output_scale": 0.5, "max_context_tokens": 2048}  # fmt: skip


def load_calibration(args: argparse.Namespace, name: str) -> Calibration | None:
    """`--calibration`, or None after saying on stderr why it cannot be read."""
    from collm_sim.cli import CalibrationMissing
    from collm_sim.cli import load_calibration as load

    try:
        return load(args.calibration)
    except CalibrationMissing as exc:
        sys.stderr.write(f"{name}: {exc}\n")
        return None
