"""`collm status` shows a local launcher's supervised processes (supervision.json), crash loops first."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from collm_ops.status import (
    ClusterStatus,
    read_supervision,
    render_status,
    status_document,
    supervision_lines,
)

pytestmark = pytest.mark.unit

DOC = {
    "supervising": True,
    "launcher_pid": 42,
    "crash_looping": ["replica-r1"],
    "services": {
        "nats": {"pid": 100, "restarts": 1, "last_exit": "killed by SIGKILL"},
        "redis": {"pid": 101, "restarts": 0},
        "replica-r1": {"pid": None, "restarts": 5, "last_exit": "exit code 3"},
    },
}


def test_processes_are_listed_with_crash_loops_first(tmp_path: Path) -> None:
    (tmp_path / "supervision.json").write_text(json.dumps(DOC))
    doc = read_supervision(tmp_path)
    lines = supervision_lines(doc)
    assert lines[0].startswith("processes (launcher pid 42, supervising: True)")
    assert lines[1] == "  replica-r1: CRASH LOOP, pid -, restarts 5, last exit exit code 3"
    assert lines[2] == "  nats: running, pid 100, restarts 1, last exit killed by SIGKILL"
    assert lines[3] == "  redis: running, pid 101, restarts 0"
    status = ClusterStatus(ts_unix_s=time.time(), supervision=doc)
    assert render_status(status).endswith("\n".join(lines))
    assert status_document(status)["supervision"] == DOC


def test_no_or_unreadable_file_shows_nothing(tmp_path: Path) -> None:
    assert read_supervision(tmp_path) is None and supervision_lines(None) == []
    (tmp_path / "supervision.json").write_text("{not json")
    assert read_supervision(tmp_path) is None
