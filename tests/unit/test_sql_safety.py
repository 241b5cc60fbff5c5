"""Parameterised SQL only: every statement derivd executes is a named block of
sql/queries.sql or composed safely, and the scan that checks it catches string building.
The rest of the security checks, on a running derivd: tests/acceptance/test_security.py."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _is_query_block(node: ast.expr) -> bool:
    """`query(name)`: it can only return a named block of sql/queries.sql (checked below)."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "query"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Constant | ast.Name)
    )


def _is_identifier_block(node: ast.expr) -> bool:
    """`self._identifiers("create_database", name=...)` or `on_channel(name, channel)`: a
    named block whose `{name}` placeholders are filled with psycopg.sql.Identifier (cluster
    administration, LISTEN on a channel)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if called == "_identifiers":
        return len(node.args) == 1 and isinstance(node.args[0], ast.Constant)
    return called == "on_channel" and len(node.args) == 2


def _is_migration(node: ast.expr) -> bool:
    """`migration.sql` or `functions()`: package data (sql/migrations, sql/functions.sql)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "sql"
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "functions"
        and not node.args
    )


def _sql_sources() -> Iterator[Path]:
    for package in ("supervisor", "handlers"):
        yield from sorted((ROOT / package).rglob("*.py"))


def _execute_calls(tree: ast.AST) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("execute", "executemany", "copy", "stream")
        ):
            yield node


def _resolve(tree: ast.AST, call: ast.Call) -> tuple[ast.expr | None, str]:
    """The query argument; a bare name is followed to its (single) assignment in the
    same function, e.g. `query = sql.SQL(...).format(...)`, then `conn.execute(query)`."""
    if not call.args:
        return None, ""
    arg = call.args[0]
    if not isinstance(arg, ast.Name):
        return arg, ""
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if not any(n is call for n in ast.walk(func)):
            continue
        values = [
            n.value
            for n in ast.walk(func)
            if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == arg.id for t in n.targets)
        ]
        return (ast.BoolOp(op=ast.And(), values=values) if values else arg), arg.id
    return arg, arg.id


def _allowed(path: Path, node: ast.expr, own: str = "") -> bool:
    if isinstance(node, ast.BoolOp):  # every assignment of a variable must be allowed
        return bool(node.values) and all(_allowed(path, v, own) for v in node.values)
    if path.parent.name == "queue":  # derivd.queue: the one package that runs SQL
        return _is_query_block(node) or _is_migration(node) or _is_identifier_block(node)
    return False  # nothing else in derivd runs SQL


def test_every_executed_query_is_a_named_block_or_safely_composed() -> None:
    problems, seen = [], 0
    for path in _sql_sources():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for call in _execute_calls(tree):
            node, own = _resolve(tree, call)
            if node is None:
                continue
            seen += 1
            if not _allowed(path, node, own):
                where = f"{path.relative_to(ROOT)}:{call.lineno}"
                problems.append(f"{where}: {ast.unparse(call)[:100]}")
    assert seen >= 8, "the scan found too few execute() calls: is it still looking?"
    assert not problems, "SQL built outside sql/queries.sql:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "snippet",
    [
        'conn.execute(f"SELECT * FROM t WHERE id = {x}")',
        'conn.execute("SELECT * FROM t WHERE id = " + x)',
        'conn.execute("SELECT * FROM t WHERE id = %s" % x)',
        'conn.execute("SELECT * FROM t WHERE id = {}".format(x))',
        'q = f"DROP TABLE {x}"\n    conn.execute(q)',
        'cur.execute(sql.SQL("SELECT {}").format(x))',  # a raw value, not an Identifier
    ],
)
def test_the_sql_scan_catches_string_building(snippet: str) -> None:
    source = f"def f(conn, cur, x):\n    {snippet}\n"
    tree = ast.parse(source)
    (call,) = list(_execute_calls(tree))
    node, own = _resolve(tree, call)
    assert node is not None
    for name in ("queue/statements.py", "embedded/pgcluster.py", "worker.py"):
        assert not _allowed(Path(name), node, own), (name, snippet)


def test_query_only_returns_blocks_of_queries_sql() -> None:
    source = (ROOT / "supervisor" / "queue" / "sqlfiles.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    (func,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "query"]
    assert "queries()[name]" in ast.unparse(func)
