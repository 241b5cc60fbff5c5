"""The embedded PostgreSQL cluster, on real server binaries."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from derivd.embedded import pgcluster
from derivd.embedded.pgcluster import (
    EmbeddedCluster,
    EmbeddedClusterError,
    PostgresNotFound,
    find_server_bindir,
)


def _postmaster_pid(cluster: EmbeddedCluster) -> int:
    return int((cluster.data_dir / "postmaster.pid").read_text().split()[0])


def test_find_server_bindir_finds_binaries() -> None:
    bindir = find_server_bindir()
    for name in ("initdb", "pg_ctl", "postgres"):
        assert os.access(bindir / name, os.X_OK), name


def test_postgres_not_found_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # hides pg_config and initdb
    monkeypatch.setattr(pgcluster, "SERVER_GLOB_ROOT", tmp_path / "no-postgresql")
    with pytest.raises(PostgresNotFound) as err:
        find_server_bindir()
    message = str(err.value)
    assert "\n" not in message
    assert "apt-get install postgresql" in message


def test_glob_picks_highest_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = tmp_path / "postgresql"
    for version in ("9.6", "13", "16"):
        bindir = root / version / "bin"
        bindir.mkdir(parents=True)
        for name in ("initdb", "pg_ctl", "postgres"):
            (bindir / name).write_text("#!/bin/sh\n")
            (bindir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    monkeypatch.setattr(pgcluster, "SERVER_GLOB_ROOT", root)
    assert find_server_bindir() == root / "16" / "bin"


def test_cluster_runs_as_derivd_and_as_postgres_under_root(pg_cluster: EmbeddedCluster) -> None:
    with psycopg.connect(pg_cluster.dsn()) as conn:
        row = conn.execute("SELECT current_user, current_database()").fetchone()
    assert row == ("derivd", "derivd")
    owner = os.stat(f"/proc/{_postmaster_pid(pg_cluster)}").st_uid
    if os.geteuid() == 0:
        assert owner == pwd.getpwnam("postgres").pw_uid
    else:
        assert owner == os.geteuid()


def test_socket_dir_is_private(pg_cluster: EmbeddedCluster) -> None:
    st = os.stat(pg_cluster.socket_dir)
    assert stat.S_IMODE(st.st_mode) == 0o700


def test_restart_keeps_data_and_port(pg_root: Path, tmp_path: Path) -> None:
    # Its own cluster: restarting the shared one would cut the other tests' connections.
    cluster = EmbeddedCluster(pg_root / f"restart-{os.getpid()}" / "pgdata", fast=True)
    with cluster:
        with psycopg.connect(cluster.dsn()) as conn:
            conn.execute("CREATE TABLE kept (v text)")
            conn.execute("INSERT INTO kept VALUES ('still here')")
        port, socket_dir = cluster.port, cluster.socket_dir
        cluster.restart()
        assert (cluster.port, cluster.socket_dir) == (port, socket_dir)
        with psycopg.connect(cluster.dsn()) as conn:
            assert conn.execute("SELECT v FROM kept").fetchall() == [("still here",)]
    assert not cluster.is_running()


def test_second_instance_adopts_running_cluster(pg_cluster: EmbeddedCluster) -> None:
    other = EmbeddedCluster(pg_cluster.data_dir, listen_tcp=True, fast=True)
    with other:
        assert other.port == pg_cluster.port
        with psycopg.connect(other.dsn()) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    # Leaving the adopted cluster's context must not stop it under its owner.
    assert pg_cluster.is_running()


def test_create_and_drop_database(pg_cluster: EmbeddedCluster) -> None:
    pg_cluster.create_database("scratch_db")
    try:
        with psycopg.connect(pg_cluster.dsn("scratch_db")) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == ("scratch_db",)
    finally:
        pg_cluster.drop_database("scratch_db")
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(pg_cluster.dsn("scratch_db"), connect_timeout=5).close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to build an untraversable parent")
def test_untraversable_parent_is_named(tmp_path_factory: pytest.TempPathFactory) -> None:
    locked = Path(tmp_path_factory.mktemp("locked"))
    locked.chmod(0o700)
    cluster = EmbeddedCluster(locked / "state" / "pgdata", fast=True)
    with pytest.raises(EmbeddedClusterError, match="cannot traverse"):
        cluster.start()


def test_initdb_failure_is_one_line_with_log(pg_root: Path) -> None:
    data = pg_root / f"broken-{os.getpid()}" / "pgdata"
    data.mkdir(parents=True)
    (data / "junk").write_text("not a cluster")
    data.chmod(0o777)
    cluster = EmbeddedCluster(data, fast=True)
    with pytest.raises(EmbeddedClusterError) as err:
        cluster.start()
    message = str(err.value)
    assert "\n" not in message
    assert "initdb" in message and str(cluster.log_file) in message


def test_long_paths_fall_back_to_a_short_socket_dir(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120) / "pgdata"
    cluster = EmbeddedCluster(deep)
    assert len(str(cluster.socket_dir)) + len("/.s.PGSQL.65535") <= 107
    assert cluster.socket_dir == EmbeddedCluster(deep).socket_dir  # stable across restarts


def test_two_processes_starting_one_state_dir_initdb_once(pg_root: Path) -> None:
    data = pg_root / f"race-{os.getpid()}" / "pgdata"
    code = (
        "import sys; from pathlib import Path;"
        "from derivd.embedded.pgcluster import EmbeddedCluster;"
        "c = EmbeddedCluster(Path(sys.argv[1]), fast=True); c.start(); print(c.dsn())"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(data)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=60)[0].strip() for p in procs]
    cluster = EmbeddedCluster(data, fast=True)
    try:
        assert [p.returncode for p in procs] == [0, 0]
        assert outputs[0] == outputs[1]
        assert cluster.log_file.read_text().count("--- initdb") == 1
        assert cluster.is_running()
    finally:
        cluster.stop("immediate")
