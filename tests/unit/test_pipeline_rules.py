"""The worker loop's decisions and the supervisor's view of its jobs, as pure functions
(derivd.pipeline, derivd.processes.lifecycle, derivd.processes.duties): the depth, the
claims, when a held job may start, what a stop, a crash or a timeout does to each job."""

from __future__ import annotations

import os
import random
import uuid

import pytest

from derivd.config import QueueSettings
from derivd.pipeline import (
    OnStop,
    Stage,
    StartTerms,
    capacity,
    claim_room,
    defer_commit,
    latest_start,
    may_start,
    on_stop,
    worker_depth,
)
from derivd.processes.child import crash_summary
from derivd.processes.duties import to_kill
from derivd.processes.lifecycle import (
    Exit,
    crash_returns,
    deadline_action,
    next_deadline,
    overdue,
    timed_out,
    to_release,
)
from derivd.processes.pipe import PROGRESS, WorkerProc
from derivd.queue.db import Job

F, D, S, C = Stage.HELD, Stage.DERIVING, Stage.STORING, Stage.COMMITTING


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
    got = claim_room(stages, limit=2, claiming=claiming, stopping=stopping, jobs_left=left)
    assert got == expected


@pytest.mark.parametrize(
    ("stages", "depth", "claiming", "replaced", "left", "expected"),
    [
        ([C], 2, 0, 0, None, 2),  # the last job commits: its place and the free one
        ([C, F], 2, 0, 0, None, 1),  # one waiting for its derive does not hold it back
        ([C, S], 2, 0, 0, None, 1),  # another job's store neither
        ([C, D], 3, 0, 0, None, 2),  # pipeline 3: fill it, the next but one too
        ([C, D, F], 3, 0, 0, None, 1),  # the steady state: one claim per commit
        ([C, D, F], 2, 0, 0, None, 0),  # full (a commit without a claim)
        ([C, C], 2, 1, 1, None, 1),  # two commits at once, the other's claim on its way
        ([C, C], 2, 1, 0, None, 0),  # ... a claim of its own on its way instead
        ([C, D], 2, 1, 0, None, 0),
        ([C], 2, 0, 0, 1, 0),  # max_jobs: the committing job is not done yet
        ([C, D], 3, 0, 0, 3, 1),  # max_jobs bounds it
    ],
)
def test_a_claim_that_rides_on_a_commit_takes_its_place_and_the_free_ones(
    stages: list[Stage],
    depth: int,
    claiming: int,
    replaced: int,
    left: int | None,
    expected: int,
) -> None:
    got = claim_room(
        stages,
        limit=depth,
        claiming=claiming,
        replaced=replaced,
        stopping=False,
        jobs_left=left,
        leaving=1,
    )
    assert got == expected
    stopped = claim_room(stages, limit=depth, claiming=claiming, stopping=True, leaving=1)
    assert stopped == 0


@pytest.mark.parametrize("seed", range(200))
def test_a_pipeline_never_holds_more_than_its_depth_as_its_supervisor_counts(seed: int) -> None:
    """Random interleavings of derives, commits (each reporting its job before admitting
    what its claim took) and claims of their own, at depths 2 and 3: the jobs held,
    committing ones included, never exceed the depth."""
    rng = random.Random(seed)
    depth = rng.choice((2, 3))
    held: list[list[object]] = []  # [stage, replaced, claimed rows]
    claims: list[tuple[list[object] | None, int]] = []  # (committing job or None, rows)
    for _ in range(60):
        claiming = sum(rows for _, rows in claims)
        replaced = sum(1 for job in held if job[1])
        moves = ["claim", "derive", "commit", "answer"]
        move = rng.choice(moves)
        stages = [job[0] for job in held]
        if move == "claim":
            rows = claim_room(stages, limit=depth, claiming=claiming, replaced=replaced,
                              stopping=False)  # fmt: skip
            if rows:
                claims.append((None, rows))
        elif move == "derive" and held:
            job = rng.choice(held)
            job[0] = {F: D, D: rng.choice((S, C)), S: C}.get(job[0], job[0])  # type: ignore[call-overload]
        elif move == "commit":
            ready = [job for job in held if job[0] is C and not job[1] and job not in
                     [c for c, _ in claims]]  # fmt: skip
            if ready:
                job = rng.choice(ready)
                rows = claim_room(stages, limit=depth, claiming=claiming, replaced=replaced,
                                  stopping=False, leaving=1)  # fmt: skip
                job[1] = rows > 0
                claims.append((job, rows))
        elif move == "answer" and claims:
            committing, rows = claims.pop(rng.randrange(len(claims)))
            if committing is not None:
                held.remove(committing)  # its outcome is reported first
            held.extend([F, False, 0] for _ in range(rng.randint(0, rows)))
        assert len(held) <= depth, (seed, held)


def test_depth_one_claims_only_when_empty() -> None:
    assert claim_room([], limit=1, claiming=0, stopping=False) == 1
    for stage in Stage:
        assert claim_room([stage], limit=1, claiming=0, stopping=False) == 0


def test_a_claim_batch_is_the_same_loop_holding_the_batch() -> None:
    """claim_batch = 4 runs at depth 1 holding up to 4: a claim of its own takes the
    batch when the loop is empty, and the last job's commit claims the next batch."""
    limit = capacity(worker_depth(2, 4, reads_original=True, stores_objects=True), 4)
    assert limit == 4
    assert claim_room([], limit=limit, batch=4, claiming=0, stopping=False) == 4
    assert claim_room([D, F, F], limit=limit, batch=4, claiming=0, stopping=False) == 0
    assert claim_room([C], limit=limit, batch=4, claiming=0, stopping=False, leaving=1) == 4
    assert capacity(3, 1) == 3


def test_a_stop_releases_every_held_job_and_drains_what_started() -> None:
    assert on_stop(F) is OnStop.RELEASE
    for stage in (D, S, C):
        assert on_stop(stage) is OnStop.DRAIN


TERMS = StartTerms(lease_s=45.0, job_timeout=30.0, kill_grace=3.0, renew=False)


def test_a_held_job_starts_only_while_its_lease_covers_a_whole_job() -> None:
    """Defaults (lease 45, job_timeout 30, kill_grace 3): a job claimed at 100 may start
    until 100 + 45 * 0.9 - 33 = 107.5; past that it goes back unburned, while its lease
    (until 145) still holds."""
    assert latest_start(100.0, TERMS) == pytest.approx(107.5)
    assert may_start(107.5, claimed_at=100.0, waited=True, terms=TERMS)
    assert not may_start(107.6, claimed_at=100.0, waited=True, terms=TERMS)
    # One that did not wait behind another always starts (no claim-release loop).
    assert may_start(500.0, claimed_at=100.0, waited=False, terms=TERMS)
    # With renew the heartbeat keeps every held lease ahead of it.
    renewed = StartTerms(lease_s=45.0, job_timeout=300.0, kill_grace=3.0, renew=True)
    assert may_start(10_000.0, claimed_at=100.0, waited=True, terms=renewed)


@pytest.mark.parametrize("seed", range(200))
def test_a_held_job_always_starts_or_goes_back_before_its_lease_ends(seed: int) -> None:
    """Jobs taken up in claim order, claimed whenever, each waiting for its original
    (the GET, up to job_timeout) and deriving up to job_timeout (longer ones are killed:
    the supervisor releases the rest). The loop's rules: a job past its latest start
    goes back at its turn, and as a job starts every job held behind it that is past
    its own latest start goes back. Each one's turn, or its release, comes while its
    lease holds, kill_grace to spare: a wait never costs a held job its lease."""
    rng = random.Random(seed)
    terms = TERMS
    held = sorted(rng.uniform(0.0, 90.0) for _ in range(12))
    now = 0.0
    while held:
        claimed_at = held.pop(0)
        now = max(now, claimed_at)  # its turn: the job ahead ended its derive
        assert now < claimed_at + terms.lease_s - terms.kill_grace, (seed, claimed_at, now)
        if not may_start(now, claimed_at=claimed_at, waited=True, terms=terms):
            continue  # goes back, fenced
        # Its GET: held jobs behind it that pass their latest start go back meanwhile
        # (within a poll of it), then the rest that are late as it starts.
        start = now + rng.uniform(0.0, terms.job_timeout)
        for other in [c for c in held if c <= start]:
            if not may_start(start, claimed_at=other, waited=True, terms=terms):
                back_at = max(other, min(start, latest_start(other, terms) + 0.2))
                assert back_at < other + terms.lease_s - terms.kill_grace
                held.remove(other)
        now = start + rng.uniform(0.0, terms.job_timeout)  # its derive


def test_a_commit_waits_for_the_next_only_in_a_batch_of_short_jobs() -> None:
    short = {"oldest_age_s": 0.01, "flush_after_s": 0.05}
    assert defer_commit(inline=True, next_held=True, **short)
    assert not defer_commit(inline=False, next_held=True, **short)  # a lane: never waits
    assert not defer_commit(inline=True, next_held=False, **short)  # nothing to share with
    assert not defer_commit(inline=True, next_held=True, oldest_age_s=0.05, flush_after_s=0.05)


def job(file_id: int) -> Job:
    return Job(file_id, uuid.uuid4(), 1, "k", "v", 0.0)


def proc(depth: int, *jobs: Job) -> WorkerProc:
    worker = WorkerProc(
        pid=1, slot=1, generation=1, status_r=-1, progress_r=-1, cmd_w=-1, spawned_at=0.0
    )
    worker.depth = depth
    worker.held = {j.id: j for j in jobs}
    return worker


def read_starts(worker: WorkerProc, *jobs: Job) -> None:
    read, write = os.pipe()
    os.set_blocking(read, False)
    worker.progress_r = read
    try:
        for n, j in enumerate(jobs):
            os.write(write, PROGRESS.pack(j.token.bytes, float(n)))
        worker.read_progress()
    finally:
        os.close(read)
        os.close(write)


def test_the_supervisor_reads_the_last_depth_starts_from_the_pipe() -> None:
    a, b, c = job(1), job(2), job(3)
    worker = proc(2, b, c)  # a was done with
    read_starts(worker, a, b, c)
    assert [(j.id, at) for j, at in worker.in_flight()] == [(2, 1.0), (3, 2.0)]
    assert worker.running() == (c, 2.0)
    worker.depth = 1
    worker.starts = worker.starts[-1:]
    assert [j.id for j, _ in worker.in_flight()] == [3]


def test_the_supervisor_keeps_the_depth_its_worker_reports_when_ready() -> None:
    """One function decides the depth (worker_depth, in the worker, which knows its
    backend); the supervisor keeps what the worker says."""
    worker = proc(1)
    worker.apply({"t": "ready", "cpu_s": 0.1, "depth": 3})
    assert worker.ready and worker.depth == 3
    older = proc(1)
    older.apply({"t": "ready", "cpu_s": 0.1})  # a worker that says nothing: one job
    assert older.depth == 1


def test_a_job_held_past_newer_starts_keeps_its_start() -> None:
    """A committing job while the pipeline's other place ran a job and started the next
    one (depth 2, three starts): its deadline still counts from its own start."""
    committing, done, deriving = job(1), job(2), job(3)
    worker = proc(2, committing, deriving)
    read_starts(worker, committing, done, deriving)
    assert [(j.id, at) for j, at in worker.in_flight()] == [(1, 0.0), (3, 2.0)]
    assert worker.running() == (deriving, 2.0)


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


def test_a_timeout_kill_fails_the_oldest_overdue_job_only() -> None:
    """A job started after a hanging one (its store hangs while the next derives): when
    the supervisor looks late, its deadline has passed too, but the kill is the first
    one's."""
    hanging, behind = job(1), job(2)
    worker = proc(2, hanging, behind)
    worker.starts = [(hanging.token, 10.0), (behind.token, 10.004)]
    assert timed_out(worker, 12.9, job_timeout=3.0) is None
    assert timed_out(worker, 13.0, job_timeout=3.0) == hanging
    assert overdue(worker, 13.5, job_timeout=3.0) == [hanging, behind]
    assert timed_out(worker, 13.5, job_timeout=3.0) == hanging
    # Once the first is done, a job that hangs on its own is charged itself.
    del worker.held[1]
    assert timed_out(worker, 13.5, job_timeout=3.0) == behind
    # A job held and not started has no deadline at all.
    worker.starts = [(hanging.token, 10.0)]
    assert overdue(worker, 100.0, job_timeout=3.0) == []


def test_a_crash_counts_the_running_job_only_and_a_kill_for_one_releases_the_others() -> None:
    """Only the job started last and still held ran when the worker died: the one
    started before it was past its derive, the unstarted one only held."""
    first, second, unstarted = job(1), job(2), job(3)
    worker = proc(2, first, second, unstarted)
    worker.starts = [(first.token, 1.0), (second.token, 2.0)]
    assert sorted(j.id for j in to_release(worker, Exit.CRASH)) == [1, 3]
    assert sorted(j.id for j in to_release(worker)) == [1, 3]
    settings = QueueSettings(max_attempts=1)
    returns = crash_returns(worker, settings)
    assert [r.job for r in returns.died] == [second] and returns.died[0].last_attempt
    assert [j.id for j in returns.released] == [1, 3]
    worker.starts = []  # none started: all three go back unburned
    assert crash_returns(worker, settings).died == []
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


@pytest.mark.parametrize(
    ("reads_original", "stores_objects", "expected"),
    [(True, True, 3), (True, False, 3), (False, True, 3), (False, False, 1)],
)
def test_a_backend_with_no_round_trip_to_overlap_runs_one_job_at_a_time(
    reads_original: bool, stores_objects: bool, expected: int
) -> None:
    """`noop` (no GET, no PUT) has nothing for a pipeline to overlap: depth 1."""
    depth = worker_depth(3, 1, reads_original=reads_original, stores_objects=stores_objects)
    assert depth == expected
    batch = worker_depth(3, 8, reads_original=reads_original, stores_objects=stores_objects)
    assert batch == 1  # a claim batch runs at depth 1


def test_a_worker_crash_names_the_module_it_could_not_import_and_no_user_text() -> None:
    missing = ModuleNotFoundError("No module named 'derivd.gone'", name="derivd.gone")
    assert crash_summary(missing) == "ModuleNotFoundError (module derivd.gone)"
    assert crash_summary(ValueError("secret=hunter2 in a path")) == "ValueError"
