"""Load the named query blocks of `sql/queries.sql`, the ordered migrations and
`sql/functions.sql` (the current body of every function, which `migrate` re-applies)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import LiteralString

_NAME = re.compile(r"^--\s*name:\s*([a-z0-9_]+)\s*$", re.MULTILINE)
_FUNCTION = re.compile(r"^CREATE OR REPLACE FUNCTION\s+([a-z0-9_]+)\s*\(", re.MULTILINE)


@dataclass(frozen=True)
class Migration:
    name: str
    sql: str


def parse_blocks(text: str) -> dict[str, str]:
    """Split `-- name: x` blocks; the text between two headers is the query."""
    parts = _NAME.split(text)
    blocks: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in blocks:
            raise ValueError(f"duplicate query name {name!r} in sql/queries.sql")
        blocks[name] = _without_header(body)
    return blocks


def _without_header(body: str) -> str:
    """The query without its leading description comments: they are for people reading
    sql/queries.sql, not for the server (pg_stat_activity then shows the statement, not
    the first 1 kB of its documentation)."""
    lines = body.strip().splitlines()
    while lines and lines[0].lstrip().startswith("--"):
        lines.pop(0)
    return "\n".join(lines).strip()


@cache
def queries() -> dict[str, str]:
    return parse_blocks(files("derivd.sql").joinpath("queries.sql").read_text(encoding="utf-8"))


def migrations() -> list[Migration]:
    folder = files("derivd.sql").joinpath("migrations")
    found = [entry for entry in folder.iterdir() if entry.name.endswith(".sql")]
    return [
        Migration(entry.name.removesuffix(".sql"), entry.read_text(encoding="utf-8"))
        for entry in sorted(found, key=lambda e: e.name)
    ]


def functions() -> str:
    """sql/functions.sql, one script: every function as it is now (CREATE OR REPLACE)."""
    return files("derivd.sql").joinpath("functions.sql").read_text(encoding="utf-8")


def function_names() -> list[str]:
    """The name of every function sql/functions.sql defines, sorted."""
    return sorted(set(_FUNCTION.findall(functions())))


def query(name: str) -> LiteralString:
    """The named block of sql/queries.sql. The queries come from our own package data,
    never from input: they are literal."""
    text: LiteralString = queries()[name]  # type: ignore[assignment]
    return text
