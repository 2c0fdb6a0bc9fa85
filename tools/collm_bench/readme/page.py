"""A results page regenerated from its result files (pure, given a loader of parsed JSON by path)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .kinds import kind_for, plot_paths
from .regions import Region, fill, find_regions, render_region

Load = Callable[[str], Mapping[str, Any]]


def render(region: Region, load: Load) -> str:
    """One region's body from its files: its kind's table, then the files and the plots it names."""
    kind = kind_for(region.kind, len(region.paths))
    docs = [load(p) for p in region.paths]
    plots = [png for p, doc in zip(region.paths, docs, strict=True) for png in plot_paths(kind, p, doc)]
    return render_region(kind.table, region.paths, docs, plots)


def regenerate(text: str, load: Load) -> str:
    """The page with every marked table rendered again from its result files."""
    return fill(text, lambda region: render(region, load))


def result_paths(text: str) -> list[str]:
    """Every result file the page's regions name, in order, each once."""
    return list(dict.fromkeys(p for region in find_regions(text) for p in region.paths))


def plots(text: str, load: Load) -> Iterator[tuple[str, Callable[[Path], Any]]]:
    """(repository path of the PNG, what draws it) for every plot of every region's result files."""
    for region in find_regions(text):
        kind = kind_for(region.kind, len(region.paths))
        if kind.plots is None:
            continue
        for path in region.paths:
            doc = load(path)
            draws = kind.plots(doc)
            yield from zip(plot_paths(kind, path, doc), draws.values(), strict=True)
