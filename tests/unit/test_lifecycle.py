"""A worker's life as pure decisions (derivd.processes.lifecycle) and the pipe protocol
(derivd.processes.pipe): no fork, no database. gunicorn tests its arbiter this way."""

from __future__ import annotations

import json
import os
import signal
import uuid

import pytest

from derivd.config import QueueSettings
from derivd.processes.lifecycle import (
    EXIT_BOOT_ERROR,
    HEALTHY_AFTER,
    RESTART_MAX,
    BootFailure,
    CrashReturns,
    Exit,
    Slot,
    back_off,
    classify_exit,
    crash_returns,
    deadline_action,
    next_deadline,
    on_boot_failure,
    restart_delay,
    to_release,
)
from derivd.processes.pipe import (
    LINE_MAX,
    PROGRESS,
    WorkerProc,
    encode_lines,
    job_to_dict,
)
from derivd.processes.reasons import DeadlineAction, KillReason, StopReason
from derivd.queue.db import Job


def worker(**state: object) -> WorkerProc:
    proc = WorkerProc(
        pid=1, slot=1, generation=1, status_r=-1, progress_r=-1, cmd_w=-1, spawned_at=0.0
    )
    for name, value in state.items():
        setattr(proc, name, value)
    return proc


def job(file_id: int) -> Job:
    return Job(file_id, uuid.uuid4(), 1, "k", "v", 0.0)


def exited(code: int) -> int:
    """A wait status for a normal exit with `code`."""
    return code << 8


def signalled(sig: int) -> int:
    return int(sig)


@pytest.mark.parametrize(
    ("state", "status", "burst", "expected"),
    [
        ({"boot_error": "no storage"}, exited(3), False, Exit.BOOT_ERROR),
        ({}, exited(EXIT_BOOT_ERROR), False, Exit.BOOT_ERROR),
        ({"ready": True}, exited(EXIT_BOOT_ERROR), False, Exit.CRASH),  # booted: a crash
        ({"kill_reason": KillReason.TIMEOUT}, signalled(signal.SIGKILL), False, Exit.TIMEOUT),
        ({"kill_reason": KillReason.LEASE_LOST}, signalled(signal.SIGTERM), False, Exit.LEASE_LOST),
        ({"kill_reason": KillReason.SHUTDOWN}, signalled(signal.SIGKILL), False, Exit.RELEASE),
        ({"kill_reason": KillReason.ABORTED}, exited(0), False, Exit.RELEASE),
        ({"ready": True, "exit_reason": StopReason.MAX_JOBS}, exited(0), False, Exit.RECYCLED),
        ({"ready": True, "exit_reason": StopReason.RSS}, exited(0), False, Exit.RECYCLED),
        ({"ready": True, "exit_reason": StopReason.DRAINED}, exited(0), True, Exit.DRAINED),
        ({"ready": True, "exit_reason": StopReason.DRAINED}, exited(0), False, Exit.CRASH),
        ({"ready": True, "stop_sent": True}, exited(0), False, Exit.STOPPED),
        ({"ready": True}, exited(0), False, Exit.CRASH),  # exited unasked
        ({"ready": True}, signalled(signal.SIGKILL), False, Exit.CRASH),
        ({"ready": True, "stop_sent": True}, exited(1), False, Exit.CRASH),
    ],
)
def test_an_exit_means_what_the_facts_say(
    state: dict[str, object], status: int, burst: bool, expected: Exit
) -> None:
    assert classify_exit(worker(**state), status, burst=burst) is expected


def test_the_running_job_is_not_released_the_rest_is() -> None:
    running, unstarted, derived = job(1), job(2), job(3)
    proc = worker(held={j.id: j for j in (running, unstarted, derived)})
    proc.last_start = (running.token, 5.0)
    assert sorted(j.id for j in to_release(proc)) == [2, 3]
    proc.last_start = None  # killed before its first job started: everything goes back
    assert sorted(j.id for j in to_release(proc)) == [1, 2, 3]


def held_by(*jobs: Job, running: Job | None = None) -> WorkerProc:
    proc = worker(held={j.id: j for j in jobs})
    if running is not None:
        proc.last_start = (running.token, 5.0)
    return proc


def test_a_crashed_workers_jobs_all_go_back_the_running_one_counted() -> None:
    """Every job a dead worker reported claimed goes back at once; the
    one it was running is counted (worker_died), the rest burn no attempt."""
    settings = QueueSettings(max_attempts=3, retry_base=2.0, retry_max=60.0, retry_jitter=False)
    running, unstarted, derived = job(1), job(2), job(3)
    returns = crash_returns(held_by(derived, unstarted, running, running=running), settings)
    assert [r.job for r in returns.died] == [running]
    assert [j.id for j in returns.released] == [2, 3]
    (died,) = returns.died
    assert not died.last_attempt
    assert died.delay_s == 2.0  # the retry delay of attempt 1, as after any failure

    # Killed before its first job started: none ran, all go back unburned.
    assert crash_returns(held_by(running, unstarted), settings) == CrashReturns(
        [], [running, unstarted]
    )
    assert crash_returns(held_by(), settings) == CrashReturns([], [])


@pytest.mark.parametrize(("attempt", "last"), [(1, False), (2, False), (3, True), (4, True)])
def test_a_crash_on_the_last_allowed_attempt_is_final(attempt: int, last: bool) -> None:
    settings = QueueSettings(max_attempts=3, retry_base=1.0, retry_max=3.0, retry_jitter=False)
    running = Job(7, uuid.uuid4(), attempt, "k", "v", 0.0)
    (died,) = crash_returns(held_by(running, running=running), settings).died
    assert died.last_attempt is last
    assert died.delay_s == min(3.0, 2.0 ** (attempt - 1))


def test_restart_backoff_doubles_to_its_cap() -> None:
    delays = [restart_delay(n) for n in range(1, 10)]
    assert delays[:4] == [0.0, 0.5, 1.0, 2.0]
    assert delays == sorted(delays)
    assert restart_delay(10_000) == RESTART_MAX


def test_a_slot_backs_off_and_a_healthy_life_clears_its_count() -> None:
    slot = Slot()
    for _ in range(3):
        back_off(slot, 100.0, lived_s=1.0)
    assert slot.failures == 3
    assert slot.not_before == 100.0 + restart_delay(3)
    back_off(slot, 200.0, lived_s=HEALTHY_AFTER)
    assert (slot.failures, slot.not_before) == (1, 200.0)  # a fresh crash: respawn at once


@pytest.mark.parametrize(
    ("reloading", "booted_before", "expected"),
    [
        (True, False, BootFailure.ABORT_RELOAD),
        (True, True, BootFailure.ABORT_RELOAD),
        (False, True, BootFailure.RETRY),
        (False, False, BootFailure.HALT),
    ],
)
def test_a_boot_failure_aborts_a_reload_retries_or_halts(
    reloading: bool, booted_before: bool, expected: BootFailure
) -> None:
    assert on_boot_failure(reloading=reloading, booted_before=booted_before) is expected


def test_deadlines_time_out_then_escalate() -> None:
    running = job(1)
    proc = worker(held={1: running}, last_start=(running.token, 10.0))
    assert deadline_action(proc, 12.9, job_timeout=3.0) is None
    assert next_deadline(proc, 12.9, job_timeout=3.0, poll=0.2) == pytest.approx(13.0)
    assert deadline_action(proc, 13.0, job_timeout=3.0) is DeadlineAction.TIMEOUT
    proc.kill_reason, proc.kill_at = KillReason.TIMEOUT, 14.0  # TERM sent, KILL due at 14
    assert deadline_action(proc, 13.5, job_timeout=3.0) is None
    assert next_deadline(proc, 13.5, job_timeout=3.0, poll=0.2) == 14.0
    assert deadline_action(proc, 14.0, job_timeout=3.0) is DeadlineAction.KILL
    proc.killed = True
    assert deadline_action(proc, 20.0, job_timeout=3.0) is None


def test_an_idle_worker_has_no_deadline() -> None:
    assert next_deadline(worker(), 5.0, job_timeout=3.0, poll=0.2) == float("inf")


def test_long_lists_split_into_lines_below_pipe_buf_and_lose_nothing() -> None:
    jobs = [job_to_dict(job(n)) for n in range(200)]
    lines = encode_lines("claimed", "jobs", jobs)
    assert len(lines) > 1
    assert all(len(line) <= LINE_MAX + 1 and line.endswith(b"\n") for line in lines)
    decoded = [json.loads(line) for line in lines]
    assert [j for d in decoded for j in d["jobs"]] == jobs


def test_the_parent_reads_what_the_child_wrote() -> None:
    status_r, status_w = os.pipe()
    progress_r, progress_w = os.pipe()
    os.set_blocking(status_r, False)
    os.set_blocking(progress_r, False)
    proc = worker(status_r=status_r, progress_r=progress_r)
    first, second = job(7), job(8)
    try:
        for line in encode_lines("claimed", "jobs", [job_to_dict(first), job_to_dict(second)]):
            os.write(status_w, line)
        os.write(status_w, b'not json\n{"t": "ready"}\n{"t": "exi')  # cut mid-line
        os.write(progress_w, PROGRESS.pack(second.token.bytes, 1.0))
        for message in proc.read_messages():
            proc.apply(message)
        proc.read_progress()
        assert set(proc.held) == {7, 8} and proc.ready
        assert proc.running() == (proc.held[8], 1.0)
        os.write(status_w, b'ting", "reason": "max_jobs"}\n')
        os.write(status_w, b'{"t": "finished", "results": [[8, "ready", null, 0.1, 0.0]]}\n')
        for message in proc.read_messages():
            proc.apply(message)
        assert proc.exit_reason is StopReason.MAX_JOBS and set(proc.held) == {7}
        assert proc.running() is None
        os.close(status_w)
        status_w = -1
        assert proc.read_messages() == [] and proc.eof
    finally:
        for fd in (status_r, status_w, progress_r, progress_w):
            if fd >= 0:
                os.close(fd)


def test_a_reason_off_the_pipe_is_parsed_into_the_closed_set() -> None:
    """A worker's `exiting` reason is a StopReason or nothing: an unknown word (a child
    that wrote garbage) is judged as a crash, never compared as text."""
    assert StopReason.parse("max_jobs") is StopReason.MAX_JOBS
    assert StopReason.parse("Max_Jobs") is None
    assert StopReason.parse(None) is None
