"""A pipelined worker's decisions and the supervisor's view of its jobs, as pure
functions (derivd.pipeline, derivd.processes.lifecycle, derivd.processes.duties)."""

from __future__ import annotations

import os
import uuid

import pytest

from derivd.pipeline import OnStop, Stage, claim_room, on_stop
from derivd.processes.duties import to_kill
from derivd.processes.lifecycle import Exit, deadline_action, next_deadline, overdue, to_release
from derivd.processes.pipe import PROGRESS, WorkerProc
from derivd.queue.db import Job

F, D, S, C = Stage.FETCHING, Stage.DERIVING, Stage.STORING, Stage.COMMITTING


@pytest.mark.parametrize(
    ("stages", "claiming", "stopping", "left", "expected"),
    [
        ([], 0, False, None, 1),  # empty: claim
        ([F], 0, False, None, 0),  # one waits for its derive already
        ([D], 0, False, None, 1),  # a derive starts: the next GET overlaps it
        ([S], 0, False, None, 1),  # PUTs out (may take long): the derive lane is free
        ([S, D], 0, False, None, 0),  # full
        ([D], 1, False, None, 0),  # a claim is on its way
        ([D], 0, True, None, 0),  # stopping: nothing new
        ([D], 0, False, 1, 0),  # max_jobs: the one in flight is the last
        ([D], 0, False, 2, 1),
        ([C], 0, False, None, 0),  # a commit is on its way: it carries the claim
    ],
)
def test_a_claim_of_its_own_waits_for_room_and_nothing_else_to_carry_it(
    stages: list[Stage], claiming: int, stopping: bool, left: int | None, expected: int
) -> None:
    got = claim_room(stages, depth=2, claiming=claiming, stopping=stopping, jobs_left=left)
    assert got == expected


@pytest.mark.parametrize(
    ("stages", "depth", "claiming", "stopping", "left", "expected"),
    [
        ([], 2, 0, False, None, 2),  # the last job committed: all the room
        ([F], 2, 0, False, None, 1),  # one waiting for its derive does not hold it back
        ([S], 2, 0, False, None, 1),  # another job's store neither
        ([D], 3, 0, False, None, 2),  # pipeline 3: fill it, the next but one too
        ([D, F], 3, 0, False, None, 1),  # the steady state: one claim per commit
        ([D, F], 2, 0, False, None, 0),  # full
        ([D], 3, 1, False, None, 1),  # a claim on its way holds its place only
        ([D, F], 2, 1, False, None, 0),
        ([C], 2, 1, False, None, 1),  # two commits at once: each claims one
        ([C, C], 2, 0, False, None, 2),  # a committing job holds no place
        ([C, D], 2, 0, False, 2, 0),  # ... but it is not done yet: max_jobs counts it
        ([D], 3, 0, True, None, 0),  # stopping
        ([D], 3, 0, False, 2, 1),  # max_jobs bounds it
        ([D], 3, 0, False, 1, 0),
    ],
)
def test_a_claim_that_rides_on_a_commit_takes_the_room_there_is(
    stages: list[Stage],
    depth: int,
    claiming: int,
    stopping: bool,
    left: int | None,
    expected: int,
) -> None:
    got = claim_room(
        stages, depth=depth, claiming=claiming, stopping=stopping, jobs_left=left, folded=True
    )
    assert got == expected


def test_depth_one_claims_only_when_empty() -> None:
    assert claim_room([], depth=1, claiming=0, stopping=False) == 1
    for stage in Stage:
        assert claim_room([stage], depth=1, claiming=0, stopping=False) == 0


def test_a_stop_releases_what_was_claimed_ahead_and_drains_what_runs() -> None:
    assert on_stop(F, prefetched=True) is OnStop.RELEASE
    assert on_stop(F, prefetched=False) is OnStop.DRAIN  # a one-job worker's own job
    for stage in (D, S):
        for prefetched in (True, False):
            assert on_stop(stage, prefetched=prefetched) is OnStop.DRAIN


def job(file_id: int) -> Job:
    return Job(file_id, uuid.uuid4(), 1, "k", "v", 0.0)


def proc(depth: int, *jobs: Job) -> WorkerProc:
    worker = WorkerProc(
        pid=1, slot=1, generation=1, status_r=-1, progress_r=-1, cmd_w=-1, spawned_at=0.0
    )
    worker.depth = depth
    worker.held = {j.id: j for j in jobs}
    return worker


def test_the_supervisor_reads_the_last_depth_starts_from_the_pipe() -> None:
    a, b, c = job(1), job(2), job(3)
    worker = proc(2, a, b, c)
    read, write = os.pipe()
    os.set_blocking(read, False)
    worker.progress_r = read
    try:
        for n, j in enumerate((a, b, c)):
            os.write(write, PROGRESS.pack(j.token.bytes, float(n)))
        worker.read_progress()
    finally:
        os.close(read)
        os.close(write)
    assert [(j.id, at) for j, at in worker.in_flight()] == [(2, 1.0), (3, 2.0)]
    assert worker.running() == (c, 2.0)
    worker.depth = 1
    worker.starts = worker.starts[-1:]
    assert [j.id for j, _ in worker.in_flight()] == [3]


def test_each_job_in_flight_has_its_own_deadline() -> None:
    first, second = job(1), job(2)
    worker = proc(2, first, second)
    worker.starts = [(first.token, 10.0), (second.token, 11.0)]
    assert next_deadline(worker, 12.0, job_timeout=3.0, poll=5.0) == 13.0
    assert deadline_action(worker, 12.9, job_timeout=3.0) is None
    assert deadline_action(worker, 13.0, job_timeout=3.0) == "timeout"
    assert overdue(worker, 13.0, job_timeout=3.0) == [first]  # the other is not late
    assert overdue(worker, 14.0, job_timeout=3.0) == [first, second]
    del worker.held[1]  # the first finished: only the second's deadline is left
    assert next_deadline(worker, 12.0, job_timeout=3.0, poll=5.0) == 14.0


def test_a_crash_keeps_every_job_in_flight_and_a_kill_for_one_releases_the_others() -> None:
    first, second, unstarted = job(1), job(2), job(3)
    worker = proc(2, first, second, unstarted)
    worker.starts = [(first.token, 1.0), (second.token, 2.0)]
    assert to_release(worker, Exit.CRASH) == [unstarted]  # both in flight count
    assert to_release(worker) == [unstarted]
    del worker.held[1]  # timed out (or lost): the supervisor has dealt with it
    for kind in (Exit.TIMEOUT, Exit.LEASE_LOST):
        assert sorted(j.id for j in to_release(worker, kind)) == [2, 3]


def test_a_lost_lease_of_any_job_in_flight_kills_its_worker() -> None:
    waiting, deriving, unstarted = job(1), job(2), job(3)
    worker = proc(2, waiting, deriving, unstarted)
    worker.starts = [(waiting.token, 1.0), (deriving.token, 2.0)]
    assert to_kill([worker], {waiting.token}) == [worker]
    assert to_kill([worker], {unstarted.token}) == []  # it would fail its own commit
    worker.kill_reason = "lease_lost"
    assert to_kill([worker], {waiting.token}) == []  # being killed already
