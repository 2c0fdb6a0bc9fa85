"""One renderer per result kind: the name a region's marker gives, the table (and plots) drawn from its files.

A table function takes the parsed result files of a region, in the marker's order; a plots function
takes one parsed file and returns, per name suffix, what draws it (the PNG lands beside the file as
`<name><suffix>.png`). All of them are pure functions of the JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collm_bench import adaptation, chaos
from collm_bench.frontier import render as frontier
from collm_bench.frontier import robust as frontier_robust
from collm_bench.frontier import step as frontier_step
from collm_bench.peer import table as peer

from . import engine, faults, federated, gate, gateway, sim

Doc = Mapping[str, Any]
Table = Callable[[Sequence[Doc]], str]
Plots = Callable[[Doc], Mapping[str, Callable[[Path], Any]]]


@dataclass(frozen=True)
class Kind:
    """A result kind: its table over the region's files, how many files it takes, its plots of each file."""

    table: Table
    files: int | None = 1  # None: any number, at least one
    plots: Plots | None = None


def _one(render: Callable[[Doc], str]) -> Table:
    """A table of a single result file."""

    def table(docs: Sequence[Doc]) -> str:
        return render(docs[0])

    return table


def _one_plot(draw: Callable[[Doc, Path], Any]) -> Plots:
    """One plot per result file, `draw(doc, path)`, named after the file."""

    def plots(doc: Doc) -> dict[str, Callable[[Path], Any]]:
        return {"": lambda path: draw(doc, path)}

    return plots


KINDS: dict[str, Kind] = {
    "adaptation": Kind(_one(adaptation.table), plots=_one_plot(adaptation.plot)),
    "gate-noise": Kind(_one(gate.table)),
    "gateway-overhead": Kind(gateway.overhead_table, files=None),
    "gateway-overload": Kind(_one(gateway.overload_table)),
    "sim-speed": Kind(_one(sim.speed_table)),
    "sim-routing": Kind(_one(sim.routing_table)),
    "engine-summary": Kind(engine.summary_table, files=None),
    "engine-concurrency": Kind(_one(engine.concurrency_table)),
    "engine-coexec": Kind(_one(engine.coexec_table)),
    "engine-profile": Kind(_one(engine.profile_table)),
    "engine-threads": Kind(_one(engine.threads_table)),
    "engine-structured": Kind(engine.structured_table, files=2),
    "calibration": Kind(engine.calibration_table, files=None),
    "faults-scenarios": Kind(_one(lambda doc: faults.scenarios_table(doc["reports"]))),
    "faults-supervision": Kind(_one(faults.supervision_table)),
    "faults-chaos": Kind(_one(chaos.table)),
    "federated-synthetic": Kind(_one(federated.synthetic_table)),
    "frontier": Kind(frontier.goals_table, files=None, plots=_one_plot(frontier.plot)),
    "frontier-step": Kind(_one(frontier_step.table), plots=_one_plot(frontier_step.plot)),
    "frontier-robust": Kind(_one(frontier_robust.table), plots=_one_plot(frontier_robust.plot)),
    "peer-llamacpp": Kind(_one(peer.table)),
}


class KindError(ValueError):
    """A region naming an unknown kind, or the wrong number of files for its kind."""


def kind_for(name: str, files: int) -> Kind:
    kind = KINDS.get(name)
    if kind is None:
        raise KindError(f"unknown table kind {name!r}; known: {', '.join(sorted(KINDS))}")
    if (kind.files is not None and files != kind.files) or files < 1:
        want = "one or more" if kind.files is None else str(kind.files)
        raise KindError(f"table kind {name!r} takes {want} result file(s), got {files}")
    return kind


def plot_paths(kind: Kind, path: str, doc: Doc) -> list[str]:
    """Where the plots of one result file go: beside it, `<name><suffix>.png`."""
    if kind.plots is None:
        return []
    stem = path.removesuffix(".json")
    return [f"{stem}{suffix}.png" for suffix in kind.plots(doc)]
