"""The embedded PostgreSQL cluster, on real server binaries (what needs no server:
tests/unit/test_pgcluster_paths.py)."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from fixtures.cli import derivd_command
from helpers import sql, wait_for

from derivd.config import Config
from derivd.embedded import pghome
from derivd.embedded.pgcluster import EmbeddedCluster, EmbeddedClusterError, discard
from derivd.embedded.runtime import database, describe_database


def _postmaster_pid(cluster: EmbeddedCluster) -> int:
    return int((cluster.data_dir / "postmaster.pid").read_text().split()[0])


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


def test_embedded_database_keeps_its_data_from_one_command_to_the_next(pg_root: Path) -> None:
    """What every command does with an empty [database] dsn (runtime.database): start the
    private cluster (initdb the first time), migrate, work, stop it on the way out; the
    next command starts it again from the same state_dir and finds the data."""
    state = pg_root / f"state-{os.getpid()}"
    config = Config().replace("supervisor", state_dir=str(state))
    try:
        with database(config) as dsn:
            sql(
                dsn,
                "INSERT INTO archive_files (status, original_key, original_version)"
                " VALUES ('queued', 'k', 'v')",
            )
        assert not EmbeddedCluster(state / "pg").is_running()  # it started it: stopped
        with database(config, read_only=True) as dsn:  # `status`: an existing cluster
            rows = sql(dsn, "SELECT status, original_key FROM archive_files")
            assert f"its DSN (psql, [database] dsn of another tool): {dsn}" in (
                describe_database(config)
            )
            assert f"under {state}, running" in describe_database(config)
        assert rows == [{"status": "queued", "original_key": "k"}]
        assert not EmbeddedCluster(state / "pg").is_running()
    finally:
        discard(state / "pg")


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


_NEEDS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: the server then runs as another user, postgres"
)


@pytest.fixture
def private_root_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root-owned mode-700 directory, like /root in containers and cloud images."""
    locked = Path(tmp_path_factory.mktemp("locked"))
    locked.chmod(0o700)
    return locked


@_NEEDS_ROOT
@pytest.mark.integration
def test_state_dir_in_a_private_root_dir_gets_a_home_postgres_reaches(
    private_root_dir: Path,
) -> None:
    data = private_root_dir / "clone" / "var" / "pg"
    cluster = EmbeddedCluster(data, fast=True)
    try:
        with cluster:
            with psycopg.connect(cluster.dsn()) as conn:
                conn.execute("CREATE TABLE kept (v text)")
                conn.execute("INSERT INTO kept VALUES ('still here')")
            home = cluster.home
            assert home is not None and cluster.data_dir.is_relative_to(home)
            st = os.stat(home)
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (pwd.getpwnam("postgres").pw_uid, 0o700)
        # The user's own directory is left exactly as it was.
        st = os.stat(private_root_dir)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)
        # A later run finds the same cluster through the record in the state directory.
        assert (data.parent / pghome.RECORD_NAME).read_text().strip() == str(home)
        with EmbeddedCluster(data, fast=True) as again, psycopg.connect(again.dsn()) as conn:
            assert again.home == home
            assert conn.execute("SELECT v FROM kept").fetchall() == [("still here",)]
    finally:
        discard(data)
    assert not home.exists() and not (data.parent / pghome.RECORD_NAME).exists()


@_NEEDS_ROOT
def test_existing_cluster_out_of_reach_is_named_not_moved(private_root_dir: Path) -> None:
    data = private_root_dir / "state" / "pgdata"
    data.mkdir(parents=True)
    (data / "PG_VERSION").write_text("15\n")  # moving it would start an empty database
    with pytest.raises(EmbeddedClusterError, match="cannot traverse") as err:
        EmbeddedCluster(data, fast=True).start()
    assert str(data) in str(err.value) and "\n" not in str(err.value)
    assert not (data.parent / pghome.RECORD_NAME).exists()


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


def test_a_clean_run_stops_the_server_it_started_itself(pg_root: Path) -> None:
    """`derivd run` exits without the interpreter's teardown (derivd.osproc
    exit_without_teardown): that must never skip the embedded database's own stop and
    leave it to the watchdog. A `run --burst` derives its one queued job, exits 0, and the
    server it started is down when it has exited, stopped by it."""
    state = pg_root / f"clean-{os.getpid()}"
    state.mkdir()
    ini = state / "derivd.ini"
    ini.write_text(
        f"[supervisor]\nstate_dir = {state}\nworkers = 2\n[derive]\nbackend = noop\n",
        encoding="utf-8",
    )
    cluster = EmbeddedCluster(state / "pg")
    try:
        with database(Config().replace("supervisor", state_dir=str(state))) as dsn:
            sql(dsn, "INSERT INTO archive_files (status, original_key, original_version)"
                     " VALUES ('queued', 'k', 'v1')")  # fmt: skip
        ran = subprocess.run(
            [*derivd_command(), "-c", str(ini), "run", "--burst"], capture_output=True,
            text=True, timeout=120, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        assert "supervisor stopped code=0" in ran.stderr + ran.stdout
        assert not cluster.is_running()
        assert "derivd watchdog" not in cluster.log_file.read_text()
        with database(Config().replace("supervisor", state_dir=str(state)), read_only=True) as dsn:
            assert sql(dsn, "SELECT status FROM archive_files") == [{"status": "ready"}]
    finally:
        discard(state / "pg")


def test_the_embedded_server_stops_when_its_owner_is_killed(pg_root: Path) -> None:
    """After kill -9 of `derivd run`, the embedded PostgreSQL it started stayed up with
    no owner. Its watchdog now stops it once no derivd process uses the cluster."""
    state = pg_root / f"orphan-{os.getpid()}"
    state.mkdir()
    ini = state / "derivd.ini"
    ini.write_text(
        f"[supervisor]\nstate_dir = {state}\nworkers = 1\n[derive]\nbackend = noop\n"
        "[queue]\nlisten = no\n",
        encoding="utf-8",
    )
    log = state / "run.log"
    cluster = EmbeddedCluster(state / "pg")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*derivd_command(), "-c", str(ini), "run"], stdout=out, stderr=out,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        wait_for(lambda: "supervisor started" in log.read_text(), "the supervisor to start",
                 detail=log.read_text)  # fmt: skip
        assert cluster.is_running()
        proc.kill()
        proc.wait()
        wait_for(lambda: not cluster.is_running(), "the watchdog to stop the orphaned server",
                 detail=log.read_text)  # fmt: skip
        assert "derivd watchdog: no derivd process uses the cluster" in cluster.log_file.read_text()
        # The next command finds it stopped, starts it and stops it again on the way out.
        with database(Config().replace("supervisor", state_dir=str(state)), read_only=True):
            assert cluster.is_running()
        wait_for(lambda: not cluster.is_running(), "the server stopped after the command")
    finally:
        if proc.poll() is None:
            proc.kill()
        discard(state / "pg")
