"""`python -m collm_bench readme`: regenerate bench/README.md's tables from the committed result files.

python -m collm_bench readme            # rewrite every marked table of bench/README.md
python -m collm_bench readme --check    # exit 1 (and show the difference) when the page is not current
python -m collm_bench readme --plots    # also draw the plots beside their result files (PNG, gitignored)
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, TextIO

from .kinds import KindError
from .page import plots, regenerate
from .regions import PageError

REPO = Path(__file__).resolve().parents[3]
PAGE = Path("bench") / "README.md"


class ResultFileError(ValueError):
    """A result file a region names that is missing or not JSON."""


def loader(root: Path) -> Any:
    """Parsed JSON by repository path, each file read once."""

    @cache
    def load(path: str) -> Mapping[str, Any]:
        try:
            return json.loads((root / path).read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ResultFileError(f"{path}: no such result file") from e
        except json.JSONDecodeError as e:
            raise ResultFileError(f"{path}: not JSON ({e})") from e

    return load


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m collm_bench readme",
        description="Regenerate the marked tables of a results page from the result files they name.",
    )
    p.add_argument(
        "--root", type=Path, default=REPO, help="repository root (result paths are relative to it)"
    )
    p.add_argument("--page", type=Path, default=PAGE, help="the page, relative to --root")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 when the page differs")
    p.add_argument("--plots", action="store_true", help="also draw every plot beside its result file")
    return p


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    import sys

    out, err = out or sys.stdout, err or sys.stderr
    args = build_parser().parse_args(argv)
    page = args.root / args.page
    load = loader(args.root)
    try:
        text = page.read_text(encoding="utf-8")
        new = regenerate(text, load)
        if args.check:
            if new != text:
                diff = difflib.unified_diff(
                    text.splitlines(keepends=True),
                    new.splitlines(keepends=True),
                    str(args.page),
                    "regenerated",
                )
                err.write("".join(diff))
                err.write(
                    f"{args.page} is not what its result files give: run python -m collm_bench readme\n"
                )
                return 1
            out.write(f"{args.page}: every table matches its result files\n")
        elif new != text:
            page.write_text(new, encoding="utf-8")
            out.write(f"{args.page}: tables regenerated\n")
        else:
            out.write(f"{args.page}: already current\n")
        if args.plots:
            for png, draw in plots(new, load):
                draw(args.root / png)
                out.write(f"drew {png}\n")
    except (OSError, PageError, KindError, ResultFileError) as e:
        err.write(f"collm-bench readme: {e}\n")
        return 2
    return 0
