"""docs/settings.md's tables are generated from the settings classes and must match them; the README starts
with the two commands."""

from pathlib import Path

import pytest

from collm_ops.settings_doc import all_env_names, splice

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
SETTINGS = ROOT / "docs" / "settings.md"


def test_settings_block_is_current() -> None:
    text = SETTINGS.read_text()
    assert splice(text) == text, "run: .venv/bin/python -m collm_ops.settings_doc --write docs/settings.md"


def test_settings_page_names_every_setting() -> None:
    text = SETTINGS.read_text()
    missing = sorted(n for n in all_env_names() if f"`{n}`" not in text)
    assert not missing, missing


def test_readme_starts_with_the_two_commands() -> None:
    lines = [ln for ln in README.read_text().splitlines() if ln.strip()]
    block = lines[lines.index("```") + 1 : lines.index("```") + 3]
    assert block[0].startswith("make up") and block[1].startswith("make test")
