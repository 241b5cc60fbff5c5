"""Load the named query blocks of `sql/queries.sql`, the ordered migrations and
`sql/functions.sql` (the current body of every function, which `migrate` re-applies)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import LiteralString

_NAME = re.compile(r"^--\s*name:\s*([a-z0-9_]+)\s*$", re.MULTILINE)
_DEFAULT = re.compile(r"\s+(?:DEFAULT|=)\s+", re.IGNORECASE)
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
    """The query without its description comments (nor the next group's heading): they
    are for people reading sql/queries.sql, not for the server (pg_stat_activity then
    shows the statement, not the first 1 kB of its documentation)."""
    lines = body.strip().splitlines()
    while lines and lines[0].lstrip().startswith("--"):
        lines.pop(0)
    while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith("--")):
        lines.pop()  # the next group's heading
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


def function_signatures(text: str | None = None) -> list[str]:
    """Every function sql/functions.sql (or `text`) defines, as `name(type, ...)` with its
    input argument types (what to_regprocedure reads: OUT arguments are not part of a
    function's identity), sorted. An overload is a signature of its own, so a release
    that adds one is refused until `derivd migrate` has created it."""
    text = functions() if text is None else text
    found: set[str] = set()
    for match in _FUNCTION.finditer(text):
        found.add(f"{match.group(1)}({', '.join(_input_types(_arguments(text, match.end())))})")
    return sorted(found)


def _arguments(text: str, start: int) -> str:
    """The argument list that opens just before `start` (balanced parentheses)."""
    depth = 1
    for end in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            return text[start:end]
    raise ValueError("sql/functions.sql: unbalanced argument list")


def _input_types(arguments: str) -> list[str]:
    """`a integer, OUT b text, c float8 DEFAULT 0` -> ["integer", "float8"]."""
    types: list[str] = []
    for argument in _split_top_level(arguments):
        words = _DEFAULT.split(argument.strip(), maxsplit=1)[0].split()
        if not words:
            continue
        mode = words[0].upper()
        if mode == "OUT":
            continue
        if mode in ("IN", "INOUT", "VARIADIC"):
            words = words[1:]
        types.append(" ".join(words[1:]) if len(words) > 1 else words[0])
    return types


def _split_top_level(arguments: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in arguments:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def query(name: str) -> LiteralString:
    """The named block of sql/queries.sql. The queries come from our own package data,
    never from input: they are literal."""
    text: LiteralString = queries()[name]  # type: ignore[assignment]
    return text
