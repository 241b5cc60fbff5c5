"""Where each test module belongs, and the paths that still name a module's old place.

    .venv/bin/python tests/support/place.py               # `git mv` lines for tests/test_*.py
    .venv/bin/python tests/support/place.py --move        # do them, paths from __file__ too
    .venv/bin/python tests/support/place.py --references  # old paths named in the tree
    .venv/bin/python tests/support/place.py --fix-references
    .venv/bin/python tests/support/place.py --fix-imports      # names that left test modules

A test module at the top of tests/ (not in a tier folder) is collected, and each of its
tests' tier read from the fixtures it uses (tiers.needed_tier); the module belongs in the
folder of its most demanding test, or in acceptance/ when it starts `derivd` itself
(tiers.module_tier). Run from the repository's root.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from tiers import TESTS, TIERS, highest, module_tier, needed_tier

ROOT = TESTS.parent
SUPPORT = TESTS / "support"
# Where the shared modules were before tests/support.
SHARED = (
    "fixtures/",
    "helpers.py",
    "configs.py",
    "faulthandlers.py",
    "imagegen.py",
    "fidelity.py",
    "pdfgen.py",
    "videogen.py",
)
MOVED_SHARED = {f"tests/{name}": f"tests/support/{name}" for name in SHARED}


def _names(module: str, names: str) -> dict[tuple[str, str], str]:
    test_module, _, support = module.partition(" -> ")
    return {(test_module, name): support for name in names.split()}


# What test modules exported to others before tests/support: the module it lives in now
# ("" for a fixture, which tests/conftest.py registers: no import needed).
MOVED_NAMES = {
    **_names("test_supervisor -> fixtures.daemon", "FAST DaemonRun kinds processing_rows"),
    **_names("test_supervisor -> ", "supervisor"),
    **_names(
        "test_handlers -> fixtures.pixels",
        "BACKENDS SPEC PARITY_MAD MISTAKE_MAD CMYK_UNPROFILED READY_CASES decode mad"
        " riff_chunks reference",
    ),
    **_names("test_handlers -> ", "handler"),
    **_names("test_handlers_decoding -> fixtures.pixels", "RAISE_IF_DECODED never_decoded"),
    **_names("test_handlers_heic -> fixtures.corpus", "HEIC READY REJECTED"),
    **_names("test_dashboard -> fixtures.pages", "Cells"),
    **_names("test_dashboard_browser -> fixtures.pages", "browser screenshot"),
    **_names(
        "test_webhooks_delivery -> fixtures.delivering",
        "SECRET KEY VARIANT endpoint delivering ready_files rows settled",
    ),
    **_names("test_pipeline -> fixtures.work", "enqueue_bytes"),
    **_names(
        "test_backfill -> fixtures.backfill",
        "BACKEND V1 V2 apply config configured drain job_rows readable_set ready_files sweep"
        " unreferenced variant_set",
    ),
    **_names("test_backfill -> ", "store"),
    **_names("test_heartbeat -> fixtures.work", "HOST"),
    **_names("test_analysis_stored -> fixtures.analysis", "PHOTO"),
    **_names("test_previews -> pdfgen", "HOSTILE_PDFS"),
    **_names("test_previews -> videogen", "HOSTILE_VIDEOS"),
}


def fix_imports(path: Path) -> list[str]:
    """Rewrite `from test_x import a, b` in `path` to the tests/support modules that hold
    `a` and `b` now; what is left unknown, for a person to move."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    unknown: list[str] = []
    for node in sorted(ast.walk(ast.parse("".join(lines))), key=_line, reverse=True):
        if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("test_")):
            continue
        by_module: dict[str, list[str]] = defaultdict(list)
        for alias in node.names:
            home = MOVED_NAMES.get((node.module or "", alias.name))
            if home is None:
                unknown.append(f"{path.relative_to(ROOT)}: {node.module}.{alias.name}")
                home = node.module or ""
            if home:
                by_module[home].append(alias.name)
        indent = " " * node.col_offset
        new = [f"{indent}from {m} import {', '.join(sorted(n))}\n" for m, n in by_module.items()]
        lines[node.lineno - 1 : node.end_lineno] = new
    if "".join(lines) != text:
        path.write_text("".join(lines), encoding="utf-8")
    return unknown


def _line(node: ast.AST) -> int:
    return getattr(node, "lineno", 0)


class _Tiers:
    """A pytest plugin that keeps, per collected module, the tiers its tests need."""

    def __init__(self) -> None:
        self.by_module: dict[Path, list[str]] = defaultdict(list)

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            self.by_module[item.path].append(needed_tier(item))


def placements(modules: list[Path]) -> dict[Path, str | None]:
    """Each module's tier folder (its most demanding test's tier), None for a module that
    cannot be collected (an import of a test module, of a name that moved...)."""
    recorder = _Tiers()
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main([*args, "--continue-on-collection-errors", *map(str, modules)],
                    plugins=[recorder])  # fmt: skip
    return {
        m: highest([module_tier(m), *recorder.by_module[m]]) if m in recorder.by_module else None
        for m in modules
    }


_FROM_FILE = re.compile(
    r"Path\(__file__\)(\.resolve\(\))?(?:((?:\.parent(?!s))+)|\.parents\[(\d+)\])"
)


def one_level_deeper(source: str) -> str:
    """`source` with every path it computes from its own file (Path(__file__).parent,
    .parents[n]) reaching one folder further up: what a move into a tier folder needs."""

    def deeper(match: re.Match[str]) -> str:
        levels = match[2].count(".parent") if match[2] else int(match[3]) + 1
        return f"Path(__file__){match[1] or ''}.parents[{levels}]"

    return _FROM_FILE.sub(deeper, source)


def move(module: Path, tier: str) -> Path:
    """`git mv` into the tier folder, then the paths it computes from its file adjusted."""
    target = TESTS / tier / module.name
    subprocess.run(["git", "mv", str(module), str(target)], cwd=ROOT, check=True)
    text = target.read_text(encoding="utf-8")
    if one_level_deeper(text) != text:
        target.write_text(one_level_deeper(text), encoding="utf-8")
    return target


def tier_folders() -> dict[str, str]:
    """`test_x.py` -> `tests/<tier>/test_x.py` for every placed module."""
    return {
        path.name: path.relative_to(ROOT).as_posix()
        for tier in TIERS
        for path in sorted((TESTS / tier).glob("test_*.py"))
    }


def stale_references(text: str, moved: dict[str, str]) -> list[tuple[str, str]]:
    """(old, new) for each old path `text` names: a test module's or a shared module's."""
    found = []
    for match in re.finditer(r"tests/(?:(?:unit|integration|acceptance)/)?(test_\w+\.py)", text):
        new = moved.get(match.group(1))
        if new is not None and new != match.group(0):
            found.append((match.group(0), new))
    found += [(old, new) for old, new in MOVED_SHARED.items() if re.search(_old(old), text)]
    return found


def _old(path: str) -> str:
    # Not when already under a tier folder or tests/support (tests/support/fixtures/...).
    return r"(?<![\w/])" + re.escape(path)


def tracked_text_files() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.cfg", "*.toml", "*.ini", "*.sh", "Makefile"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / n for n in names]


def references(fix: bool) -> int:
    moved = tier_folders()
    count = 0
    for path in tracked_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        pairs = stale_references(text, moved)
        for old, new in pairs:
            print(f"{path.relative_to(ROOT)}: {old} -> {new}")
            text = re.sub(_old(old), new, text)
        count += len(pairs)
        if fix and pairs:
            path.write_text(text, encoding="utf-8")
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--move", action="store_true", help="git mv each module into place")
    parser.add_argument("--references", action="store_true", help="list old paths named")
    parser.add_argument("--fix-references", action="store_true", help="rewrite them")
    parser.add_argument("--fix-imports", action="store_true", help="from test_x import ...")
    args = parser.parse_args()
    if args.fix_imports:
        for path in sorted(TESTS.rglob("*.py")):
            for name in fix_imports(path):
                print(f"{name}: not moved yet; move it into tests/support")
        return 0
    if args.references or args.fix_references:
        references(fix=args.fix_references)
        return 0
    for shared in sorted(set(TESTS.glob("*.py")) - set(TESTS.glob("test_*.py"))):
        if shared.name != "conftest.py":  # a module the tests share: tests/support
            print(f"git mv {shared.relative_to(ROOT)} tests/support/")
    unplaced = sorted(TESTS.glob("test_*.py"))
    for module, tier in placements(unplaced).items():
        name = module.relative_to(ROOT)
        if tier is None:
            print(f"# {name}: not collected; `.venv/bin/pytest --collect-only {name}` says why")
        elif args.move:
            print(f"{name} -> {move(module, tier).relative_to(ROOT)}")
        else:
            print(f"git mv {name} tests/{tier}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
