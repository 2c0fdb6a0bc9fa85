"""One trace of the headline benchmark (`TraceRun`): its SLO, the rates not given (searched with the
simulator, `rates`), the calibration replay that fits the simulator's inference costs to this trace
(`replay`), then per rate every policy (`policy_run`). Its simulated runs are memoised (`TraceSims`)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collm_replica.naming import served_name
from collm_workload.workload import Slo

from . import setup
from .config import BASELINES
from .outputs import compare_block
from .policy_run import run_policy
from .predict import simulate_run
from .rates import BestBaseline, grid_counts, search_rate
from .replay import calibration_replay
from .replay_fit import EvalFit, with_inference_factor
from .setup import TraceSource

if TYPE_CHECKING:
    from .bench import Headline


class TraceSims:
    """The simulated runs of one trace (`predict.simulate_run`), memoised by (policy, request count, cost
    factor). What the calibration replay measured on this trace applies to every one: its inference cost
    factor (`replay_factor`), evaluation batches (`eval_fit`) and first round plans (`first_slow_s`)."""

    def __init__(self, bench: Headline, source: TraceSource, slo: Slo) -> None:
        self.bench, self.source, self.slo = bench, source, slo
        self.cache: dict[tuple[str, int, float | None], dict[str, Any]] = {}
        self.replay_factor = 1.0
        self.eval_fit: EvalFit | None = None
        self.first_slow_s: float | None = None

    def __call__(
        self, policy: str, n: int, factor: float | None = None, step_logs_dir: Path | None = None
    ) -> dict[str, Any]:
        """The simulated run; with `factor`, on the calibration as measured with every cost times that
        (an end of the speed probe's range) instead of scaled by kind; either with the replay's factor.
        With `step_logs_dir`, simulated again (not cached) with its replicas' step logs written there."""
        if (policy, n, factor) in self.cache and step_logs_dir is None:
            return self.cache[policy, n, factor]
        bench, cfg = self.bench, self.bench.cfg
        cal = bench.cal if factor is None else bench.unscaled_cal
        assert cal is not None
        if factor is not None:
            cal = cal.scaled(factor)
        if self.replay_factor != 1.0:
            cal = with_inference_factor(cal, self.replay_factor)
        rate = n / cfg.duration_s
        run = simulate_run(
            cfg,
            cal,
            self.source,
            rate,
            self.slo,
            policy,
            bench.samples,
            step_logs_dir,
            self.eval_fit,
            self.first_slow_s,
        )
        if step_logs_dir is None:
            self.cache[policy, n, factor] = run
        return run


class TraceRun:
    """Everything run for one trace; `tr` is its entry in the results document, `prediction_cal` the
    costs its predictions use (the calibration, times the replay's factor once fitted)."""

    def __init__(self, bench: Headline, source: TraceSource) -> None:
        cfg = bench.cfg
        self.bench, self.source = bench, source
        self.slo = setup.slo_for(cfg, source, bench.cal, bench.max_batch)
        label = source.label(cfg)
        self.tr: dict[str, Any] = {
            "trace": source.name,
            "label": label,
            "path": str(source.path) if source.path else None,
            "slo": dataclasses.asdict(self.slo),
            "rates": {},
        }
        bench.results["traces"].append(self.tr)
        bench.say(f"{label}: SLO TTFT {self.slo.ttft_ms:.0f} ms, TPOT {self.slo.tpot_ms:.0f} ms")
        self.sims = TraceSims(bench, source, self.slo)
        self.prediction_cal = bench.cal

    def note(self, line: str) -> None:
        """A note on this trace's runs: kept in its `notes` and said."""
        self.tr.setdefault("notes", []).append(line)
        self.bench.say(line)

    def run(self) -> None:
        bench = self.bench
        choices = self.timed_search("rate search")
        if self.calibration_replay_wanted():
            fitted = calibration_replay(self, self._replay_rate(choices))
            if fitted is not None:
                self.sims.replay_factor = fitted
                assert bench.cal is not None
                self.prediction_cal = with_inference_factor(bench.cal, fitted)
                self.sims.cache.clear()
                choices = self.timed_search(f"rate search again, inference costs x{fitted:.3f}")
        for lab in bench.cfg.rate_labels:
            self.run_rate(lab, choices)

    def timed_search(self, what: str) -> dict[str, dict[str, Any]]:
        """`search`, and (when it searched) what it took, said as `what`."""
        t_search = time.monotonic()
        choices = self.search()
        if choices:
            self.bench.say(
                f"{what}: {time.monotonic() - t_search:.1f} s ({len(self.sims.cache)} simulations)"
            )
        return choices

    def run_rate(self, lab: str, choices: dict[str, dict[str, Any]]) -> None:
        """Every policy at rate `lab` (given, else searched; none: nothing runs), unless another rate of
        this trace is the same request count."""
        bench, cfg, tr = self.bench, self.bench.cfg, self.tr
        rate = cfg.rates.get(lab, choices.get(lab, {}).get("rate_rps"))
        if rate is None:
            return
        n = max(1, round(rate * cfg.duration_s))
        same = [k for k, b in tr["rates"].items() if b["n_requests"] == n]
        if same:
            # A slice is its request count: the same count is the same replay, run once.
            self.note(f"{lab} and {same[0]} are the same {n} requests in {cfg.duration_s:g} s: run once")
            return
        block: dict[str, Any] = {"rate_rps": n / cfg.duration_s, "n_requests": n, "runs": {}}
        block.update({"choice": choices[lab]} if lab in choices else {"given": True})
        tr["rates"][lab] = block
        plan = []
        if bench.builder is not None:
            plan = setup.build_plan(cfg, self.source, block["rate_rps"], bench.builder, self.slo)
            block["plan"] = setup.plan_stats(plan)
        for policy in cfg.policies:
            block["runs"][policy] = run_policy(self, lab, block, policy, plan)
            bench.save()
        compare_block(block)
        bench.save()

    def calibration_replay_wanted(self) -> bool:
        """A calibration replay is of use: live runs, the simulator, and a calibration of this model."""
        cfg, cal = self.bench.cfg, self.bench.cal
        return (
            cfg.calibration_replay
            and cfg.live
            and cfg.simulate
            and cal is not None
            and cal.model == served_name(cfg.model)
        )

    def _replay_rate(self, choices: dict[str, dict[str, Any]]) -> float | None:
        """The calibration replay's rate: the light rate (searched or given), else the first one run."""
        cfg = self.bench.cfg
        for lab in ("light", *cfg.rate_labels):
            rate = cfg.rates.get(lab, choices.get(lab, {}).get("rate_rps"))
            if rate is not None:
                return float(rate)
        return None

    def search(self) -> dict[str, dict[str, Any]]:
        """The rates not given on the command line, found with the simulator (`rates`)."""
        bench, cfg, cal = self.bench, self.bench.cfg, self.bench.cal
        if not cfg.needs_search():
            return {}
        assert cal is not None
        cap = setup.capacity_rps(cfg, cal, self.source, bench.max_batch)
        grid = grid_counts(cap, cfg.duration_s, cfg.rate_grid_fractions)
        best = BestBaseline(lambda p, n: self.sims(p, n)["summary"]["attainment"] or 0.0, BASELINES)
        targets = {"light": cfg.light_attainment, "heavy": cfg.heavy_attainment}
        out = {}
        for lab in cfg.needs_search():
            c = search_rate(best, lab, targets[lab], grid, cfg.duration_s, nearest=lab == "heavy")
            out[lab] = c.as_dict() | {"capacity_estimate_rps": cap, "grid_requests": grid}
            bench.say(
                f"{lab} rate {c.rate_rps:.3f} req/s ({c.n_requests} requests): {c.how}; "
                f"simulated {c.best_baseline} attains {c.attainment:.3f}"
            )
        return out
