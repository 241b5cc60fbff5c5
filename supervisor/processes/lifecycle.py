"""A worker's life as pure decisions: when to kill it, what its exit means, when its
slot may fork again.

The supervisor gathers the facts (the exit status from waitpid, what the child said on its
pipe, why the supervisor itself signalled it) and acts on the answer; nothing here forks,
signals or touches the database, so tests call these functions directly (as gunicorn's
own tests drive its arbiter).
"""

from __future__ import annotations

import math
import os
import random
import signal
from dataclasses import dataclass
from enum import StrEnum

from derivd.config import QueueSettings
from derivd.processes.pipe import WorkerProc
from derivd.processes.reasons import DeadlineAction, KillReason, StopReason
from derivd.queue.db import Job
from derivd.queue.retry import delay_after

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_BOOT_ERROR = 3  # gunicorn style: the parent halts instead of respawning

RESTART_BASE = 0.5  # seconds; a slot's second crash in a row waits this, then doubles
RESTART_MAX = 30.0
HEALTHY_AFTER = 30.0  # a worker that lived this long resets its slot's backoff


def overdue(worker: WorkerProc, now: float, *, job_timeout: float) -> list[Job]:
    """The jobs `worker` started and holds that have run `job_timeout` or longer since
    their own start (their derive began): the time a job waited held behind another
    one is never counted."""
    return [job for job, started in worker.in_flight() if now - started >= job_timeout]


def timed_out(worker: WorkerProc, now: float, *, job_timeout: float) -> Job | None:
    """The job a TIMEOUT kill fails: the first overdue job, oldest start first. A job
    started after it may also be past its own deadline when the supervisor looks (a late
    wake-up): it goes back unburned with the rest (`to_release`). A job that hangs on its
    own is the oldest in flight once the ones before it are done, so it is still
    charged, and attempts stay bounded."""
    late = overdue(worker, now, job_timeout=job_timeout)
    return late[0] if late else None


def deadline_action(worker: WorkerProc, now: float, *, job_timeout: float) -> DeadlineAction | None:
    """What the worker's deadlines call for now (None: nothing due): KILL, a TERM sent
    earlier has had its grace; TIMEOUT, a job in flight passed `job_timeout` (`overdue`
    names it)."""
    if worker.kill_at is not None and now >= worker.kill_at and not worker.killed:
        return DeadlineAction.KILL
    if worker.kill_reason is None and overdue(worker, now, job_timeout=job_timeout):
        return DeadlineAction.TIMEOUT
    return None


def next_deadline(worker: WorkerProc, now: float, *, job_timeout: float, poll: float) -> float:
    """When the supervisor must look at `worker` again: its KILL escalation, the deadline
    of each job in flight, and (while it holds jobs) `poll` from now, to read a job start
    it was not woken for."""
    times = [math.inf]
    if worker.kill_at is not None and not worker.killed:
        times.append(worker.kill_at)
    if worker.held and worker.kill_reason is None:
        times.append(now + poll)
        times += [started + job_timeout for _, started in worker.in_flight()]
    return min(times)


class Exit(StrEnum):
    BOOT_ERROR = "boot_error"  # never booted: halt, back off or abort a reload
    TIMEOUT = "timeout"  # killed past job_timeout: fail its running attempt
    LEASE_LOST = "lease_lost"  # killed by the heartbeat: its running job is not ours
    RELEASE = "release"  # killed at shutdown or for an aborted reload: release its jobs
    RECYCLED = "recycled"  # max_jobs or RSS: replace at once
    DRAINED = "drained"  # --burst and nothing left: leave the slot empty
    STOPPED = "stopped"  # asked to stop (shutdown, reload) and did
    CRASH = "crash"  # anything else: replace, with backoff


@dataclass
class Slot:
    """One of the `[supervisor] workers` places the supervisor keeps filled."""

    failures: int = 0  # crashes in a row
    not_before: float = 0.0  # backoff: no respawn before this (monotonic)
    drained: bool = False  # --burst: this slot's worker found nothing left to do


def classify_exit(worker: WorkerProc, status: int, *, burst: bool) -> Exit:
    """Why `worker` ended, from its wait status and what the supervisor knows of it."""
    code = os.waitstatus_to_exitcode(status)
    if worker.boot_error is not None or (code == EXIT_BOOT_ERROR and not worker.ready):
        return Exit.BOOT_ERROR
    if worker.kill_reason is KillReason.TIMEOUT:
        return Exit.TIMEOUT
    if worker.kill_reason is KillReason.LEASE_LOST:
        return Exit.LEASE_LOST
    if worker.kill_reason in (KillReason.SHUTDOWN, KillReason.ABORTED):
        return Exit.RELEASE
    if code == EXIT_OK and worker.exit_reason in (StopReason.MAX_JOBS, StopReason.RSS):
        return Exit.RECYCLED
    if code == EXIT_OK and worker.exit_reason is StopReason.DRAINED and burst:
        return Exit.DRAINED
    if code == EXIT_OK and worker.stop_sent:
        return Exit.STOPPED
    return Exit.CRASH


def to_release(worker: WorkerProc, kind: Exit | None = None) -> list[Job]:
    """What a dead worker held that goes back without burning an attempt: every job but
    the one it was running (`WorkerProc.running`: started last, still held), whose
    attempt counts (the supervisor returns it, or its lease expires), so a job that
    kills workers cannot loop. A job held and not started did not run; one started
    before the running one had ended its derive (its store or commit was left): neither
    is charged for its neighbour. Killed for one job's timeout or lost lease (`kind`),
    everything else it held goes back: the supervisor has failed or recorded that job
    already (and taken it from `held`)."""
    if kind in (Exit.TIMEOUT, Exit.LEASE_LOST):
        return list(worker.held.values())
    running = worker.running()
    token = running[0].token if running else None
    return [j for j in worker.held.values() if j.token != token]


@dataclass(frozen=True)
class Returned:
    """The attempt a dead worker was running, as its supervisor gives it back
    (QueueDB.worker_died): counted, a `worker_died` event on it."""

    job: Job
    last_attempt: bool  # its last allowed attempt: rejected attempts_exhausted
    delay_s: float  # else claimable again after this: the retry delay of its attempt


@dataclass(frozen=True)
class CrashReturns:
    """Every job a crashed worker held, each given back at once (none waits for its
    lease): `died`, counted; `released`, without burning an attempt."""

    died: list[Returned]
    released: list[Job]


def crash_returns(
    worker: WorkerProc, settings: QueueSettings, *, rng: random.Random | None = None
) -> CrashReturns:
    """What becomes of each job a crashed worker (Exit.CRASH) held, by its own reports on
    its pipes: every job it said it claimed and gave no outcome for, whatever its stage.

    The job it was running (`WorkerProc.running`) goes back fenced by its token with its
    attempt counted: it may be what killed the worker, and a job that kills its workers
    must not loop (on its last allowed attempt it ends `attempts_exhausted`; otherwise it
    waits the retry delay of its attempt, as after any failure, so it does not kill the
    replacement at once). Every other job it held (claimed and not started, or past its
    derive and not committed) goes back without burning an attempt, as at a graceful
    stop (`to_release`)."""
    running = worker.running()
    died = []
    if running is not None:
        job = running[0]
        died.append(
            Returned(job, job.attempt >= settings.max_attempts, delay_after(job, settings, rng))
        )
    return CrashReturns(died, sorted(to_release(worker), key=lambda j: j.id))


def restart_delay(failures: int) -> float:
    """Seconds before a slot with `failures` crashes in a row forks again: the first
    crash respawns at once, then 0.5 s doubling to RESTART_MAX."""
    if failures <= 1:
        return 0.0
    return min(RESTART_MAX, RESTART_BASE * 2.0 ** min(failures - 2, 64))


def back_off(slot: Slot, now: float, *, lived_s: float | None = None) -> None:
    """Count one more failure of `slot` and set when it may fork again. A worker that
    lived HEALTHY_AFTER seconds (`lived_s`) first clears the count: an occasional crash
    never accumulates into a long wait."""
    if lived_s is not None and lived_s >= HEALTHY_AFTER:
        slot.failures = 0
    slot.failures += 1
    slot.not_before = now + restart_delay(slot.failures)


class BootFailure(StrEnum):
    ABORT_RELOAD = "abort_reload"  # the reloaded configuration cannot boot: keep the old
    RETRY = "retry"  # this configuration booted before (a database blip): back off
    HALT = "halt"  # the configuration never booted: stop with one line


def on_boot_failure(*, reloading: bool, booted_before: bool) -> BootFailure:
    """`reloading`: the worker belongs to a reloaded generation not yet proven;
    `booted_before`: a worker of its generation has been ready before."""
    if reloading:
        return BootFailure.ABORT_RELOAD
    if booted_before:
        return BootFailure.RETRY
    return BootFailure.HALT


def exit_text(status: int) -> str:
    """`signal SIGKILL` or `exit 3`, for the log."""
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit {os.waitstatus_to_exitcode(status)}"
