"""docs/configuring.md and etc/derivd.ini are what the declarations give (`make docs`)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from derivd.config import SECTIONS, VariantSettings, WebhookSettings
from derivd.config_docs import main, render_markdown

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "configuring.md"


def test_the_settings_page_is_current() -> None:
    assert PAGE.read_text(encoding="utf-8") == render_markdown(), "run `make docs`"


def test_every_setting_has_a_row_under_its_section() -> None:
    text = render_markdown()
    named = {"variant:NAME": VariantSettings, "webhook:NAME": WebhookSettings}
    for section, settings in {**SECTIONS, **named}.items():
        body = text.split(f"\n## [{section}]\n", 1)[1].split("\n## ", 1)[0]
        for spec in fields(settings):
            assert f"\n| `{spec.name}` |" in body, f"[{section}] {spec.name}"


def test_a_default_with_a_bar_stays_in_its_cell() -> None:
    rows = [line for line in render_markdown().splitlines() if line.startswith("| `")]
    assert rows and all(line.replace("\\|", "").count("|") == 5 for line in rows)


def test_main_writes_what_it_is_asked_for_and_refuses_the_rest(tmp_path: Path) -> None:
    page, ini = tmp_path / "configuring.md", tmp_path / "derivd.ini"
    assert main([str(page), str(ini)]) == 0
    assert page.read_text(encoding="utf-8") == render_markdown()
    assert ini.read_text(encoding="utf-8") == (REPO / "etc" / "derivd.ini").read_text("utf-8")
    assert main([str(tmp_path / "other.md")]) == 2
    assert not (tmp_path / "other.md").exists()


@pytest.mark.parametrize("section", [*SECTIONS])
def test_each_fixed_section_says_what_it_is_about(section: str) -> None:
    about = render_markdown().split(f"\n## [{section}]\n\n", 1)[1].split("\n", 1)[0]
    assert about and not about.startswith("|")
