"""`derivd enqueue` interrupted between its uploads and its INSERT: every
original it stored is either a queued row or in the orphan registry, and the sweep
deletes the ones no row names. The interruption is a real one: the table is locked by a
second connection, the command blocks in its INSERT and gets SIGINT there."""

from __future__ import annotations

import os
import signal
import subprocess
import warnings
from pathlib import Path

import psycopg
from configs import make_config
from fixtures.cli import derivd_command
from helpers import wait_for

from derivd.ops.sweep import open_sweeper
from derivd.storage.fs import FsStorage

FILES = 150  # more than one batch of 100


def blocked_in_insert(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            # This database's enqueue only: the suite's other tests share the cluster.
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database() AND application_name LIKE 'derivd-enqueue%%'"
            " AND query LIKE '%%INSERT INTO archive_files%%')"
        ).fetchone()
    return bool(row and row[0])


def _ctrl_c_as_a_terminal_gives_it() -> None:
    """The enqueue gets SIGINT as from a shell: default disposition, not blocked, whatever
    the pytest worker that starts it inherited (in full parallel suites a second SIGINT
    was ignored too, so the child never saw them)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def keys_of(dsn: str, query: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        return {row[0] for row in conn.execute(query)}  # type: ignore[arg-type]


def test_an_interrupted_enqueue_leaves_its_originals_to_the_orphan_sweep(
    dsn: str, tmp_path: Path
) -> None:
    inbox, store = tmp_path / "in", tmp_path / "store"
    inbox.mkdir()
    for n in range(FILES):
        (inbox / f"{n:03}.jpg").write_bytes(b"original %d" % n)
    env = {
        **os.environ,
        "DERIVD_DATABASE_DSN": dsn,
        "DERIVD_STORAGE_BACKEND": "fs",
        "DERIVD_STORAGE_ROOT": str(store),
    }
    with psycopg.connect(dsn) as holder:
        holder.execute("LOCK TABLE archive_files IN EXCLUSIVE MODE")  # reads pass, no INSERT
        enqueue = subprocess.Popen(
            [*derivd_command(), "enqueue", str(inbox)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_ctrl_c_as_a_terminal_gives_it,
        )
        try:
            wait_for(lambda: blocked_in_insert(dsn), "enqueue blocked in its INSERT")
            enqueue.send_signal(signal.SIGINT)
            try:
                enqueue.wait(timeout=15)
            except subprocess.TimeoutExpired:
                # Seen twice in full parallel suites (never alone, nor by hand): the first
                # Ctrl-C left the enqueue waiting. Said aloud, then the second one a
                # user would press; the orphans are what this test is about.
                warnings.warn("derivd enqueue outlived its first SIGINT by 15 s", stacklevel=1)
                enqueue.send_signal(signal.SIGINT)
                enqueue.wait(timeout=60)
        finally:
            if enqueue.poll() is None:
                enqueue.kill()
                enqueue.wait()
        holder.rollback()

    stored = set(FsStorage(store).list_keys("originals/"))
    assert stored, "the first batch was uploaded before its INSERT"
    queued = keys_of(dsn, "SELECT original_key FROM archive_files")
    registered = keys_of(dsn, "SELECT key FROM pending_objects")
    assert not stored & queued  # interrupted: none of them was queued
    assert stored <= registered, f"{len(stored - registered)} originals nothing names"

    config = make_config(dsn, fs_root=store)
    with open_sweeper(config, dsn, orphan_guard=0) as sweeper:
        report = sweeper.run_once()
    assert set(report.orphans_deleted) >= stored
    assert not set(FsStorage(store).list_keys("originals/"))
    assert not registered & keys_of(dsn, "SELECT key FROM pending_objects")


def test_a_whole_enqueue_leaves_nothing_in_the_orphan_registry(dsn: str, tmp_path: Path) -> None:
    inbox, store = tmp_path / "in", tmp_path / "store"
    inbox.mkdir()
    for n in range(3):
        (inbox / f"{n}.jpg").write_bytes(b"original %d" % n)
    env = {
        **os.environ,
        "DERIVD_DATABASE_DSN": dsn,
        "DERIVD_STORAGE_BACKEND": "fs",
        "DERIVD_STORAGE_ROOT": str(store),
    }
    done = subprocess.run(
        [*derivd_command(), "enqueue", str(inbox)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    stored = set(FsStorage(store).list_keys("originals/"))
    assert len(stored) == 3
    assert stored == keys_of(dsn, "SELECT original_key FROM archive_files")
    assert not stored & keys_of(dsn, "SELECT key FROM pending_objects")
