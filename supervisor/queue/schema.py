"""The schema: `migrate` applies the packaged migrations and sql/functions.sql;
`check_schema` refuses a database whose schema is not this release's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from derivd import __version__
from derivd.queue.cluster_admin import ClusterAdmin
from derivd.queue.session import (
    PARENT_STATEMENT_TIMEOUT_S,
    Bound,
    DatabaseUnavailable,
    bounded,
    connect,
)
from derivd.queue.sqlfiles import function_signatures, functions, migrations, query
from derivd.redact import one_line
from derivd.storage.base import StoreName


def migrate(dsn: str, store: StoreName | None = None, schema: str = "") -> list[str]:
    """Apply pending migrations in order, then sql/functions.sql, in one transaction,
    under an advisory lock, and record where the store is (`store`: derivd_store).
    Returns the names of the migrations it applied.

    `schema` ([database] schema; `dsn` is `in_schema` of it): created when missing, and
    every function's search_path, so that an app's statement on a connection of its own
    (an INSERT firing the triggers and the row's rule, `derivd_delete_file`) finds
    derivd's tables. A table of derivd's name already there, not derivd's (the app's
    `archive_files`): SchemaMismatch in one line naming it and the option.

    `store.prefix` is the transaction's `derivd.key_prefix`: migration 0025 adds it to
    the keys already in the rows (keys are the store's real keys from then on).

    Safe to run from two hosts at once: the second waits for the lock, then finds no
    migration left and replaces the functions with the same bodies (two sessions
    replacing one function at once would fail: the lock serialises them). One
    transaction: a function body that does not fit the migrated tables rolls the whole
    upgrade back, so the ledger never records migrations whose functions are missing.

    A database that has migrations this version does not know belongs to a newer derivd:
    SchemaMismatch, and nothing changes (this version's functions.sql would put older
    bodies under the newer hosts of a rolling upgrade).
    """
    applied: list[str] = []
    packaged = migrations()
    with connect(dsn, application_name="derivd-migrate") as conn:
        conn.autocommit = False
        with conn.transaction():
            conn.execute(query("migrations_lock"))
            if schema:
                ClusterAdmin(conn).create_schema(schema)
            conn.execute(query("migrations_table"))
            where = schema or str(conn.execute(query("current_schema")).fetchone()[0])  # type: ignore[index]
            if store is not None:
                conn.execute(query("migrations_key_prefix"), {"prefix": store.prefix})
            done = {row[0] for row in conn.execute(query("migrations_applied"))}
            if newer := newer_schema(done, {m.name for m in packaged}):
                raise SchemaMismatch(newer)
            for migration in packaged:
                if migration.name in done:
                    continue
                try:
                    conn.execute(migration.sql)  # type: ignore[arg-type]  # package data
                except (psycopg.errors.DuplicateTable, psycopg.errors.DuplicateObject) as error:
                    raise SchemaMismatch(_clash(error, where)) from None
                conn.execute(query("migrations_record"), {"name": migration.name})
                applied.append(migration.name)
            conn.execute(functions())  # type: ignore[arg-type]  # package data
            if schema:
                # Every function looks its names up in the schema, whoever calls it
                # (CREATE OR REPLACE drops the setting: every migrate sets it again).
                conn.execute(query("pin_search_path"), {"signatures": function_signatures()})
            if store is not None:
                conn.execute(query("store_record"), asdict(store))
    return applied


def _clash(error: psycopg.Error, where: str) -> str:
    """One line for a migration that met an object of derivd's name it did not make."""
    what = error.diag.message_primary or "an object of derivd's name exists"
    return (
        f"{what} in schema {where} and is not derivd's: give derivd a schema of its own "
        "with [database] schema (e.g. schema = derivd), or migrate into another database"
    )


def in_schema(dsn: str, schema: str) -> str:
    """`dsn` whose sessions find derivd's tables in `schema` ([database] schema; empty:
    `dsn` as it is). A startup option: through a transaction pooler, which refuses it,
    set the role's search_path instead (README)."""
    if not schema:
        return dsn
    params = conninfo_to_dict(dsn)
    options = f"{params.get('options') or ''} -c search_path={schema}".strip()
    return make_conninfo(dsn, options=options)


NO_SCHEMA = "the database has no derivd schema; run `derivd migrate`"


class SchemaMismatch(Exception):
    """The database's schema is not the one this derivd was built for (one line, which
    says what to do). Commands exit 3 on it, as `derivd status` does."""


def check_schema(dsn: str) -> None:
    """Raise SchemaMismatch unless the database has every packaged migration, no
    migration this version does not know, and every function of sql/functions.sql;
    DatabaseUnavailable when it cannot be asked.

    Every command that uses the schema calls this first, before it touches storage, so
    that a missing or foreign schema is one line instead of a traceback halfway through.
    A release may add a function without a migration: its hosts are refused until
    `derivd migrate` has created it, as they would be for a missing migration.
    """
    bound = PARENT_STATEMENT_TIMEOUT_S  # `derivd run` asks before it forks anything
    with connect(dsn, application_name="derivd-check", bound_s=bound) as conn:
        check_schema_on(conn, bound_s=bound)


def check_schema_on(conn: psycopg.Connection[Any], *, bound_s: float | None = None) -> None:
    """check_schema on a connection the caller holds (a command that opens one only);
    its statements wait at most `bound_s` (`bounded`)."""
    applied: set[str] = set()
    absent: list[str] = []
    bound = Bound(bound_s)
    try:
        with bounded(conn, bound_s) as bound:
            row = conn.execute(query("migrations_exists")).fetchone()
            if row and row[0]:
                applied = {r[0] for r in conn.execute(query("migrations_applied"))}
                signatures = {"signatures": function_signatures()}
                absent = [r[0] for r in conn.execute(query("functions_missing"), signatures)]
    except psycopg.OperationalError as error:
        raise bound.unavailable(error) from None
    except psycopg.Error as error:
        raise DatabaseUnavailable(f"database error: {one_line(error)}") from None
    problem = schema_problem(applied, {m.name for m in migrations()}, absent)
    if problem:
        raise SchemaMismatch(problem)


def schema_problem(
    applied: set[str], packaged: set[str], absent_functions: Sequence[str] = ()
) -> str | None:
    """What is wrong with a database that has `applied` for this version's `packaged`
    migrations and lacks `absent_functions` of its sql/functions.sql."""
    if not applied:
        return NO_SCHEMA
    newer = newer_schema(applied, packaged)
    if newer:
        return newer
    missing = sorted(packaged - applied) or list(absent_functions)
    if missing:
        return (
            f"the database schema is behind this derivd (missing: {', '.join(missing)}); "
            "run `derivd migrate`"
        )
    return None


def newer_schema(applied: set[str], packaged: set[str]) -> str | None:
    """Why a database that has `applied` belongs to a newer derivd than `packaged`, if it
    does."""
    newer = sorted(applied - packaged)
    if not newer:
        return None
    return (
        f"the database schema is newer than this derivd ({__version__}) knows "
        f"(unknown migrations: {', '.join(newer)}); upgrade derivd on this host"
    )
