"""The README and docs/ hold together: the map names paths that exist, every link leads
somewhere, the README stays an overview, and no page speaks of how it was made."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
MAP = DOCS / "map.md"
PAGES = [
    REPO / "README.md",
    *sorted(DOCS.glob("*.md")),
    REPO / "bench" / "README.md",
    REPO / "bench" / "RESULTS.md",
]
# What a newcomer asks for first: each has its one line in the map.
TARGETS = (
    "claim",
    "commit",
    "worker loop",
    "pipelined worker",
    "dead-worker decision",
    "sweep",
    "backfill",
    "tenant cap",
    "HEIC decode",
    "analysis",
    "webhook delivery",
    "config",
)
# A path of the tree: folders and files with an extension, as the map writes them.
PATH = re.compile(r"`((?:supervisor|handlers|sql|harness|tests|bench|etc|docs)/[\w./-]*)`")


def map_paths(text: str) -> list[str]:
    return PATH.findall(text)


def test_the_map_answers_each_question_in_one_line() -> None:
    lines = MAP.read_text(encoding="utf-8").splitlines()
    for target in TARGETS:
        (line,) = [x for x in lines if x.startswith(f"- **{target}**")]
        assert map_paths(line), f"{target}: no path named"


def test_every_path_the_map_names_exists() -> None:
    named = map_paths(MAP.read_text(encoding="utf-8"))
    assert len(named) > len(TARGETS)
    missing = [path for path in named if not (REPO / path).exists()]
    assert missing == []


def test_the_path_pattern_sees_a_missing_file() -> None:
    (path,) = map_paths("- **x**: `supervisor/no_such_module.py`, `derivd.queue`")
    assert not (REPO / path).exists()


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_between_pages_leads_somewhere(page: Path) -> None:
    for target in links(page):
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        assert where.exists(), f"{page.name}: {target}"
        if anchor and where.suffix == ".md":
            assert anchor in anchors(where), f"{page.name}: {target}"


def anchors(page: Path) -> set[str]:
    """GitHub's anchors: headings lower-cased, punctuation dropped, spaces as '-'."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_the_readme_is_an_overview_that_links_the_map() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    assert "(docs/map.md)" in readme


# Pages describe derivd, not the work that made it.
DIARY = re.compile(r"\bsittings?\b|\bstop \d+\b|\bissue \d+|#\d{2,}\b", re.I)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_speaks_of_how_it_was_made(page: Path) -> None:
    assert DIARY.findall(page.read_text(encoding="utf-8")) == []


# The code speaks of the project only, as the pages do: every source, SQL, configuration
# and build file in the tree but this test module (which holds the pattern's examples).
# Code writes colours as `#808080`, so `#NN` is left to the pages' pattern.
CODE_DIARY = re.compile(r"\bsittings?\b|\bstop \d+\b|\bissue \d+", re.I)
SOURCES = ("*.py", "*.sql", "*.ini", "*.cfg", "*.toml", "*.sh", "*.js", "*.mjs", "Makefile")
SKIP_DIRS = {".venv", "build", "node_modules", ".builds", "var", ".git"}


def _sources() -> list[Path]:
    found = {p for pattern in SOURCES for p in REPO.rglob(pattern)}
    return sorted(
        p for p in found
        if not SKIP_DIRS & set(p.relative_to(REPO).parts) and p != Path(__file__).resolve()
    )  # fmt: skip


def test_no_source_file_speaks_of_how_it_was_made() -> None:
    said = {
        str(p.relative_to(REPO)): hits
        for p in _sources()
        if (hits := CODE_DIARY.findall(p.read_text(encoding="utf-8", errors="replace")))
    }
    assert said == {}


def test_the_diary_pattern_sees_what_it_must() -> None:
    assert DIARY.findall("the Sitting of 2026-12-06, stop 40, issue 28") != []


# bench/: helpers are not benchmarks of their own (the chaos runs live in harness/).
NOT_LISTED = {"common", "plots", "results"}


def test_bench_readme_lists_every_benchmark_and_only_those() -> None:
    bench = REPO / "bench"
    text = (bench / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `(\w+)\.py` \|", text, re.M))
    scripts = {path.stem for path in bench.glob("*.py")} - NOT_LISTED - {"latency_proxy"}
    assert listed == scripts
