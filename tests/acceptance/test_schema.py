"""The schema a command runs against: checked first, and migrated safely from two hosts.

Against a database never migrated (or behind, or newer), `run`,
`enqueue`, `retry` and `delete` printed tracebacks, and `enqueue` uploaded the original
before failing. Every command says what `status` says, in one line, exit 3, before it
touches storage.

`derivd migrate` is promised safe from two hosts at once; here two run at once
against an empty database.

sql/schema.sql and sql/functions.sql are the readable home of the schema; an
empty database migrated is exactly them (pg_dump of both), and every `migrate` puts
functions.sql's bodies back, except on a database a newer derivd migrated; a function
this version needs and the database lacks is refused like a missing migration.
"""

from __future__ import annotations

import difflib
import itertools
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from fixtures.cli import derivd_command
from helpers import sql, wait_for

from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.queue.db import SchemaMismatch, check_schema, migrate
from derivd.queue.sqlfiles import function_signatures, functions, migrations, queries

RunCli = Callable[..., subprocess.CompletedProcess[str]]
NO_SCHEMA = "derivd: the database has no derivd schema; run `derivd migrate`"
FUTURE = "9999_from_a_newer_derivd"

_numbers = itertools.count(1)


@pytest.fixture
def empty_dsn(pg_cluster: EmbeddedCluster) -> Iterator[str]:
    """A database that exists and was never migrated."""
    name = f"empty_{next(_numbers)}"
    pg_cluster.create_database(name)
    yield pg_cluster.dsn(name)
    pg_cluster.drop_database(name)


@pytest.fixture
def env_for(fs_root: Path) -> Callable[[str], dict[str, str]]:
    def env(dsn: str) -> dict[str, str]:
        return {
            "DERIVD_DATABASE_DSN": dsn,
            "DERIVD_STORAGE_BACKEND": "fs",
            "DERIVD_STORAGE_ROOT": str(fs_root),
            "DERIVD_DERIVE_BACKEND": "noop",
            "DERIVD_SUPERVISOR_WORKERS": "1",
        }

    return env


def assert_every_command_refuses(
    run_cli: RunCli,
    env: dict[str, str],
    tmp_path: Path,
    fs_root: Path,
    *words: str,
    also: tuple[tuple[str, ...], ...] = (),
) -> None:
    """Each command that needs the schema exits 3 with one line holding `words`, prints
    nothing on stdout and leaves the store empty (enqueue uploads nothing)."""
    original = tmp_path / "photo.jpg"
    original.write_bytes(b"\xff\xd8\xff not really a jpeg")
    commands = [
        ("run", "--burst"),
        ("enqueue", str(original)),
        ("retry", "1"),
        ("retry", "--rejected"),
        ("delete", "1"),
        ("sweep",),
        ("status",),
        ("show", "1"),
        *also,
    ]
    for args in commands:
        result = run_cli(*args, env=env, cwd=tmp_path)
        assert result.returncode == 3, (args, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, (args, result.stderr)
        assert all(word in lines[0] for word in words), (args, lines[0])
        assert result.stdout == "", args
    assert list(fs_root.rglob("*")) == [], "enqueue stored an object for a row it cannot add"


def test_every_command_refuses_a_database_never_migrated(
    run_cli: RunCli,
    empty_dsn: str,
    env_for: Callable[[str], dict[str, str]],
    fs_root: Path,
    tmp_path: Path,
) -> None:
    assert_every_command_refuses(run_cli, env_for(empty_dsn), tmp_path, fs_root, NO_SCHEMA)


def test_a_schema_behind_this_version_is_refused(
    run_cli: RunCli,
    dsn: str,
    env_for: Callable[[str], dict[str, str]],
    fs_root: Path,
    tmp_path: Path,
) -> None:
    last = migrations()[-1].name
    sql(dsn, "DELETE FROM derivd_migrations WHERE name = %s", (last,))
    assert_every_command_refuses(
        run_cli, env_for(dsn), tmp_path, fs_root, "schema is behind", last, "derivd migrate"
    )


def test_a_schema_newer_than_this_version_is_refused(
    run_cli: RunCli,
    dsn: str,
    env_for: Callable[[str], dict[str, str]],
    fs_root: Path,
    tmp_path: Path,
) -> None:
    sql(dsn, "INSERT INTO derivd_migrations (name) VALUES (%s)", (FUTURE,))
    assert_every_command_refuses(
        run_cli,
        env_for(dsn),
        tmp_path,
        fs_root,
        "schema is newer",
        FUTURE,
        "upgrade derivd",
        also=(("migrate",),),
    )


def test_a_current_schema_passes_the_check(
    run_cli: RunCli, dsn: str, env_for: Callable[[str], dict[str, str]], tmp_path: Path
) -> None:
    original = tmp_path / "photo.jpg"
    original.write_bytes(b"x")
    result = run_cli("enqueue", "-q", str(original), env=env_for(dsn), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sql(dsn, "SELECT count(*) AS n FROM archive_files")[0]["n"] == 1


# --------------------------------------------------------------------------- two migrates


def test_two_migrates_at_once_on_an_empty_database(empty_dsn: str, tmp_path: Path) -> None:
    """Both start while a third session holds the migration lock, so both are inside
    `derivd migrate` at the same moment (waiting on it, as the pg_locks rows show); then
    the lock goes. One applies the schema, the other finds it done; both exit 0."""
    env = {"DERIVD_DATABASE_DSN": empty_dsn}
    with psycopg.connect(empty_dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtext('derivd.migrate'))")
        procs = [
            subprocess.Popen(
                [*derivd_command(), "migrate"],
                env={**os.environ, **env},
                cwd=tmp_path,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        try:
            wait_for(
                lambda: (
                    holder.execute(
                        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                        "WHERE l.locktype = 'advisory' AND NOT l.granted "
                        "AND a.application_name = 'derivd-migrate'"
                    ).fetchone()
                    == (2,)
                    or any(p.poll() is not None for p in procs)
                ),
                "both migrates to wait on the migration lock",
            )
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        finally:
            holder.execute("SELECT pg_advisory_unlock(hashtext('derivd.migrate'))")
        outputs = [p.communicate(timeout=120) for p in procs]
    for proc, (_out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    names = [m.name for m in migrations()]
    stdout = sorted(out.strip() for out, _ in outputs)
    assert stdout == sorted([f"applied: {', '.join(names)}", "schema is up to date"]), stdout
    ledger = sql(empty_dsn, "SELECT name FROM derivd_migrations ORDER BY name")
    assert [r["name"] for r in ledger] == names
    assert sql(empty_dsn, "SELECT count(*) AS n FROM archive_files")[0]["n"] == 0


# --------------------------------------------------------------- schema.sql, functions.sql

SCHEMA_SQL = Path(__file__).resolve().parents[2] / "sql" / "schema.sql"
# Dump lines that describe the dump, not the schema: comments, session settings, psql
# meta-commands (\restrict).
_DUMP_NOISE = re.compile(r"^(--|SET |SELECT pg_catalog\.set_config|\\)")
# The daily event partitions are named after the day the database was built.
_DAYS = [
    (re.compile(r"archive_events_to_\d{8}"), "archive_events_to_YYYYMMDD"),
    (re.compile(r"'\d{4}-\d{2}-\d{2} 00:00:00\+00'"), "'YYYY-MM-DD 00:00:00+00'"),
]


def dump(cluster: EmbeddedCluster, dsn: str) -> str:
    """The database's schema and data (the ledger's rows aside) as pg_dump prints them,
    without owners, privileges, comments and settings.

    Constraints are validated first: a migration may add one NOT VALID so as not to scan
    history, which pg_dump prints apart; whether old rows were checked is history, not
    schema (schema.sql writes every constraint in its table).
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        invalid = conn.execute(
            "SELECT conrelid::regclass::text, conname FROM pg_constraint WHERE NOT convalidated"
        ).fetchall()
        for table, constraint in invalid:
            conn.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {constraint}")
    text = subprocess.run(
        [
            str(cluster.bindir / "pg_dump"),
            "--no-owner",
            "--no-privileges",
            "--exclude-table-data=derivd_migrations",
            "--dbname",
            dsn,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    lines = [line for line in text.splitlines() if not _DUMP_NOISE.match(line)]
    normal = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    for pattern, placeholder in _DAYS:
        normal = pattern.sub(placeholder, normal)
    return normal


def build_from_files(dsn: str) -> None:
    """functions.sql, then schema.sql (its triggers call functions, whose SQL-language
    bodies name its tables: read as pg_dump's output is, bodies unchecked), then the
    migration ledger, which belongs to the runner."""
    with psycopg.connect(dsn) as conn:
        conn.execute("SET check_function_bodies = off")
        conn.execute(functions())  # type: ignore[arg-type]  # package data
        conn.execute(SCHEMA_SQL.read_text(encoding="utf-8"))  # type: ignore[arg-type]
        conn.execute(queries()["migrations_table"])  # type: ignore[arg-type]


def test_migrations_produce_schema_sql_and_functions_sql(
    pg_cluster: EmbeddedCluster, empty_dsn: str
) -> None:
    """Whoever changes the schema in a migration writes the change into schema.sql (or
    functions.sql); whoever reads these files reads the database."""
    migrate(empty_dsn)
    name = f"from_files_{next(_numbers)}"
    pg_cluster.create_database(name)
    try:
        build_from_files(pg_cluster.dsn(name))
        from_files = dump(pg_cluster, pg_cluster.dsn(name))
    finally:
        pg_cluster.drop_database(name)
    migrated = dump(pg_cluster, empty_dsn)
    assert "CREATE TABLE public.archive_files" in migrated  # the dump saw the schema
    drift = difflib.unified_diff(
        migrated.splitlines(), from_files.splitlines(), "migrations", "schema.sql", lineterm=""
    )
    assert migrated == from_files, "\n".join(drift)


# The first migration written after functions.sql became the home of every body.
FIRST_AFTER_FUNCTIONS_SQL = "0012"


def test_no_newer_migration_replaces_a_function() -> None:
    """`migrate` runs functions.sql after the migrations: a body a migration replaced
    would be put back at once, silently. A new body goes into functions.sql. (A migration
    may still CREATE a new function it needs itself, e.g. for a trigger, which then
    lives on in functions.sql.)"""
    replaces = re.compile(r"CREATE\s+OR\s+REPLACE\s+FUNCTION", re.IGNORECASE)
    offenders = [
        m.name
        for m in migrations()
        if m.name >= FIRST_AFTER_FUNCTIONS_SQL and replaces.search(m.sql)
    ]
    assert offenders == [], f"change these functions in sql/functions.sql: {offenders}"


def function_bodies(dsn: str) -> dict[str, str]:
    rows = sql(
        dsn,
        "SELECT p.oid::regprocedure::text AS name, pg_get_functiondef(p.oid) AS body "
        "FROM pg_proc AS p WHERE p.pronamespace = 'public'::regnamespace",
    )
    return {r["name"]: r["body"] for r in rows}


BROKEN_RELEASE = """
CREATE OR REPLACE FUNCTION derivd_release(file_id bigint, token uuid, attempt integer)
RETURNS boolean LANGUAGE sql AS $$ SELECT false $$
"""


def test_every_migrate_puts_back_the_bodies_of_functions_sql(dsn: str) -> None:
    """A host of the new release runs `derivd migrate` with no migration pending: the
    functions still become this release's (a rolling upgrade that changes a body only)."""
    current = function_bodies(dsn)
    sql(dsn, BROKEN_RELEASE)
    assert function_bodies(dsn) != current
    assert migrate(dsn) == []
    assert function_bodies(dsn) == current


def test_migrate_leaves_a_newer_schemas_functions_alone(dsn: str) -> None:
    """A host still on the previous release runs `derivd migrate` after a newer one did:
    refused, and the newer bodies stay (this release's would undo them)."""
    sql(dsn, "INSERT INTO derivd_migrations (name) VALUES (%s)", (FUTURE,))
    sql(dsn, BROKEN_RELEASE)
    newer = function_bodies(dsn)
    with pytest.raises(SchemaMismatch, match="schema is newer"):
        migrate(dsn)
    assert function_bodies(dsn) == newer


def test_a_function_added_without_a_migration_is_refused_until_migrate(dsn: str) -> None:
    """A release may add a function to functions.sql alone: its hosts must not start on a
    database the previous release migrated (their first call would fail), but say so."""
    sql(dsn, "DROP FUNCTION derivd_host_stale(timestamptz, float8)")
    with pytest.raises(SchemaMismatch) as refused:
        check_schema(dsn)
    assert str(refused.value) == (
        "the database schema is behind this derivd (missing: "
        "derivd_host_stale(timestamptz, float8)); run `derivd migrate`"
    )
    assert migrate(dsn) == []
    check_schema(dsn)


def test_a_missing_overload_is_refused_though_its_name_exists(dsn: str) -> None:
    """The check is by full signature: a release that adds an overload of a function the
    database already has (same name, new arguments) is refused as well, not at first call."""
    sql(dsn, "DROP FUNCTION derivd_similar(bigint, integer, integer)")
    overload = r"missing: derivd_similar\(bigint, integer, integer\)"
    with pytest.raises(SchemaMismatch, match=overload):
        check_schema(dsn)
    assert migrate(dsn) == []
    check_schema(dsn)


def test_signatures_read_input_types_only() -> None:
    text = (
        "CREATE OR REPLACE FUNCTION f(a integer, OUT b text, c numeric(4, 2) DEFAULT 0,\n"
        "    VARIADIC d text[]) RETURNS void\n"
        "CREATE OR REPLACE FUNCTION g() RETURNS trigger\n"
    )
    assert function_signatures(text) == ["f(integer, numeric(4, 2), text[])", "g()"]
