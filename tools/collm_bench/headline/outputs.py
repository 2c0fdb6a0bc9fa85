"""The headline's outputs from its results document: each rate's comparison of the policies, `table.md`
and `headline.png` beside `results.json` (and as `latest.*`), and `--render` of a finished run."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, TextIO

from .plot import plot
from .setup import SetupError
from .table import compare, markdown


def compare_block(block: dict[str, Any]) -> None:
    """Ratios and goals of one rate's runs (live, with the simulator's error; else simulated only)."""
    live = {p: e["live"] for p, e in block["runs"].items() if e.get("live")}
    sims = {p: e["sim"] for p, e in block["runs"].items() if e.get("sim")}
    if live:
        block["compare"] = compare(live, sims or None)
    else:
        block["compare"] = compare(sims, None) | {"simulated_only": True}


def probe_note(results: dict[str, Any]) -> str:
    """What the table's header says of the speed probes (before the runs, and after them if one ran);
    nothing without a probe."""
    probe = (results.get("calibration") or {}).get("speed_probe")
    if not probe:
        return ""
    after = (results.get("calibration") or {}).get("speed_probe_after")
    then = f" and {after['factor']:.2f}x in one after them" if after else ""
    kinds = probe.get("kind_factors")
    how = "by that"  # results of the benchmark before costs were scaled by kind
    if kinds:
        decode = " / ".join(
            f"{float(f):.2f}" for _, f in sorted(kinds["decode"].items(), key=lambda x: int(x[0]))
        )
        batches = " / ".join(str(b) for b in sorted(int(b) for b in kinds["decode"]))
        how = (
            f"by kind: prefill {kinds['prefill']:.2f}, decode at batch {batches} {decode}, "
            f"training {kinds['train']:.2f}"
        )
    return (
        f"; the engine's step times {probe['factor']:.2f}x the calibration's (median) in a probe before the "
        f"runs, its costs scaled {how}{then}"
    )


def write_outputs(results: dict[str, Any], root: Path, latest_dir: Path | None, out: TextIO) -> None:
    """table.md and headline.png beside results.json (and as latest.* in `latest_dir`); prints the table."""
    cfg = results["config"]
    started = time.strftime("%Y-%m-%d %H:%M", time.localtime(results.get("started_unix_s", time.time())))
    header = (
        f"Command: `{results['command']}` ({started}, {results.get('wall_s', 0.0) / 60:.1f} min; "
        f"model {cfg['model']}, {cfg['replicas']} replicas, {cfg['duration_s']:g} s of arrivals per run, "
        f"seed {cfg['seed']}" + probe_note(results) + ")\n\n"
    )
    table = markdown(results)
    (root / "table.md").write_text(header + table + "\n", encoding="utf-8")
    png = plot(results, root / "headline.png")
    if latest_dir is not None:
        shutil.copyfile(root / "table.md", latest_dir / "latest.md")
        if png is not None:
            shutil.copyfile(png, latest_dir / "latest.png")
    out.write("\n" + header + table + "\n\n")
    out.write(f"[headline] {root / 'results.json'}\n")
    if png is not None:
        out.write(f"[headline] {png}\n")


def render(path: Path, out: TextIO) -> int:
    """`--render`: recompute the comparisons of a finished run's results.json and write its outputs."""
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise SetupError(f"--render {path}: {exc}") from None
    for tr in results["traces"]:
        for block in tr["rates"].values():
            compare_block(block)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    write_outputs(results, path.parent, None, out)
    return 0
