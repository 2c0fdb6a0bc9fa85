"""A simulated frontier's work as it is done, and what a later run of the same plan keeps of it.

A simulated frontier at 256 replicas takes hours of one core: serving alone's rate search (up to nine
one-hour windows) and then a window per knob. `Progress` writes what is done to a partial file after
every simulated run (each probe of the rate search, each point), so a run that is stopped loses at
most the run in flight; `kept_from` reads a partial file, or the result file of an earlier run, and
says which probes and points of this run it already holds:

    python -m collm_bench frontier --sim --replicas 256 ... --resume OUT/sim-code-256r-alone0.9.partial.json

An earlier run's work stands only for the same plan (`SIM_PLAN`: replicas, windows, rounds, SLOs,
domains, lengths, seed, calibration, and the trace); its points only at the same offered rate.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .points import Knob

PARTIAL_SCHEMA = "collm-frontier-partial/1"
# The configuration entries that must be equal for an earlier simulated run's work to stand in this one.
SIM_PLAN = (
    "replicas",
    "window_s",
    "drain_s",
    "rounds",
    "round_deadline_s",
    "slo",
    "domains",
    "input_scale",
    "output_scale",
    "seed",
    "calibration",
)


def check_same_plan(
    prior: Mapping[str, Any], trace: str, config: Mapping[str, Any], keys: Sequence[str]
) -> None:
    """Raises ValueError, saying what differs, unless the earlier run `prior` replayed `trace` with the
    configuration entries `keys` equal to this run's `config`."""
    if prior.get("trace", {}).get("name") != trace:
        raise ValueError(f"it replayed trace {prior.get('trace', {}).get('name')!r}, this run {trace!r}")
    theirs = prior.get("config", {})
    for key in keys:
        if theirs.get(key) != config.get(key):
            raise ValueError(f"its {key} is {theirs.get(key)!r}, this run's {config.get(key)!r}")


def probe_key(frac: float) -> str:
    """The key of a rate-search probe at `frac` x the capacity estimate (JSON keys are strings)."""
    return f"{frac:.6g}"


@dataclass
class Kept:
    """What an earlier run lends this one: serving alone's attainment per probed fraction of the capacity
    estimate (`probe_key`), and each kept point's run (its `point` inside) by (policy, knob label), with
    the offered rate those points ran at."""

    probes: dict[str, float] = field(default_factory=dict)
    runs: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    rate_rps: float | None = None

    def runs_at(self, rate_rps: float) -> dict[tuple[str, str], dict[str, Any]]:
        """The kept points' runs if they ran at `rate_rps`, else none."""
        return self.runs if self.rate_rps == rate_rps else {}


def _runs_of(prior: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each point's run with its point inside, from a partial file or a result file."""
    if prior.get("schema") == PARTIAL_SCHEMA:
        return [dict(r) for r in prior.get("runs", [])]
    runs = prior.get("runs") or [{}] * len(prior.get("points", []))
    return [{**r, "point": p} for p, r in zip(prior.get("points", []), runs, strict=False)]


def kept_from(prior: Mapping[str, Any], trace: str, config: Mapping[str, Any], knobs: Sequence[Knob]) -> Kept:
    """What `prior` (a partial file of `Progress`, or a simulated frontier's result file) holds of this
    run: its probes, and its points of `knobs`. Raises ValueError when it is not a simulated frontier,
    replayed another trace, or differs from `config` in an entry of `SIM_PLAN`."""
    if prior.get("schema") != PARTIAL_SCHEMA and prior.get("mode") != "sim":
        raise ValueError("not a simulated frontier's result or partial file")
    check_same_plan(prior, trace, config, SIM_PLAN)
    theirs = prior.get("config", {})
    wanted = {(k.policy, k.label) for k in knobs}
    runs = {
        (r["point"]["policy"], r["point"]["knob"]): r
        for r in _runs_of(prior)
        if (r.get("point", {}).get("policy"), r.get("point", {}).get("knob")) in wanted
    }
    probes = {str(k): float(v) for k, v in (theirs.get("alone_probes") or {}).items()}
    return Kept(probes=probes, runs=runs, rate_rps=theirs.get("rate_rps"))


@dataclass
class Progress:
    """The partial file of a simulated frontier in progress (`PARTIAL_SCHEMA`), rewritten after every
    probe and point; none is written without a `path`."""

    path: Path | None
    trace: dict[str, Any]
    config: dict[str, Any]
    runs: list[dict[str, Any]] = field(default_factory=list)

    def probe(self, frac: float, attainment: float) -> None:
        """Serving alone attained `attainment` at `frac` x the capacity estimate."""
        self.config.setdefault("alone_probes", {})[probe_key(frac)] = attainment
        self.save()

    def point(self, run: Mapping[str, Any]) -> None:
        """A point's run (its `point` inside) is done."""
        self.runs.append(dict(run))
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        doc = {"schema": PARTIAL_SCHEMA, "trace": self.trace, "config": self.config, "runs": self.runs}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        tmp.replace(self.path)
