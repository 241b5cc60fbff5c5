"""The worker loop's guarantees at every depth, each through a real `derivd run` against
real PostgreSQL (DESIGN.md "The lease protocol", "Pipelined worker"): a commit whose
answer was lost is sent again; a crash counts only the job that was running, every job
held behind it goes back unburned; `job_timeout` counts a job's own work, never its wait
behind another; a stop releases each held job once. Faults come from
tests/faulthandlers.py scripts and from the test's own database connection; every wait is
on an event, never a sleep."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

import psycopg
import pytest
from fixtures.daemon import DaemonRun, kinds, processing_rows
from helpers import sql, wait_for

from derivd.queue.db import QueueDB
from derivd.storage.base import new_original_key

DEPTHS = [1, 2]


@pytest.fixture
def daemon(supervisor: Callable[..., DaemonRun]) -> Callable[..., DaemonRun]:
    """`daemon(depth, queue={...}, ...)`: the `supervisor` fixture's `derivd run` (one
    worker, FAST leases and deadlines unless overridden) at `[supervisor] pipeline` =
    depth."""

    def make(depth: int, **settings: dict[str, str]) -> DaemonRun:
        return supervisor(**{**settings, "supervisor": {"pipeline": str(depth)}})

    return make


def enqueue_in_order(sup: DaemonRun, scripts: Sequence[str]) -> list[int]:
    """Queue the scripts so that they are claimed in the order given (priorities from
    high to low: rows queued together are otherwise claimed in no promised order)."""
    ids = []
    with QueueDB.open(sup.dsn, role="test") as queue:
        for n, script in enumerate(scripts):
            key = new_original_key()
            version = sup.storage.put(key, script.encode(), "text/plain")
            [file_id] = queue.enqueue([(key, version)], priority=len(scripts) - n)
            ids.append(file_id)
    return ids


def claimed(sup: DaemonRun, *file_ids: int) -> None:
    for file_id in file_ids:
        wait_for(lambda f=file_id: sup.status_is(f, "processing"), f"file {file_id} claimed")


def ready_once(sup: DaemonRun, file_id: int) -> None:
    """`ready` at its first attempt, derived once, never charged or timed out."""
    row = wait_for(lambda: sup.status_is(file_id, "ready"), f"file {file_id} ready")
    assert row["attempts"] == 1, (file_id, kinds(sup, file_id))
    events = kinds(sup, file_id)
    assert events.count("ready") == 1
    assert not {"worker_died", "timeout", "retry", "lease_lost"} & set(events), events


# -- a commit whose answer was lost ---------------------------------------------------


class RowLock:
    """The test's own transaction holding a row lock on one file: the worker's fenced
    commit of that row waits for it."""

    def __init__(self, dsn: str, file_id: int) -> None:
        self.conn = psycopg.connect(dsn)
        self.conn.execute("SELECT id FROM archive_files WHERE id = %s FOR UPDATE", (file_id,))

    def release(self) -> None:
        self.conn.rollback()
        self.conn.close()


def worker_waiting_on_a_lock(dsn: str) -> int | None:
    rows = sql(
        dsn,
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'derivd-worker-%%'"
        " AND wait_event_type = 'Lock'",
    )
    return rows[0]["pid"] if rows else None


@pytest.mark.parametrize("depth", DEPTHS)
def test_a_commit_whose_connection_dropped_is_sent_again_not_derived_again(
    daemon: Callable[..., DaemonRun], tmp_path: Path, depth: int
) -> None:
    """The fenced commit waits on a lock, the server ends the worker's connection under
    it, the lock goes: the commit is sent again and the file is `ready` at its first and
    only allowed attempt (before: `pipeline = 2` left it `processing` for a lease, then
    `rejected attempts_exhausted` with its variants stored)."""
    sup = daemon(depth, queue={"max_attempts": "1", "lease": "30"}).start()
    gate = tmp_path / "gate"
    [file_id] = enqueue_in_order(sup, [f"gate {gate}"])
    wait_for(Path(f"{gate}.started").exists, "the job deriving")
    lock = RowLock(sup.dsn, file_id)
    try:
        gate.touch()
        backend = wait_for(lambda: worker_waiting_on_a_lock(sup.dsn), "the commit waiting")
        [row] = sql(sup.dsn, "SELECT pg_terminate_backend(%s) AS ok", (backend,))
        assert row["ok"]
        # Sent again on a new connection, it waits for the same lock.
        wait_for(
            lambda: (worker_waiting_on_a_lock(sup.dsn) or backend) != backend,
            "the commit sent again",
        )
    finally:
        lock.release()
    ready_once(sup, file_id)
    assert "committing again" in sup.log()
    assert processing_rows(sup.dsn) == 0


# -- a crash with jobs held behind the running one -------------------------------------


@pytest.mark.parametrize("depth", [*DEPTHS, 3])
def test_a_crash_counts_only_the_running_job_and_returns_the_held_ones_unburned(
    daemon: Callable[..., DaemonRun], tmp_path: Path, depth: int
) -> None:
    """SIGKILL of the worker (an OOM kill, a decoder's segfault) while a job derives and
    depth - 1 jobs are held behind it (at depth 3 claimed by the commit of a job before
    it), with max_attempts = 1: the running one ends `attempts_exhausted` with the one
    `worker_died`, each held one goes back unburned and ends `ready` at attempt 1.
    Before: every held job was charged too."""
    sup = daemon(depth, queue={"max_attempts": "1", "lease": "30"})
    gate = tmp_path / "gate"
    first = ["ok"] if depth == 3 else []  # its commit claims the two behind the gate
    ids = enqueue_in_order(sup, [*first, f"gate {gate}", "ok", "ok"])
    running, behind = ids[len(first)], ids[len(first) + 1 :]
    held = behind[: depth - 1]
    sup.start()
    wait_for(Path(f"{gate}.started").exists, "the slow job deriving")
    claimed(sup, running, *held)
    [victim] = sup.workers()  # the one worker: its title names the running job
    assert sup.worker_on_job(running) == victim
    os.kill(victim, signal.SIGKILL)
    row = wait_for(lambda: sup.status_is(running, "rejected"), "the running job charged")
    assert row["error_code"] == "attempts_exhausted"
    assert kinds(sup, running).count("worker_died") == 1
    for file_id in behind:
        ready_once(sup, file_id)
    for file_id in held:
        assert kinds(sup, file_id).count("released") == 1
    assert processing_rows(sup.dsn) == 0


# -- job_timeout counts a job's own work ------------------------------------------------


@pytest.mark.parametrize("depth", DEPTHS)
def test_jobs_near_their_timeout_never_time_out_for_the_wait_behind_another(
    daemon: Callable[..., DaemonRun], depth: int
) -> None:
    """Jobs that each derive ~65 % of job_timeout (2.5 s of 3.8): at depth 2 each is
    claimed as the one before it starts, so it waits ~2.5 s before its own derive. Its
    deadline runs from its start: all `ready` at attempt 1, none killed, none sent back.
    Before: half of them were killed for `timeout` and derived twice."""
    # A lease that covers the wait and a whole job (2.5 + 3.8 + 1 s, and the margin).
    sup = daemon(depth, queue={"lease": "12"}).start()
    ids = enqueue_in_order(sup, ["sleep 2.5"] * 4)
    for file_id in ids:
        ready_once(sup, file_id)
        assert "released" not in kinds(sup, file_id)
    assert "job timed out" not in sup.log()


# -- a stop with held jobs --------------------------------------------------------------


@pytest.mark.parametrize("depth", DEPTHS)
def test_a_stop_releases_each_held_job_once_and_lets_the_running_one_finish(
    daemon: Callable[..., DaemonRun], tmp_path: Path, depth: int
) -> None:
    sup = daemon(depth, queue={"lease": "30"})
    gate = tmp_path / "gate"
    deriving, *behind = enqueue_in_order(sup, [f"gate {gate}", "ok", "ok"])
    held = behind[: depth - 1]
    sup.start()
    wait_for(Path(f"{gate}.started").exists, "the first job deriving")
    claimed(sup, deriving, *held)
    sup.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    wait_for(lambda: "stopping" in sup.log(), "the supervisor stopping")
    gate.touch()
    assert sup.wait_exit() == 0
    row = sup.row(deriving)
    assert (row["status"], row["attempts"]) == ("ready", 1)
    for file_id in behind:
        row = sup.row(file_id)
        assert (row["status"], row["attempts"], row["lease_token"]) == ("queued", 0, None)
        assert kinds(sup, file_id) == (["released"] if file_id in held else [])
    assert processing_rows(sup.dsn) == 0
