"""The supervisor's decisions driven by fakes, as gunicorn tests its arbiter: a fake clock,
fake worker processes (real pipes, no fork: the test speaks for the child through the
real Reporter) and a fake database thread that records what the supervisor asks of the
database. What these cannot show (real forks, signals, PostgreSQL) is
tests/acceptance/test_supervisor.py's."""

from __future__ import annotations

import itertools
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from derivd.config import Config
from derivd.config_checks import ConfigError
from derivd.processes.lifecycle import RESTART_BASE
from derivd.processes.pipe import Reporter, WorkerProc
from derivd.processes.reasons import KillReason
from derivd.processes.supervisor import RunResult, Supervisor
from derivd.queue.db import Job

pytestmark = pytest.mark.unit

# Above the kernel's pid_max: no such process can exist, so a signal sent to it is lost.
_FAKE_PIDS = itertools.count(int(Path("/proc/sys/kernel/pid_max").read_text()) + 1000)


def exited(code: int) -> int:
    return code << 8


def key(job: Job) -> tuple[int, uuid.UUID, int]:
    """What identifies an attempt (the pipe carries no original key)."""
    return job.id, job.token, job.attempt


class Clock:
    """Monotonic time that moves only when the test says (it starts at the real one:
    a job start the Reporter records carries the real clock)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class RecordingQueue:
    """Stands in for QueueDB inside the fake thread: every call is recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            return "queued"

        return call


class FakeDatabaseThread:
    """What Supervisor uses of DatabaseThread; `run_all` performs what was submitted on a
    RecordingQueue and hands each result to its callback, as `poll` would."""

    def __init__(self) -> None:
        self.on_notify: Callable[[int], None] = lambda count: None
        self.pending: list[tuple[str, Callable[[Any], Any], Callable[[Any], None] | None]] = []
        self.queue = RecordingQueue()

    def submit(
        self, name: str, run: Callable[[Any], Any], then: Any = None, *, single: bool = False
    ) -> bool:
        self.pending.append((name, run, then))
        return True

    def run_all(self) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
        pending, self.pending = self.pending, []
        for _, run, then in pending:
            result = run(self.queue)
            if then is not None:
                then(result)
        calls, self.queue.calls = self.queue.calls, []
        return calls

    def names(self) -> list[str]:
        return [name for name, _, _ in self.pending]

    def start(self) -> None: ...
    def poll(self) -> None: ...
    def watch(self, listener: object) -> None: ...
    def close(self, timeout: float) -> None: ...
    def fds(self) -> list[int]:
        return []


@dataclass
class FakeChild:
    """The child's ends of a worker's pipes, written through the real Reporter."""

    proc: WorkerProc
    reporter: Reporter
    own_fds: tuple[int, ...]

    def ready(self) -> None:
        self.reporter.send({"t": "ready", "cpu_s": 0.0})

    def boot_error(self, text: str) -> None:
        self.reporter.send({"t": "boot_error", "msg": text})

    def claim(self, *ids: int) -> list[Job]:
        jobs = [Job(i, uuid.uuid4(), 1, f"originals/{i}", "v1", 0.0) for i in ids]
        self.reporter.jobs_claimed(jobs)
        return jobs

    def start(self, job: Job) -> None:
        self.reporter.job_started(job)


@dataclass
class Harness:
    sup: Supervisor
    clock: Clock
    db: FakeDatabaseThread
    children: list[FakeChild] = field(default_factory=list)

    def of_generation(self, generation: int) -> list[FakeChild]:
        return [c for c in self.children if c.proc.generation == generation]

    def live(self) -> list[FakeChild]:
        return [c for c in self.children if c.proc.pid in self.sup.workers]

    def exit(self, child: FakeChild, status: int) -> None:
        self.sup.read_all()
        self.sup.worker_exited(child.proc.pid, status)
        for fd in child.own_fds:
            os.close(fd)


@pytest.fixture
def harness() -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(reload: Callable[[], Config] | None = None, **supervisor: Any) -> Harness:
        config = Config().replace("supervisor", **{"workers": 2, **supervisor})
        clock, db = Clock(), FakeDatabaseThread()
        children: list[FakeChild] = []

        def spawn(slot: int, generation: int, start: object) -> WorkerProc:
            status_r, status_w = os.pipe()
            progress_r, progress_w = os.pipe()
            cmd_r, cmd_w = os.pipe()
            for fd in (status_r, progress_r, cmd_w):
                os.set_blocking(fd, False)
            proc = WorkerProc(
                next(_FAKE_PIDS), slot, generation, status_r, progress_r, cmd_w, clock()
            )
            reporter = Reporter(status_w, progress_w, slot=slot, max_rss_mb=0)
            children.append(FakeChild(proc, reporter, (status_w, progress_w, cmd_r)))
            return proc

        sup = Supervisor(
            config,
            "",
            reload=reload or (lambda: config),
            db_thread=db,
            spawn=spawn,
            clock=clock,  # type: ignore[arg-type]
        )
        made.append(Harness(sup, clock, db, children))
        return made[-1]

    yield make
    for h in made:
        for child in h.live():
            h.sup.workers.pop(child.proc.pid).close()
            for fd in child.own_fds:
                os.close(fd)


# -- boot failures -----------------------------------------------------------------------


def test_a_worker_that_cannot_boot_at_start_halts_with_its_reason(
    harness: Callable[..., Harness],
) -> None:
    h = harness()
    h.sup.manage_workers()
    first, second = h.children
    first.boot_error("cannot load handler faulty")
    h.exit(first, exited(3))
    assert h.sup.outcome == RunResult(1, "worker could not start: cannot load handler faulty")
    assert second.proc.kill_reason is KillReason.SHUTDOWN  # the rest of the fleet goes too
    h.sup.manage_workers()
    assert len(h.children) == 2  # and nothing is forked again: no fork loop


def test_a_boot_failure_once_the_fleet_booted_backs_off_instead_of_halting(
    harness: Callable[..., Harness],
) -> None:
    h = harness()
    h.sup.manage_workers()
    first, second = h.children
    first.ready()
    second.boot_error("database unavailable: connection refused")
    h.exit(second, exited(3))
    assert h.sup.outcome is None
    h.sup.manage_workers()
    (again,) = h.children[2:]  # a first failure forks again at once
    assert again.proc.slot == 2
    again.boot_error("database unavailable: connection refused")
    h.exit(again, exited(3))
    h.sup.manage_workers()
    assert len(h.children) == 3, "the second in a row waits out its backoff"
    h.clock.advance(RESTART_BASE)
    h.sup.manage_workers()
    assert [c.proc.slot for c in h.children[3:]] == [2]


# -- crashes -----------------------------------------------------------------------------


def test_a_crash_returns_every_job_at_once_the_running_one_counted(
    harness: Callable[..., Harness],
) -> None:
    h = harness(workers=1)
    h.sup.manage_workers()
    (child,) = h.children
    child.ready()
    running, waiting = child.claim(7, 8)
    child.start(running)
    h.exit(child, signal.SIGKILL)
    calls = h.db.run_all()
    died = [c for c in calls if c[0] == "worker_died"]
    released = [c for c in calls if c[0] == "release"]
    assert [key(c[1][0]) for c in died] == [key(running)]
    assert died[0][2]["max_attempts"] == h.sup.config.queue.max_attempts
    assert [key(c[1][0]) for c in released] == [key(waiting)]


def test_crashes_in_a_row_back_off_their_slot(harness: Callable[..., Harness]) -> None:
    h = harness(workers=1)
    h.sup.manage_workers()
    h.children[0].ready()
    h.exit(h.children[0], exited(1))
    h.sup.manage_workers()
    assert len(h.children) == 2, "the first crash respawns at once"
    h.exit(h.children[1], exited(1))
    h.sup.manage_workers()
    assert len(h.children) == 2, "the second waits"
    h.clock.advance(RESTART_BASE)
    h.sup.manage_workers()
    assert len(h.children) == 3


# -- deadlines ---------------------------------------------------------------------------


def test_a_job_past_its_timeout_is_killed_and_failed_fenced(
    harness: Callable[..., Harness],
) -> None:
    h = harness(workers=1)
    timeout = h.sup.config.supervisor.job_timeout
    h.sup.manage_workers()
    (child,) = h.children
    child.ready()
    (job,) = child.claim(5)
    child.start(job)
    h.sup.read_all()
    h.clock.advance(timeout / 2)
    h.sup.enforce_deadlines()
    assert child.proc.kill_reason is None
    h.clock.advance(timeout)
    h.sup.enforce_deadlines()
    assert child.proc.kill_reason is KillReason.TIMEOUT
    h.exit(child, signal.SIGTERM)
    (call,) = [c for c in h.db.run_all() if c[0] == "fail"]
    assert key(call[1][0]) == key(job)
    assert call[2]["code"] == "resource_limit" and call[2]["extra_event"] == "timeout"


# -- reloads -----------------------------------------------------------------------------


def test_sighup_with_a_broken_config_keeps_the_running_one(harness: Callable[..., Harness]) -> None:
    def broken() -> Config:
        raise ConfigError("derivd.ini: [supervisor] workers: must be at least 0")

    h = harness(reload=broken)
    h.sup.manage_workers()
    before = h.sup.config
    h.sup.handle_hup()
    assert (h.sup.config, h.sup.generation) == (before, 1)
    assert not any(c.proc.stop_sent for c in h.children)


def test_sighup_retires_the_old_workers_only_once_the_new_ones_boot(
    harness: Callable[..., Harness],
) -> None:
    h = harness(workers=1)
    h.sup.manage_workers()
    (old,) = h.children
    old.ready()
    h.sup.read_all()
    h.sup.handle_hup()
    h.sup.manage_workers()
    (new,) = h.of_generation(2)
    assert not old.proc.stop_sent, "no gap: the old worker serves until its successor boots"
    new.ready()
    h.sup.read_all()
    assert old.proc.stop_sent


def test_a_reload_whose_workers_cannot_boot_is_rolled_back(harness: Callable[..., Harness]) -> None:
    h = harness(workers=2)
    h.sup.manage_workers()
    for child in h.children:
        child.ready()
    h.sup.read_all()
    before = h.sup.config
    h.sup.handle_hup()
    h.sup.manage_workers()
    failing, other = h.of_generation(2)
    failing.boot_error("cannot load handler faulty")
    h.exit(failing, exited(3))
    assert (h.sup.config, h.sup.generation, h.sup.outcome) == (before, 1, None)
    assert other.proc.kill_reason is KillReason.ABORTED
    assert not any(c.proc.stop_sent for c in h.of_generation(1))
