"""The heartbeat statement and the host registry on a real PostgreSQL: one
statement per host checks (and with renewal extends) every held lease, fenced by id +
token; hosts register, go stale after three missed heartbeats, are pruned
after the guard and deregister on a clean stop. All times are the database's."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from configs import make_config, write_ini
from fixtures.work import HOST, commit_one, make_worker
from helpers import sql

from derivd.config import Config
from derivd.config_checks import ConfigError
from derivd.config_load import load_config
from derivd.ops.metrics import Metrics
from derivd.processes.duties import Heartbeat, held_jobs, lost_tokens, to_kill
from derivd.processes.pipe import WorkerProc, kept_starts
from derivd.queue.db import Job, QueueDB
from derivd.worker import JobResult
from derivd.worker_loop import run

LONG = 60.0


def enqueue(queue: QueueDB, n: int) -> list[int]:
    return queue.enqueue([(f"originals/{uuid.uuid4().hex}", "v1") for _ in range(n)])


def claim(queue: QueueDB, host: str = "host-a") -> Job:
    jobs = queue.claim_many(limit=1, lease_s=LONG, max_attempts=3, host=host)
    assert jobs
    return jobs[0]


def lease_until(dsn: str, file_id: int) -> float:
    """Seconds from the database's now() to the row's lease_until."""
    rows = sql(
        dsn,
        "SELECT extract(epoch FROM lease_until - now())::float8 AS left FROM archive_files "
        "WHERE id = %s",
        (file_id,),
    )
    return float(rows[0]["left"])


def test_claims_record_their_holder(queue: QueueDB, dsn: str) -> None:
    enqueue(queue, 2)
    a, b = claim(queue, "host-a"), claim(queue, "host-b")
    rows = {r["id"]: r["claimed_by"] for r in sql(dsn, "SELECT id, claimed_by FROM archive_files")}
    assert rows == {a.id: "host-a", b.id: "host-b"}


def test_heartbeat_finds_every_lost_lease_in_one_statement(queue: QueueDB, dsn: str) -> None:
    enqueue(queue, 4)
    kept, deleted, reclaimed, rejected = (claim(queue) for _ in range(4))
    queue.request_delete([deleted.id], actor="test")
    sql(
        dsn,
        "UPDATE archive_files SET lease_until = now() - interval '1s' WHERE id = %s",
        (reclaimed.id,),
    )
    again = queue.claim_many(limit=1, lease_s=LONG, max_attempts=3, host="host-b")
    assert [j.id for j in again] == [reclaimed.id] and again[0].token != reclaimed.token
    sql(
        dsn,
        "UPDATE archive_files SET status = 'rejected', error_code = 'processing_failed', "
        "lease_token = NULL, lease_until = NULL WHERE id = %s",
        (rejected.id,),
    )
    held = [kept, deleted, reclaimed, rejected]
    valid = queue.heartbeat(HOST, held, renew=False, lease_s=LONG)
    assert valid == {kept.id}
    # A job that is not held any more by this attempt but got no other holder: lost too.
    fake = replace(kept, token=uuid.uuid4())
    assert queue.heartbeat(HOST, [fake], renew=False, lease_s=LONG) == set()
    assert queue.heartbeat(HOST, [], renew=False, lease_s=LONG) == set()


@pytest.mark.parametrize("renew", [False, True])
def test_a_job_its_own_attempt_just_ended_is_not_lost(
    queue: QueueDB, dsn: str, renew: bool
) -> None:
    """Between a worker's fenced commit (or failure, or release) and its report reaching
    the supervisor, the heartbeat sees the row final: that attempt ended itself, it did
    not lose its lease. A row that moved on for another reason is lost."""
    enqueue(queue, 7)
    committed, retried, rejected, released, exhausted, reclaimed, by_hand = (
        claim(queue) for _ in range(7)
    )
    assert commit_one(queue, committed, [])
    assert queue.fail(retried, retry=True, code="processing_failed", max_attempts=3) == "queued"
    assert queue.fail(rejected, retry=False, code="corrupt_content", max_attempts=3) == "rejected"
    assert queue.release(released)
    # Lease lapsed: rejected as exhausted by maintenance, or reclaimed and committed by
    # another attempt. Rejected by an operator's own UPDATE.
    sql(
        dsn,
        "UPDATE archive_files SET lease_until = now() - interval '1s', attempts = 3 WHERE id = %s",
        (exhausted.id,),
    )
    assert queue.reject_exhausted(max_attempts=3) == [exhausted.id]
    sql(
        dsn,
        "UPDATE archive_files SET lease_until = now() - interval '1s' WHERE id = %s",
        (reclaimed.id,),
    )
    [again] = queue.claim_many(limit=1, lease_s=LONG, max_attempts=3, host="host-b")
    assert again.id == reclaimed.id and commit_one(queue, again, [])
    sql(
        dsn,
        "UPDATE archive_files SET status = 'rejected', error_code = 'processing_failed', "
        "lease_token = NULL, lease_until = NULL, updated_at = now() WHERE id = %s",
        (by_hand.id,),
    )
    held = [committed, retried, rejected, released, exhausted, reclaimed, by_hand]
    valid = queue.heartbeat(HOST, held, renew=renew, lease_s=LONG)
    assert valid == {committed.id, retried.id, rejected.id, released.id}
    assert lost_tokens(held, valid) == {exhausted.token, reclaimed.token, by_hand.token}


class ReportsHeldBack:
    """Worker hooks that are the supervisor's side of the pipe (WorkerProc), with one
    fault injected: each time the worker reports outcomes (its commit is done), the
    supervisor's heartbeat duty runs its round and decides whom to kill, as
    Supervisor.on_lost does, BEFORE the report arrives. That race, made to
    happen on every job."""

    def __init__(self, config: Config, supervisor_db: QueueDB) -> None:
        self.db = supervisor_db
        self.proc = WorkerProc(
            pid=1, slot=1, generation=1, status_r=-1, progress_r=-1, cmd_w=-1, spawned_at=0.0
        )
        self.lock = threading.Lock()  # a pipelined worker reports from its store lanes
        self.heartbeat = Heartbeat(
            lambda: config, None, Metrics(), lambda: [self.proc], on_lost=self.on_lost
        )
        self.raced: list[int] = []  # running job ids the heartbeat saw already final
        self.to_kill: list[WorkerProc] = []

    def on_lost(self, lost: set[uuid.UUID]) -> None:
        self.to_kill += to_kill([self.proc], lost)

    def jobs_claimed(self, jobs: Sequence[Job]) -> None:
        with self.lock:
            for job in jobs:
                self.proc.held[job.id] = job

    def job_started(self, job: Job) -> None:
        with self.lock:  # what read_progress keeps
            starts = [*self.proc.starts, (job.token, time.monotonic())]
            self.proc.starts = kept_starts(starts, self.proc.held.values(), self.proc.depth)

    def jobs_finished(self, results: Sequence[JobResult]) -> None:
        with self.lock:
            sent = held_jobs([self.proc])
            flying = {job.id for job, _ in self.proc.in_flight()}
            for result in results:
                done = result.job.id
                if done in flying and self.db.statuses([done]) == {done: "ready"}:
                    self.raced.append(done)
            self.heartbeat.on_heartbeat(sent, self.heartbeat.run_once(self.db, sent, busy=1))
            for result in results:  # the report arrives
                self.proc.held.pop(result.job.id, None)


@pytest.mark.parametrize("pipeline", [1, 2])
def test_a_heartbeat_never_kills_a_worker_whose_job_committed(
    queue: QueueDB, dsn: str, tmp_path: Path, pipeline: int
) -> None:
    config = make_config(
        dsn,
        fs_root=tmp_path / "store",
        derive={"backend": "noop"},
        supervisor={"pipeline": pipeline},
    )
    ids = enqueue(queue, 3)
    hooks = ReportsHeldBack(config, queue)
    worker = make_worker(config, dsn)
    hooks.proc.depth = worker.depth  # as its "ready" message tells the supervisor
    worker.hooks = hooks
    try:
        assert run(worker, lambda: False, burst=True) == "drained"
    finally:
        worker.close()
    assert sorted(hooks.raced) == ids  # the heartbeat ran after each commit, before its report
    assert hooks.to_kill == []
    rows = sql(dsn, "SELECT status FROM archive_files ORDER BY id")
    assert [r["status"] for r in rows] == ["ready"] * 3


def test_without_renewal_the_heartbeat_changes_no_lease(queue: QueueDB, dsn: str) -> None:
    [file_id] = enqueue(queue, 1)
    job = queue.claim_many(limit=1, lease_s=5.0, max_attempts=3, host="host-a")[0]
    before = sql(dsn, "SELECT lease_until, updated_at FROM archive_files WHERE id = %s", (file_id,))
    assert queue.heartbeat(HOST, [job], renew=False, lease_s=LONG) == {job.id}
    after = sql(dsn, "SELECT lease_until, updated_at FROM archive_files WHERE id = %s", (file_id,))
    assert after == before


def test_renewal_extends_exactly_the_held_leases_from_database_time(
    queue: QueueDB, dsn: str
) -> None:
    mine, other = enqueue(queue, 2)
    job = queue.claim_many(limit=1, lease_s=5.0, max_attempts=3, host="host-a")[0]
    theirs = queue.claim_many(limit=1, lease_s=5.0, max_attempts=3, host="host-b")[0]
    assert (job.id, theirs.id) == (mine, other)
    assert queue.heartbeat(HOST, [job], renew=True, lease_s=LONG) == {job.id}
    assert lease_until(dsn, mine) == pytest.approx(LONG, abs=2.0)
    assert lease_until(dsn, other) < 5.0  # another host's lease is not ours to extend
    stale = replace(theirs, token=uuid.uuid4())
    assert queue.heartbeat(HOST, [stale], renew=True, lease_s=LONG) == set()
    assert lease_until(dsn, other) < 5.0


def test_host_registers_refreshes_goes_stale_is_pruned_and_deregisters(
    queue: QueueDB, dsn: str
) -> None:
    queue.register_host(HOST)
    [row] = queue.hosts()
    assert (row["host"], row["pid"], row["alive"], row["busy"]) == ("host-a", 4242, True, 0)
    assert row["heartbeat_age_s"] < 5
    [file_id] = enqueue(queue, 1)
    job = claim(queue)
    queue.heartbeat(replace(HOST, busy=2), [job], renew=False, lease_s=LONG)
    [row] = queue.hosts()
    assert (row["busy"], row["in_flight"]) == (2, 1)
    # Three intervals (3 x 10 s) without a heartbeat: stale, still listed.
    sql(dsn, "UPDATE derivd_hosts SET last_heartbeat = now() - interval '31 seconds'")
    [row] = queue.hosts()
    assert row["alive"] is False and row["heartbeat_age_s"] >= 31
    assert queue.prune_hosts(guard_s=60) == []
    sql(dsn, "UPDATE derivd_hosts SET last_heartbeat = now() - interval '61 seconds'")
    assert queue.prune_hosts(guard_s=60) == ["host-a"]
    assert queue.hosts() == []
    # A heartbeat brings a pruned host back; a clean stop removes it (fenced on the pid).
    queue.heartbeat(HOST, [], renew=False, lease_s=LONG)
    queue.deregister_host("host-a", 1)
    assert [r["host"] for r in queue.hosts()] == ["host-a"]
    queue.deregister_host("host-a", 4242)
    assert queue.hosts() == []
    assert file_id


def test_a_restart_starts_the_row_again_and_a_heartbeat_keeps_its_start(
    queue: QueueDB, dsn: str
) -> None:
    """register_host and heartbeat share one upsert; only a (re)start resets started_at
    and busy. A host that is not stale is never pruned, however short the guard."""
    queue.register_host(HOST)
    sql(dsn, "UPDATE derivd_hosts SET started_at = started_at - interval '1 hour'")
    [before] = queue.hosts()
    queue.heartbeat(replace(HOST, busy=2), [], renew=False, lease_s=LONG)
    [beat] = queue.hosts()
    assert (beat["started_at"], beat["busy"]) == (before["started_at"], 2)
    assert queue.register_host(HOST) is None  # a live row: only the one shown is replaced
    queue.register_host(HOST, replacing=queue.host_holder(HOST.host))
    [restarted] = queue.hosts()
    assert restarted["started_at"] > before["started_at"] and restarted["busy"] == 0
    # Two of three intervals (10 s each) missed: alive, so a 5 s guard prunes nothing.
    sql(dsn, "UPDATE derivd_hosts SET last_heartbeat = now() - interval '20 seconds'")
    assert queue.hosts()[0]["alive"] is True
    assert queue.prune_hosts(guard_s=5) == []


def test_host_names_are_checked_by_the_database_too(queue: QueueDB) -> None:
    import psycopg

    for bad in ("", "a\nb", "x" * 201):
        with pytest.raises(psycopg.errors.CheckViolation):
            queue.register_host(replace(HOST, host=bad))


def test_lease_lost_is_recorded_only_when_the_lease_is_gone(queue: QueueDB, dsn: str) -> None:
    enqueue(queue, 1)
    job = claim(queue)
    assert queue.record_lease_lost(job) is False  # still ours: nothing recorded
    queue.request_delete([job.id], actor="test")
    assert queue.record_lease_lost(job) is True
    kinds = [r["kind"] for r in sql(dsn, "SELECT kind FROM archive_events ORDER BY id")]
    assert kinds == ["delete_requested", "lease_lost"]


# --------------------------------------------------------------------------- settings


def config_problems(tmp_path: Path, sections: dict[str, dict[str, str]]) -> list[str]:
    path = write_ini(tmp_path / "d.ini", sections)
    try:
        load_config(path, env={})
    except ConfigError as error:
        return [line.removeprefix(f"{path}: ") for line in str(error).splitlines()]
    return []


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        (
            {"queue": {"lease": "30", "heartbeat": "11"}, "supervisor": {"job_timeout": "20"}},
            "[queue] heartbeat: must be at most a third of [queue] lease (10s)",
        ),
        (
            {"queue": {"lease": "30", "heartbeat": "10"}, "supervisor": {"job_timeout": "120"}},
            "[supervisor] job_timeout: job_timeout + kill_grace (123s) must be at most 80% "
            "of [queue] lease (24s), or set [queue] renew = yes",
        ),
        ({"queue": {"renew": "maybe"}}, "[queue] renew: 'maybe' is not yes/no"),
        ({"queue": {"heartbeat": "-1"}}, "[queue] heartbeat: must be 0 or more"),
        ({"supervisor": {"host_id": "web\x01"}}, "[supervisor] host_id: must not contain control"),
        ({"supervisor": {"host_id": "é" * 101}}, "[supervisor] host_id: must be at most 200 bytes"),
    ],
)
def test_bad_heartbeat_settings_are_one_line_naming_section_and_key(
    tmp_path: Path, sections: dict[str, dict[str, str]], expected: str
) -> None:
    problems = config_problems(tmp_path, sections)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_renewal_lets_jobs_outlive_the_lease_and_defaults_fail_over_within_a_minute(
    tmp_path: Path,
) -> None:
    long_jobs = {
        "queue": {"lease": "30", "heartbeat": "10", "renew": "yes"},
        "supervisor": {"job_timeout": "600", "host_id": "rack-7/derivd-b"},
    }
    assert config_problems(tmp_path, long_jobs) == []
    defaults = Config()
    assert defaults.supervisor.host_id == "" and defaults.host_id == socket.gethostname()
    q, sup = defaults.queue, defaults.supervisor
    assert 30 <= q.lease + q.poll_interval <= 60  # a dead host's jobs come back this soon
    assert q.heartbeat_s == 10 and q.heartbeat_s <= q.lease / 3 and not q.renew
    assert sup.job_timeout + sup.kill_grace <= 0.8 * q.lease
    assert Config().replace("queue", lease=6.0).queue.heartbeat_s == 2.0  # automatic
