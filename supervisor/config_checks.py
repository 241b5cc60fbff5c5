"""What a setting's value must be: the bounds and checks the declarations in `derivd.config`
name, and the problem a bad value is reported as."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from derivd.handlers.base import VariantSpec
from derivd.handlers.preview_spec import KINDS
from derivd.redact import parse_dsn
from derivd.variant_config import build_variants, check_listed

Check = Callable[[Any], str | None]  # returns a problem, or None when the value is fine


@dataclass(frozen=True)
class Bounds:
    """A number's range, finite at both ends: every numeric setting declares one, so a
    value like `inf` or `1e300` is refused at load instead of overflowing an interval, an
    integer column or a timer later. `above`: strictly more than `low`; `between`: the
    message names both ends (a scale, like quality 1-100)."""

    low: float
    high: float
    above: bool = False
    between: bool = False

    def __call__(self, value: float) -> str | None:
        low_ok = value > self.low if self.above else value >= self.low
        if low_ok and value <= self.high:  # NaN fails both comparisons
            return None
        low, high = _number(self.low), _number(self.high)
        if self.between:
            return f"must be between {low} and {high}"
        if not low_ok and value < self.high:
            return f"must be greater than {low}" if self.above else f"must be {low} or more"
        return f"must be at most {high}"


def _number(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:g}"


def positive(high: float) -> Bounds:
    return Bounds(0, high, above=True)


def non_negative(high: float) -> Bounds:
    return Bounds(0, high)


def in_range(low: int, high: int) -> Bounds:
    return Bounds(low, high, between=True)


fraction = Bounds(0, 1, between=True)


# Upper bounds, generous for any real deployment, small enough for every use downstream
# (PostgreSQL intervals and integers, timers, sizes in bytes).
MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0
DAYS_MAX = 36_500  # a century of days
COUNT_MAX = 1_000_000_000  # fits PostgreSQL's integer


# A schema name derivd puts in search_path and in DDL as it is: nothing to quote.
SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def schema_name_problem(value: str) -> str | None:
    """[database] schema: empty, or a name derivd uses as it is (nothing to quote)."""
    if not value or SCHEMA_NAME.match(value):
        return None
    return f"{value!r} is not a lower-case name (a letter or _, then letters, digits or _)"


def one_of(*choices: str) -> Check:
    def check(value: str) -> str | None:
        return None if value in choices else f"{value!r} is not one of: {', '.join(choices)}"

    return check


def split_host_port(value: str) -> tuple[str, int]:
    """`host:port` (IPv6 as `[::1]:9464`; an empty host means every interface) ->
    (host, port). ValueError when it is not of that form."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{value!r} is not host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


def host_port(value: str) -> str | None:
    if not value:
        return None
    try:
        _host, port = split_host_port(value)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        return "must be host:port (e.g. 127.0.0.1:9464), or empty for off"
    return None


def check_handler(value: str) -> str | None:
    from derivd.handlers.registry import BUILTIN, is_import_target, known_handlers  # no backend

    # A built-in name needs no look at the installed packages' entry points (a scan of
    # every distribution's metadata, paid by every command that loads the config).
    if value in BUILTIN or is_import_target(value):  # `module:Class`: checked in the worker
        return None
    known = known_handlers()
    return None if value in known else f"unknown backend {value!r}; known: {', '.join(known)}"


def listed_kinds(text: str) -> frozenset[str]:
    return frozenset(k.strip() for k in text.split(",") if k.strip())


def check_kinds(value: str) -> str | None:
    unknown = sorted(listed_kinds(value) - set(KINDS))
    if unknown:
        return f"unknown kind {unknown[0]!r}; kinds: {', '.join(KINDS)}"
    return None


def parse_variants(text: str) -> tuple[VariantSpec, ...]:
    """`preview:1600, thumb:320` -> variants in order (shorthand only: no sections)."""
    problem = check_listed(text)
    specs, problems = build_variants(text, {})
    if problem or problems:
        raise ValueError(problem or problems[0][2])
    return specs


def check_dsn(value: str) -> str | None:
    # libpq's own complaint may quote a word of the password: it is not repeated here.
    if not value or parse_dsn(value) is not None:
        return None
    return (
        "not a libpq connection string or URL that libpq can read (a value with spaces "
        "needs single quotes: password='a b'; in a URL, percent-encode it)"
    )


HOST_ID_MAX_BYTES = 200
HEARTBEAT_AUTO_MAX = 10.0  # seconds: a dead host is called stale within 30 s by default


def check_host_id(value: str) -> str | None:
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return "must not contain control characters"
    if len(value.encode()) > HOST_ID_MAX_BYTES:
        return f"must be at most {HOST_ID_MAX_BYTES} bytes"
    return None


@dataclass(frozen=True)
class Problem:
    """One bad setting. `section` and `key` are None where none applies (a file that
    cannot be read, an unknown section, an unknown environment variable)."""

    where: str
    section: str | None
    key: str | None
    message: str

    def __str__(self) -> str:
        scope = " ".join(filter(None, (self.section and f"[{self.section}]", self.key)))
        return (
            f"{self.where}: {scope}: {self.message}" if scope else f"{self.where}: {self.message}"
        )


class ConfigError(Exception):
    """One or more bad settings; str() gives one line per problem."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems
