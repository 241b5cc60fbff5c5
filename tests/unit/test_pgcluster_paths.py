"""The embedded PostgreSQL cluster without a server running: which binaries it finds, where
its home and socket live, what it refuses before starting. On real server binaries:
tests/acceptance/test_pgcluster.py."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from derivd.config import Config
from derivd.embedded import pgbin, pghome
from derivd.embedded.pgbin import PostgresNotFound, find_server_bindir
from derivd.embedded.pgcluster import EmbeddedCluster, EmbeddedClusterError
from derivd.embedded.runtime import database


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
    monkeypatch.setattr(pgbin, "SERVER_GLOB_ROOT", tmp_path / "no-postgresql")
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
    monkeypatch.setattr(pgbin, "SERVER_GLOB_ROOT", root)
    assert find_server_bindir() == root / "16" / "bin"


def test_read_only_commands_never_create_a_cluster(tmp_path: Path) -> None:
    config = Config().replace("supervisor", state_dir=str(tmp_path / "state"))
    with pytest.raises(EmbeddedClusterError, match=r"no embedded database under .*state"):
        with database(config, read_only=True):
            pass
    assert list(tmp_path.iterdir()) == []


def _me(home: Path) -> pghome.RunAs:
    return pghome.RunAs(os.geteuid(), os.getegid(), "me", tuple(os.getgroups()), str(home))


def test_homes_whose_state_dir_was_removed_are_swept(tmp_path: Path) -> None:
    run_as = _me(tmp_path / "server-home")
    (tmp_path / "server-home").mkdir()
    states = [tmp_path / name for name in ("kept", "removed")]
    for state in states:
        state.mkdir()
    homes = [pghome.make_home(state, run_as) for state in states]
    assert [pghome.recorded_home(state) for state in states] == homes
    for home in homes:
        assert home.parent == tmp_path / "server-home"
        assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    shutil.rmtree(states[1])  # `rm -rf var` in the other clone
    third = tmp_path / "third"
    third.mkdir()
    pghome.make_home(third, run_as)
    assert homes[0].exists() and not homes[1].exists()


def test_a_recorded_home_that_is_not_private_is_refused(tmp_path: Path) -> None:
    run_as = _me(tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    home = pghome.make_home(state, run_as)
    home.chmod(0o755)
    with pytest.raises(EmbeddedClusterError, match="not a private"):
        pghome.check_home(home, run_as)
    shutil.rmtree(home)
    assert pghome.check_home(home, run_as) is False  # gone: the caller makes a new one


def test_long_paths_fall_back_to_a_short_socket_dir(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120) / "pgdata"
    cluster = EmbeddedCluster(deep)
    assert len(str(cluster.socket_dir)) + len("/.s.PGSQL.65535") <= 107
    assert cluster.socket_dir == EmbeddedCluster(deep).socket_dir  # stable across restarts
