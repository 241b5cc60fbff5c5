"""INI as people write it (DESIGN.md "Configuration"): comments on their own line or after
a value following whitespace, `#` or `;`. Every ```ini block of the README and docs/ and
every INI file in etc/ that is a derivd configuration passes `derivd config check` as
written (with the environment variables its `secret_env` settings name)."""

from __future__ import annotations

import configparser
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from derivd.config import SECTIONS
from derivd.config_load import load_config
from derivd.webhooks.endpoints import SECTION_PREFIX as WEBHOOK_PREFIX

RunCli = Callable[..., subprocess.CompletedProcess[str]]
ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```ini[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SECRET = "whsec_" + "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="


def documented() -> Iterator[tuple[str, str]]:
    """(where, text) of every ```ini block in README.md and docs/**/*.md, and every
    etc/*.ini file: globbed, so pages that move or appear are read too."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 2
            yield f"{page.relative_to(ROOT)}:{line}", match.group(1)
    for path in sorted((ROOT / "etc").glob("*.ini")):
        yield str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")


def is_derivd_config(text: str) -> bool:
    """Whether a block names any of derivd's sections: one that names none is another
    program's file (setup.cfg, pgbouncer.ini) shown beside derivd's."""
    parser = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=("#", ";"))
    try:
        parser.read_string(text)
    except configparser.Error:
        return True  # unreadable: config check says why
    return any(
        s in SECTIONS or s.startswith(("variant:", WEBHOOK_PREFIX)) for s in parser.sections()
    )


BLOCKS = [(where, text) for where, text in documented() if is_derivd_config(text)]


def test_the_docs_hold_derivd_configs_to_check() -> None:
    assert BLOCKS, "no ```ini block or etc/*.ini of derivd's was found"


@pytest.mark.parametrize(("where", "text"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_each_documented_config_passes_config_check_as_written(
    where: str, text: str, tmp_path: Path, run_cli: RunCli
) -> None:
    ini = tmp_path / "derivd.ini"
    ini.write_text(text, encoding="utf-8")
    env = {name: SECRET for name in re.findall(r"^secret_env\s*=\s*(\w+)", text, re.MULTILINE)}
    checked = run_cli("-c", str(ini), "config", "check", env=env, cwd=tmp_path)
    assert checked.returncode == 0, f"{where}:\n{checked.stderr}"


def test_inline_comments_after_whitespace_are_comments(tmp_path: Path) -> None:
    ini = tmp_path / "derivd.ini"
    ini.write_text(
        "[webhook:app]  ; the app's receiver\n"
        "url = https://api.example.com/hooks#part   # a fragment is no comment\n"
        f"secret = {SECRET}\n"
        "events = file.ready, file.rejected  # default: all four\n"
        "tenants =                          # empty: every tenant's files\n"
        "[queue]\n"
        "lease = 60 ; seconds\n",
        encoding="utf-8",
    )
    config = load_config(ini, required=True)
    [endpoint] = config.webhooks
    assert endpoint.url == "https://api.example.com/hooks#part"
    assert endpoint.events == ("file.ready", "file.rejected")
    assert endpoint.tenants == ()  # every tenant, not one named "# empty: ..."
    assert config.queue.lease == 60
