"""`[database] schema` (DESIGN.md "Database schema"): derivd's tables beside the app's, in
a schema of derivd's own; `migrate` into a database whose schema already holds a table of
derivd's name refuses in one line naming it and the option. An app's own connection,
whose search_path knows nothing of derivd's schema, uses the SQL contract qualified."""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from helpers import sql

from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.storage.fs import FsStorage

RunCli = Callable[..., subprocess.CompletedProcess[str]]
_numbers = itertools.count(1)


@pytest.fixture
def app_dsn(pg_cluster: EmbeddedCluster) -> Iterator[str]:
    """An app's database: its own `archive_files` in public, no derivd yet."""
    name = f"app_{next(_numbers)}"
    pg_cluster.create_database(name)
    dsn = pg_cluster.dsn(name)
    sql(dsn, "CREATE TABLE archive_files (id serial PRIMARY KEY, title text)")
    yield dsn
    pg_cluster.drop_database(name)


def env_for(dsn: str, fs_root: Path, schema: str = "") -> dict[str, str]:
    return {
        "DERIVD_DATABASE_DSN": dsn,
        "DERIVD_DATABASE_SCHEMA": schema,
        "DERIVD_STORAGE_BACKEND": "fs",
        "DERIVD_STORAGE_ROOT": str(fs_root),
        "DERIVD_DERIVE_BACKEND": "noop",
        "DERIVD_SUPERVISOR_WORKERS": "1",
    }


def test_migrate_refuses_a_clash_in_one_line(app_dsn: str, fs_root: Path, run_cli: RunCli) -> None:
    refused = run_cli("migrate", env=env_for(app_dsn, fs_root))
    assert refused.returncode == 3 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1, refused.stderr  # one line, no traceback
    assert 'relation "archive_files" already exists in schema public' in refused.stderr
    assert "[database] schema" in refused.stderr
    assert sql(app_dsn, "SELECT to_regclass('derivd_migrations') AS t") == [{"t": None}]


def test_derivd_lives_in_a_schema_of_its_own_beside_the_apps(
    app_dsn: str, fs_root: Path, tmp_path: Path, run_cli: RunCli
) -> None:
    env = env_for(app_dsn, fs_root, "derivd")
    for _ in range(2):  # and again: every migrate pins the functions' search_path anew
        done = run_cli("migrate", env=env)
        assert done.returncode == 0, done.stderr
    assert sql(app_dsn, "SELECT count(*) AS n FROM public.archive_files") == [{"n": 0}]
    version = FsStorage(fs_root).put("uploads/a.jpg", b"x", "image/jpeg")
    # The app's own connection (search_path: public) through the qualified contract:
    # the INSERT fires derivd's triggers and row rule, which find derivd's tables.
    with psycopg.connect(app_dsn, autocommit=True) as app:
        [(file_id,)] = app.execute(
            "INSERT INTO derivd.archive_files (status, original_key, original_version,"
            " external_id) VALUES ('queued', 'uploads/a.jpg', %s, 'p-1') RETURNING id",
            (version,),
        ).fetchall()
        burst = run_cli("run", "--burst", env=env, timeout=120)
        assert burst.returncode == 0, burst.stderr
        row = app.execute("SELECT status, external_id FROM derivd.archive_files WHERE id = %s",
                          (file_id,)).fetchone()  # fmt: skip
        assert row == ("ready", "p-1")
        assert app.execute("SELECT derivd.derivd_delete_file(%s)", (file_id,)).fetchone() == (
            "deleting",
        )
    shown = run_cli("show", str(file_id), env=env)
    assert shown.returncode == 0 and f"file {file_id}: deleting" in shown.stdout


def test_a_schema_name_derivd_cannot_use_as_it_is_is_refused(
    fs_root: Path, run_cli: RunCli
) -> None:
    env = env_for("", fs_root, 'App"; DROP')
    checked = run_cli("config", "check", env=env)
    assert checked.returncode == 2
    assert "[database] schema" in checked.stderr and "is not a lower-case name" in checked.stderr
