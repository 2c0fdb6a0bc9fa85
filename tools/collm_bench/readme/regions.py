"""The marked regions of a results page and their regeneration (pure: text and parsed JSON in, text out)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

OPEN = re.compile(r"^<!-- table: (?P<kind>[a-z0-9-]+) (?P<paths>[^<>]+?) -->$", re.MULTILINE)
CLOSE_LINE = re.compile(r"^<!-- /table -->$", re.MULTILINE)


class PageError(ValueError):
    """A results page whose markers cannot be read: unclosed, nested or malformed regions."""


@dataclass(frozen=True)
class Region:
    """One marked region: the renderer's kind, the result files (repository paths) and where its body lies."""

    kind: str
    paths: tuple[str, ...]
    body_start: int  # the first character after the opening marker's line
    body_end: int  # the first character of the closing marker


def find_regions(text: str) -> list[Region]:
    """Every marked region of `text`, in order. Raises PageError on a marker without its partner or on a
    region that opens inside another."""
    regions: list[Region] = []
    for m in OPEN.finditer(text):
        body_start = m.end() + 1
        close = CLOSE_LINE.search(text, m.end())
        following = OPEN.search(text, m.end())
        if close is None or (following is not None and following.start() < close.start()):
            raise PageError(f"line {_line(text, m.start())}: table region {m['kind']} is not closed")
        regions.append(
            Region(m["kind"], marker_paths(m["paths"]), min(body_start, close.start()), close.start())
        )
    stray = len(CLOSE_LINE.findall(text)) - len(regions)
    if stray:
        raise PageError(f"{stray} closing table marker(s) without an opening one")
    return regions


def marker_paths(spec: str) -> tuple[str, ...]:
    """The result files an opening marker names: repository paths, or, after a folder (a token ending in
    `/`), names within that folder (`bench/results/x/ a.json b.json` names `bench/results/x/a.json` and
    `bench/results/x/b.json`); a token with a `/` of its own is a path again."""
    folder, out = "", []
    for token in spec.split():
        if token.endswith("/"):
            folder = token
        else:
            out.append(token if "/" in token else folder + token)
    return tuple(out)


def _line(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def notes_of(doc: Mapping[str, Any]) -> list[str]:
    """A result file's `notes`: what a reader of its figures must know about how they were measured."""
    notes = doc.get("notes") or []
    if isinstance(notes, str) or not all(isinstance(n, str) for n in notes):
        raise PageError(f"`notes` must be a list of strings, not {notes!r}")
    return list(notes)


def footer(paths: Sequence[str], plots: Sequence[str], notes: Sequence[str] = ()) -> str:
    """The lines under a table: the result files it came from (more than three in one folder: counted,
    the region's marker names them), the plots drawn from them (more than two, one beside each file:
    said once; `python -m collm_bench readme --plots` draws them, as the page's head says), their notes."""
    folders = {p.rsplit("/", 1)[0] for p in paths}
    if len(paths) > 3 and len(folders) == 1:
        lines = [f"Result files: {len(paths)} under `{folders.pop()}/` (the region's marker names them)."]
    else:
        files = ", ".join(f"`{p}`" for p in paths)
        lines = [f"Result file{'s' if len(paths) > 1 else ''}: {files}."]
    beside = [p.removesuffix(".json") + ".png" for p in paths]
    if plots and len(plots) > 2 and list(plots) == beside:
        lines.append("Plots: one beside each file, `.png`.")
    elif plots:
        drawn = ", ".join(f"`{p}`" for p in plots)
        lines.append(f"Plot{'s' if len(plots) > 1 else ''}: {drawn}.")
    lines += [f"Note: {n}." if not n.endswith(".") else f"Note: {n}" for n in notes]
    return "\n".join(lines)


def render_region(
    table: Callable[[Sequence[Mapping[str, Any]]], str],
    paths: Sequence[str],
    docs: Sequence[Mapping[str, Any]],
    plots: Sequence[str],
) -> str:
    """A region's body: the table, a blank line, then the footer."""
    notes = [n for doc in docs for n in notes_of(doc)]
    return f"{table(docs).rstrip()}\n\n{footer(paths, plots, notes)}\n"


def fill(text: str, body_of: Callable[[Region], str]) -> str:
    """`text` with every region's body replaced by `body_of(region)`; the rest kept byte for byte."""
    out: list[str] = []
    pos = 0
    for region in find_regions(text):
        out.append(text[pos : region.body_start])
        out.append(body_of(region))
        pos = region.body_end
    out.append(text[pos:])
    return "".join(out)
