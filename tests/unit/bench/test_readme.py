"""bench/README.md against its result files, and the regions machinery that regenerates it."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from collm_bench.readme import cli, regions
from collm_bench.readme.kinds import KINDS, KindError, kind_for
from collm_bench.readme.page import regenerate, result_paths

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
PAGE = REPO / "bench" / "README.md"
MAX_PAGE_BYTES = 30 * 1024
MAX_RESULT_BYTES = 100 * 1024


def test_every_table_of_the_page_is_what_its_result_files_give() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert regions.find_regions(text), "bench/README.md has no marked table"
    assert regenerate(text, cli.loader(REPO)) == text, "run: python -m collm_bench readme"


def test_the_page_stays_a_results_page() -> None:
    assert PAGE.stat().st_size <= MAX_PAGE_BYTES


def test_every_result_file_the_page_names_is_there_small_and_committable() -> None:
    paths = result_paths(PAGE.read_text(encoding="utf-8"))
    assert paths
    for path in paths:
        file = REPO / path
        assert file.is_file(), path
        assert file.stat().st_size < MAX_RESULT_BYTES, f"{path}: {file.stat().st_size} bytes"
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: whether the files are ignored cannot be asked")
    ignored = subprocess.run(
        ["git", "-C", str(REPO), "check-ignore", *paths], capture_output=True, text=True, check=False
    )
    assert ignored.stdout == "", f"ignored by git: {ignored.stdout}"


def test_generated_files_under_bench_results_are_ignored_and_summaries_are_not() -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    probes = {
        "bench/results/engine/x.json": False,
        "bench/results/adaptation/idle.png": True,
        "bench/results/headline/20260101-000000/results.json": True,
        "bench/results/headline/20260101-000000/collm/requests.jsonl": True,
        "bench/results/x.json": True,
    }
    out = subprocess.run(
        ["git", "-C", str(REPO), "check-ignore", "--no-index", *probes],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    assert {p: p in out for p in probes} == probes


PAGE_TEXT = """# Page

Before.

<!-- table: sim-speed bench/results/sim/speed.json -->
stale
<!-- /table -->

Between.

<!-- table: gateway-overhead bench/results/gateway/a.json bench/results/gateway/b.json -->
<!-- /table -->
After.
"""

SPEED = {"runs": [{"replicas": 8, "rate_rps": 2.0, "sim_time_s": 600.0, "wall_s": 1.5,
                   "sim_seconds_per_wall_second": 400.0, "iterations": 10}],
         "notes": ["one note"]}  # fmt: skip
OVERHEAD = {
    "replica_model": "tiny",
    "requests": 10,
    "direct_nats": {"median_ms": 1.0, "p99_ms": 2.0},
    "via_gateway": {"median_ms": 3.0, "p99_ms": 4.0},
    "added_ms": {"median": 2.0, "p99": 2.0},
    "paired_added_ms": {"median": 2.1, "p99": 2.5},
    "ratio": {"median": 3.0, "p99": 2.0},
}
DOCS = {
    "bench/results/sim/speed.json": SPEED,
    "bench/results/gateway/a.json": OVERHEAD,
    "bench/results/gateway/b.json": OVERHEAD | {"replica_model": "other"},
}


def test_regions_are_filled_from_their_files_and_the_rest_is_kept() -> None:
    out = regenerate(PAGE_TEXT, DOCS.__getitem__)
    assert "stale" not in out
    assert out.startswith(
        "# Page\n\nBefore.\n\n<!-- table: sim-speed bench/results/sim/speed.json -->\n| replicas |"
    )
    assert "| 8 | 2.00 | 600 | 1.5 | 400.0 | 10 |" in out
    assert "Result file: `bench/results/sim/speed.json`.\nNote: one note.\n<!-- /table -->\n\nBetween." in out
    assert "| tiny | 10 |" in out and "| other | 10 |" in out
    assert "Result files: `bench/results/gateway/a.json`, `bench/results/gateway/b.json`." in out
    assert out.endswith("<!-- /table -->\nAfter.\n")
    assert regenerate(out, DOCS.__getitem__) == out
    assert result_paths(out) == list(DOCS)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- table: sim-speed a.json -->\nno end\n", "is not closed"),
        (
            "<!-- table: sim-speed a.json -->\n<!-- table: sim-speed b.json -->\n<!-- /table -->\n",
            "not closed",
        ),
        ("text\n<!-- /table -->\n", "without an opening"),
    ],
)
def test_broken_markers_are_refused(text: str, message: str) -> None:
    with pytest.raises(regions.PageError, match=message):
        regions.find_regions(text)


def test_a_marker_inside_a_line_is_prose_not_a_region() -> None:
    assert regions.find_regions("see `<!-- table: KIND FILE -->` and `<!-- /table -->`\n") == []


def test_unknown_kinds_and_wrong_file_counts_are_refused() -> None:
    with pytest.raises(KindError, match="unknown table kind"):
        kind_for("nope", 1)
    with pytest.raises(KindError, match="takes 1 result file"):
        kind_for("sim-speed", 2)
    assert kind_for("engine-summary", 6) is KINDS["engine-summary"]


def test_notes_must_be_a_list_of_strings() -> None:
    with pytest.raises(regions.PageError, match="list of strings"):
        regions.notes_of({"notes": "a string"})


def _copy_page(tmp_path: Path, text: str) -> None:
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "README.md").write_text(text, encoding="utf-8")
    for path in result_paths(text):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / path, tmp_path / path)


def test_check_fails_on_an_edited_table_and_the_command_repairs_it(tmp_path: Path) -> None:
    text = PAGE.read_text(encoding="utf-8")
    _copy_page(tmp_path, text)
    page = tmp_path / "bench" / "README.md"
    first = regions.find_regions(text)[0]
    page.write_text(text[: first.body_start] + "| edited |\n" + text[first.body_end :], encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["--root", str(tmp_path), "--check"], out, err) == 1
    assert "| edited |" in err.getvalue()
    assert cli.main(["--root", str(tmp_path)], out, err) == 0
    assert page.read_text(encoding="utf-8") == text
    assert cli.main(["--root", str(tmp_path), "--check"], out, err) == 0


def test_a_missing_result_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "README.md").write_text(PAGE_TEXT, encoding="utf-8")
    err = io.StringIO()
    assert cli.main(["--root", str(tmp_path)], io.StringIO(), err) == 2
    assert "bench/results/sim/speed.json: no such result file" in err.getvalue()


def test_plots_are_drawn_beside_their_result_file(tmp_path: Path) -> None:
    text = "<!-- table: adaptation bench/results/adaptation/idle.json -->\n<!-- /table -->\n"
    _copy_page(tmp_path, text)
    out = io.StringIO()
    assert cli.main(["--root", str(tmp_path), "--plots"], out, io.StringIO()) == 0
    png = tmp_path / "bench" / "results" / "adaptation" / "idle.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "`bench/results/adaptation/idle.png`" in (tmp_path / "bench" / "README.md").read_text()
    assert json.loads((tmp_path / "bench/results/adaptation/idle.json").read_text())["name"] == "idle"


def test_a_marker_names_files_by_path_or_within_the_folder_before_them() -> None:
    spec = "bench/results/x/ a.json b.json bench/results/y/c.json d.json bench/z/ e.json"
    assert regions.marker_paths(spec) == (
        "bench/results/x/a.json",
        "bench/results/x/b.json",
        "bench/results/y/c.json",
        "bench/results/x/d.json",
        "bench/z/e.json",
    )
    text = "<!-- table: frontier bench/results/frontier/ a.json b.json -->\n<!-- /table -->\n"
    (region,) = regions.find_regions(text)
    assert region.paths == ("bench/results/frontier/a.json", "bench/results/frontier/b.json")
