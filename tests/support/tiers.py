"""The suite's three tiers, one folder each under tests/: the tier a test needs and the one
it sits in.

unit: no services; integration: a real PostgreSQL and/or moto's S3 server (PgBouncer, fault
proxies in front of them); acceptance: the `derivd` process itself. The fixtures a test uses
(or an explicit `integration`/`acceptance` marker) set the tier it needs; it sits in that
tier's folder or a higher one, never a lower one (tests/conftest.py fails it first).
A module goes where its most demanding test does. `corpus` and `slow` are markers across
the tiers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TIERS = ("unit", "integration", "acceptance")
TESTS = Path(__file__).resolve().parents[1]

SERVICE_FIXTURES = frozenset(
    {
        "pg_root",
        "pg_cluster",
        "pg_template",
        "dsn",
        "s3_server",
        "s3_client",
        "s3_bucket",
        "s3_bucket_unversioned",
        "faulty_s3",
        "pgbouncer",
        "direct_dsn",
    }
)
PROCESS_FIXTURES = frozenset({"run_cli", "supervisor"})
# What starts the `derivd` process without a fixture: a module that imports one of these
# from tests/support is an acceptance module.
PROCESS_STARTERS = frozenset({"derivd_command", "run_cli", "DaemonRun", "idle_daemon"})


def needed_tier(item: pytest.Item) -> str:
    """The lowest tier that has what `item` uses."""
    fixtures = set(getattr(item, "fixturenames", ())) - direct_parameters(item)
    if item.get_closest_marker("acceptance") or fixtures & PROCESS_FIXTURES:
        return "acceptance"
    if item.get_closest_marker("integration") or fixtures & SERVICE_FIXTURES:
        return "integration"
    return "unit"


def direct_parameters(item: pytest.Item) -> set[str]:
    """The names `item` takes straight from @pytest.mark.parametrize: a parameter called
    `dsn` holds a string, not the database fixture of that name."""
    names: set[str] = set()
    for mark in item.iter_markers("parametrize"):
        argnames = mark.args[0] if mark.args else mark.kwargs["argnames"]
        if isinstance(argnames, str):
            argnames = [name.strip() for name in argnames.split(",") if name.strip()]
        indirect = mark.kwargs.get("indirect", False)
        if indirect is True:
            continue
        names.update(name for name in argnames if not (indirect and name in indirect))
    return names


def imported_names(path: Path) -> set[tuple[str, str]]:
    """(module, name) for every `from module import name` in `path`, and (module, "")
    for every `import module`: at the top, in functions and under TYPE_CHECKING alike."""
    found: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update((alias.name, "") for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.update((node.module, alias.name) for alias in node.names)
    return found


def module_tier(path: Path) -> str:
    """The tier a module's imports alone ask for: acceptance when it starts `derivd`."""
    names = {name for _, name in imported_names(path)}
    return "acceptance" if names & PROCESS_STARTERS else "unit"


def folder_tier(path: Path) -> str | None:
    """The tier of the folder `path` sits in, None outside the tier folders."""
    try:
        parts = path.resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) == 2 and parts[0] in TIERS else None


def highest(tiers: list[str]) -> str:
    return max(tiers, key=TIERS.index, default="unit")
