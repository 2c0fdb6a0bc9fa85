"""`collm_bench sim speed`'s flags: one duration per size, else a usage error before any file is read."""

from __future__ import annotations

import pytest

from collm_bench.sim import speed


def test_sizes_and_durations_of_different_lengths_are_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        speed.main(["--calibration", "no-such-file.json", "--sizes", "8,64"])
    assert exc.value.code == 2
    assert "--duration needs one value per size: 2 sizes, 3 durations" in capsys.readouterr().err
