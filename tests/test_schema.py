"""The schema a command runs against: checked first, and migrated safely from two hosts.

Issue 11, defect 7: against a database never migrated (or behind, or newer), `run`,
`enqueue`, `retry` and `delete` printed tracebacks, and `enqueue` uploaded the original
before failing. Every command now says what `status` says, in one line, exit 3, before it
touches storage.

Defect 6: `derivd migrate` is promised safe from two hosts at once; here two run at once
against an empty database.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from fixtures.cli import derivd_command
from helpers import sql, wait_for

from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.queue.sqlfiles import migrations

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
