"""`python -m collm_bench GROUP NAME`: every registered benchmark imports and answers `--help`; the
group alone lists its names; an unknown name is a usage error; result files record the command."""

from __future__ import annotations

import importlib
import io
import json
from pathlib import Path

import pytest

from collm_bench.cli import main as cli_main
from collm_bench.groups import GROUPS, command_line
from collm_bench.groups import main as group_main

pytestmark = pytest.mark.unit

COMMANDS = [(group, name) for group, names in GROUPS.items() for name in names]


@pytest.mark.parametrize(("group", "name"), COMMANDS, ids=[f"{g}-{n}" for g, n in COMMANDS])
def test_every_benchmark_answers_help(group: str, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert callable(importlib.import_module(GROUPS[group][name].module).main)
    with pytest.raises(SystemExit) as exit_info:
        cli_main([group, name, "--help"])
    assert exit_info.value.code == 0
    assert f"python -m collm_bench {group}" in capsys.readouterr().out


@pytest.mark.parametrize("group", list(GROUPS))
def test_a_group_lists_its_names(group: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert group_main(group, ["--help"], out, err) == 0
    assert all(f"  {name} " in out.getvalue() for name in GROUPS[group])
    assert group_main(group, [], out, err) == 2  # no name: the list, as a usage error
    assert "names:" in err.getvalue()


def test_an_unknown_name_is_a_usage_error() -> None:
    out, err = io.StringIO(), io.StringIO()
    assert cli_main(["engine", "no-such-benchmark"], out, err) == 2
    assert "no benchmark 'no-such-benchmark'" in err.getvalue()
    assert out.getvalue() == ""


def test_the_recorded_command_names_the_package_and_its_arguments() -> None:
    assert command_line(["gate", "noise", "--tokens", "1024"]) == (
        ".venv/bin/python -m collm_bench gate noise --tokens 1024"
    )
    assert command_line(["engine", "threads"], lock=True) == (
        "flock /tmp/collm-heavy.lock .venv/bin/python -m collm_bench engine threads"
    )


def test_a_benchmark_records_its_command_in_its_result(shared_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    argv = ["sim", "speed", "--sizes", "2", "--duration", "20", "--traces-dir", str(shared_data / "traces")]
    argv += ["--out", str(out)]
    assert cli_main(argv, io.StringIO(), io.StringIO()) == 0
    doc = json.loads(out.read_text())
    assert doc["command"] == command_line(argv, lock=True)
    assert [run["replicas"] for run in doc["runs"]] == [2]
