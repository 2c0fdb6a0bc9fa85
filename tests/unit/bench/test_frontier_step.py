"""The step-load run's table and figure, from a result file's content (`collm_bench.frontier.step`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from collm_bench.frontier import step

pytestmark = pytest.mark.unit


def doc() -> dict:
    def series(atts: list[float | None]) -> list[dict]:
        # A minute without requests has no attainment.
        return [
            {"t_min": float(i), "load": 0.3, "attainment": a, "requests": 0 if a is None else 10,
             "headroom": 1.0, "spend": 0.5, "total_share": 2.0}
            for i, a in enumerate(atts)
        ]  # fmt: skip

    return {
        "trace": {"label": "test"},
        "config": {"replicas": 4, "load_fractions": [0.3, 0.7], "step_s": 120.0, "default_target": 0.95},
        "runs": [
            {
                "knob": "target 0.95 (default)",
                "core": {},
                "ft_tokens": 1234,
                "series": series([1, 0.9, 0.5, 0.7]),
            },
            {
                "knob": "target 0.9",
                "core": {"attainment_target": 0.9},
                "ft_tokens": 5,
                "series": series([1, 1, 1, None]),
            },  # fmt: skip
        ],
    }


def test_the_table_has_each_phase_all_and_settled_the_lowest_minute_and_tokens() -> None:
    lines = step.table(doc()).splitlines()
    assert lines[0] == "| collm | 0.3 | 0.7 | lowest minute | fine-tuning tokens |"
    assert lines[2] == "| target 0.95 (default) | 0.950 / 0.900 | 0.600 / 0.700 | 0.50 | 1,234 |"
    # A minute without requests counts in neither its phase nor the lowest minute ("-": none at all).
    assert lines[3] == "| target 0.9 | 1.000 / 1.000 | 1.000 / - | 1.00 | 5 |"


def test_the_figure_is_drawn(tmp_path: Path) -> None:
    path = step.plot(doc(), tmp_path / "step.png")
    assert path.stat().st_size > 1000
