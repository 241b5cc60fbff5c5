"""The import rules of the installed package: no circles, and the floors below.

Read with ast from the installed `derivd` (the editable build's plain directory), every
import counted: at module level, inside functions and under TYPE_CHECKING alike, since
each is a module that must be understood before this one. Where a rule is broken today by
work in progress, the arrow is named below with the reason, so the list only shrinks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import derivd

PACKAGE = Path(derivd.__file__).parent  # not resolved: the links name the modules
Graph = Mapping[str, frozenset[str]]

# The floor everything may use: these import nothing of derivd but each other.
FLOOR = frozenset(
    {"derivd.states", "derivd.errors", "derivd.redact", "derivd.osproc", "derivd.logs"}
)
# The worker: what runs in a worker process, below the operator's views.
WORKER = (
    "derivd.worker",
    "derivd.worker_loop",
    "derivd.attempt",
    "derivd.pipeline",
    "derivd.derive_clock",
)
# The configuration: its declarations, their checks, reading and printing them.
CONFIG = ("derivd.config", "derivd.config_checks", "derivd.config_load", "derivd.config_show")
# What the supervisor's processes serve or run from derivd.ops (the metrics server, the
# dashboard, the sweep's pass): the only arrows from derivd.processes into derivd.ops.
SERVED_BY_PROCESSES = frozenset(
    {"derivd.ops.metrics", "derivd.ops.dashboard", "derivd.ops.durations", "derivd.ops.sweep"}
)
# Circles being cut elsewhere, each to be removed from here with its cut.
TEMPORARY_CIRCLES: tuple[frozenset[str], ...] = ()
# Arrows against a floor, each to be removed from here with its fix.
TEMPORARY_ARROWS = frozenset(
    {
        # `derivd status` asks the supervisor's LISTEN duty what a pooled path means.
        ("derivd.ops.status", "derivd.processes.duties"),
    }
)


def module_names(root: Path) -> dict[str, Path]:
    """Every module under `root` (a package directory) by its dotted name."""
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(source: str, name: str, is_package: bool, known: Iterable[str]) -> frozenset[str]:
    """The modules of `known` that the module `name` imports (relative imports resolved;
    `from a import b` is the module a.b when there is one, else a)."""
    known = set(known)
    package = name if is_package else name.rpartition(".")[0]

    def nearest(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found: set[str | None] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(nearest(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else nearest(base))
    return frozenset(m for m in found if m and m != name and m != name.split(".")[0])


def graph_of(root: Path) -> dict[str, frozenset[str]]:
    names = module_names(root)
    return {
        name: imports_of(path.read_text(encoding="utf-8"), name, path.name == "__init__.py", names)
        for name, path in names.items()
    }


def circles(graph: Graph) -> list[frozenset[str]]:
    """The strongly connected sets of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.add(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(frozenset(members))
    return found


def in_room(module: str, *rooms: str) -> bool:
    return any(module == room or module.startswith(room + ".") for room in rooms)


def floor_breaks(graph: Graph) -> set[tuple[str, str]]:
    """Every arrow against the declared floors."""
    broken = set()
    for module, targets in graph.items():
        for target in targets:
            if module in FLOOR and target not in FLOOR:
                broken.add((module, target))  # the floor stands on nothing above it
            if in_room(module, "derivd.handlers") and not (
                in_room(target, "derivd.handlers") or target in FLOOR
            ):
                broken.add((module, target))  # backends are a plugin API: nothing above
            if in_room(target, "derivd.ops"):
                if module in WORKER or in_room(module, "derivd.webhooks", "derivd.queue"):
                    broken.add((module, target))  # operators' views sit above these
                if in_room(module, "derivd.processes") and target not in SERVED_BY_PROCESSES:
                    broken.add((module, target))
                if in_room(module, "derivd.storage", "derivd.embedded", *CONFIG):
                    broken.add((module, target))
            if in_room(module, "derivd.ops", "derivd.queue", "derivd.storage") and in_room(
                target, "derivd.processes", "derivd.cli", "derivd.demo", *WORKER
            ):
                broken.add((module, target))  # the rooms the processes run never reach up
            if in_room(target, "derivd.cli", "derivd.demo") and not in_room(module, "derivd.cli"):
                broken.add((module, target))  # the command line is the top floor
    return broken


GRAPH = graph_of(PACKAGE)


def test_the_package_is_read_whole() -> None:
    assert {"derivd.worker", "derivd.config", "derivd.handlers.base", "derivd.sql"} <= set(GRAPH)
    assert "derivd.handlers.base" in GRAPH["derivd.config"]


def test_no_import_circles_but_the_named_ones() -> None:
    assert sorted(map(sorted, set(circles(GRAPH)) - set(TEMPORARY_CIRCLES))) == []


def test_every_named_circle_still_exists() -> None:
    """A circle cut leaves the list with its cut, so the list only shrinks."""
    assert set(TEMPORARY_CIRCLES) <= set(circles(GRAPH))


def test_no_import_against_the_floors_but_the_named_ones() -> None:
    assert sorted(floor_breaks(GRAPH) - TEMPORARY_ARROWS) == []


def test_every_named_arrow_still_exists() -> None:
    assert sorted(TEMPORARY_ARROWS - floor_breaks(GRAPH)) == []


def test_the_checker_sees_a_circle_and_an_arrow_against_a_floor() -> None:
    graph = {
        "derivd.a": frozenset({"derivd.b"}),
        "derivd.b": frozenset({"derivd.c"}),
        "derivd.c": frozenset({"derivd.a"}),
        "derivd.errors": frozenset({"derivd.config"}),
        "derivd.handlers.x": frozenset({"derivd.queue.db"}),
        "derivd.worker": frozenset({"derivd.ops.status"}),
        "derivd.processes.child": frozenset({"derivd.ops.metrics", "derivd.logs"}),
    }
    assert circles(graph) == [frozenset({"derivd.a", "derivd.b", "derivd.c"})]
    assert floor_breaks(graph) == {
        ("derivd.errors", "derivd.config"),
        ("derivd.handlers.x", "derivd.queue.db"),
        ("derivd.worker", "derivd.ops.status"),
    }


def test_every_kind_of_import_is_an_arrow() -> None:
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "import derivd.states\n"
        "from . import errors\n"
        "from .storage.base import Storage\n"
        "if TYPE_CHECKING:\n    from derivd.config import Config\n"
        "def f():\n    from derivd.queue import db\n"
    )
    known = {"derivd", "derivd.states", "derivd.errors", "derivd.config", "derivd.queue",
             "derivd.queue.db", "derivd.storage", "derivd.storage.base"}  # fmt: skip
    assert imports_of(source, "derivd.worker", False, known) == {
        "derivd.states",
        "derivd.errors",
        "derivd.storage.base",
        "derivd.config",
        "derivd.queue.db",
    }
