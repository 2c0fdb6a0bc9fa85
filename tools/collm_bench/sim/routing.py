"""collm with and without publishing its routing weights to the gateway (the default is not to publish).

    flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench sim routing-check \\
        --calibration bench/calibration/smollm2.json

Conv trace, 8 replicas, seed 0, at fractions of the estimated capacity;
prints goodput, attainment and fine-tuning tokens for `publish_weights` false (the gateway routes
least-loaded) and true (the gateway's weighted draw on the coordinator's weights), and writes
`bench/results/sim/routing_check.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from collm_bench.experiment.rates import workload_capacity_rps
from collm_bench.groups import RESULTS, add_out, add_sim_trace, command_line, prog
from collm_bench.sim import load_calibration, workload_base
from collm_common.stats import percentile


def main(argv: Sequence[str]) -> int:
    """Simulate each fraction with and without published weights, write the result file."""
    ap = argparse.ArgumentParser(
        prog=prog("sim", "routing-check"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_sim_trace(ap)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--fractions", default="0.3,0.6,0.75,0.85")
    ap.add_argument("--duration", type=float, default=600.0)
    add_out(ap, RESULTS / "sim" / "routing_check.json")
    args = ap.parse_args(argv)

    from collm_sim import SimConfig, WorkloadSpec, build_workload, simulate
    from collm_sim.config import EngineSpec

    cal = load_calibration(args, "routing-check")
    if cal is None:
        return 2
    base = {**workload_base(args), "duration_s": args.duration}
    probe = build_workload(WorkloadSpec(**base, rate_rps=1.0), tuple(q.domain for q in cal.quality))
    eng = EngineSpec()
    ttft = 3.0 * cal.cost.prefill_ms(int(percentile(probe.input_tokens.tolist(), 99)))
    tpot = 3.0 * cal.cost.decode_ms(eng.max_batch)
    cap = workload_capacity_rps(cal, probe, eng.max_batch, args.replicas)
    rows = []
    for frac in [float(x) for x in args.fractions.split(",")]:
        rate = round(cap * frac, 3)
        for publish in (False, True):
            wl = WorkloadSpec(**base, rate_rps=rate, ttft_slo_ms=ttft, tpot_slo_ms=tpot)
            cfg = SimConfig(
                replicas=args.replicas, policy="collm", workload=wl, core={"publish_weights": publish}
            )
            res = simulate(cfg, cal)
            row = {
                "rate_rps": rate,
                "publish_weights": publish,
                "goodput_rps": res.summary["goodput_rps"],
                "attainment": res.summary["attainment"],
                "ft_tokens": res.sim["ft_tokens"],
                "ttft_ms_p99": res.summary["latency_ms"]["ttft"]["p99"],
            }
            rows.append(row)
            sys.stdout.write(
                f"rate {rate:7.3f}  publish_weights={str(publish):5}  goodput {row['goodput_rps']:.3f}  "
                f"attainment {row['attainment']:.3f}  ft tokens {row['ft_tokens']}  "
                f"TTFT p99 {row['ttft_ms_p99']:.0f} ms\n"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": command_line(["sim", "routing-check", *argv], lock=True), "runs": rows}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0
