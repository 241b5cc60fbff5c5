"""The worker process side of the prefork supervisor.

After fork a child: leaves the parent's process group, resets signals, dies with the
parent (PR_SET_PDEATHSIG), then opens its own database connection, storage client and
image library (`Worker.create`). It reports to the parent over its status pipe, one JSON
object per line (every line is kept below PIPE_BUF, split if need be, so writes are
atomic):

    {"t": "ready"}                                   booted, about to claim
    {"t": "boot_error", "msg": "..."}                could not boot; exit EXIT_BOOT_ERROR
    {"t": "claimed", "jobs": [{id, token, attempt}]} rows it now holds (one claim)
    {"t": "finished", "results": [[id, outcome, code, duration_s, wait_s], ...], "rss_mb": ...}
                                                     attempts that ended (one flush)
    {"t": "exiting", "reason": "stopped|drained|max_jobs|rss"}

and over its progress pipe, which the parent does not wait on (so a job start costs one
small write and no wake-up of the parent), a fixed-size record per job start: the lease
token and the CLOCK_MONOTONIC start time (the parent's deadline for that job).

The parent writes to the child's command pipe to wake it from an idle wait (any byte
wakes it); stopping is SIGTERM (finish the current job, release the unstarted ones,
then exit), killing is SIGKILL to the child's process group.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import select
import signal
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn

from derivd.config import Config
from derivd.jobs import IdleWait, JobResult, Worker
from derivd.processes.procutil import rss_mb, set_pdeathsig, set_proctitle
from derivd.queue.db import Job, one_line

log = logging.getLogger("derivd.worker")

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_BOOT_ERROR = 3  # gunicorn style: the parent halts instead of respawning
WAKE = b"w"
PROGRESS = struct.Struct("=16sd")  # lease token bytes, monotonic start time
LINE_MAX = select.PIPE_BUF - 1  # bytes of one status line, newline excluded

_RESET_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGCHLD,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


@dataclass(frozen=True)
class ChildSpec:
    slot: int
    config: Config
    dsn: str
    status_w: int
    progress_w: int
    cmd_r: int
    parent_pid: int
    burst: bool
    inherited_fds: tuple[int, ...]  # the parent's pipes to other children: close them


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def job_to_dict(job: Job) -> dict[str, Any]:
    """What the parent needs to fail or release the row."""
    return {"id": job.id, "token": str(job.token), "attempt": job.attempt}


def encode_lines(kind: str, key: str, items: Sequence[Any], **extra: Any) -> list[bytes]:
    """`{"t": kind, key: items, **extra}` as one line or, when that would reach
    PIPE_BUF, as several lines each carrying a share of `items` (each write stays
    atomic: lines of two children never interleave, and none is ever cut)."""
    line = encode({"t": kind, key: list(items), **extra})
    if len(line) <= LINE_MAX or len(items) <= 1:
        return [line]
    half = len(items) // 2
    return encode_lines(kind, key, items[:half], **extra) + encode_lines(
        kind, key, items[half:], **extra
    )


class ChildStop:
    """SIGTERM/SIGINT in a child: finish the current job, then exit. The write to the
    self-pipe ends an idle wait at once."""

    def __init__(self) -> None:
        self.requested = False
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        with contextlib.suppress(BlockingIOError):
            os.write(self.wake_w, b"x")


class Reporter:
    """WorkerHooks over the status and progress pipes; also decides an RSS recycle after
    each reported batch of outcomes."""

    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.recycle = False

    def send(self, message: dict[str, Any]) -> None:
        self.write(encode(message))

    def write(self, line: bytes) -> None:
        with contextlib.suppress(OSError):  # the parent is gone; PR_SET_PDEATHSIG ends us
            os.write(self.spec.status_w, line)

    def idle(self) -> None:
        set_proctitle(f"derivd: worker {self.spec.slot} idle")

    def jobs_claimed(self, jobs: Sequence[Job]) -> None:
        for line in encode_lines("claimed", "jobs", [job_to_dict(j) for j in jobs]):
            self.write(line)

    def job_started(self, job: Job) -> None:
        set_proctitle(f"derivd: worker {self.spec.slot} job {job.id}")
        # Blocking on purpose: the parent drains this pipe at least every few hundred ms;
        # a dropped record would make it time the wrong job.
        with contextlib.suppress(OSError):
            os.write(self.spec.progress_w, PROGRESS.pack(job.token.bytes, time.monotonic()))

    def jobs_finished(self, results: Sequence[JobResult]) -> None:
        limit = self.spec.config.supervisor.max_worker_rss_mb
        rss = rss_mb()
        if limit and rss > limit:
            self.recycle = True
        rows = [
            [r.job.id, r.outcome, r.code, round(r.duration_s, 6), round(r.job.wait_s, 6)]
            for r in results
        ]
        for line in encode_lines("finished", "results", rows, rss_mb=round(rss, 1)):
            self.write(line)
        self.idle()


def run_child(spec: ChildSpec) -> NoReturn:
    """Entry point right after fork. Never returns into the parent's stack: the parent's
    `finally` blocks (stopping the embedded database!) must not run in a child."""
    code = EXIT_CRASH
    try:
        code = _main(spec)
    except BaseException as error:  # the last line of defence; the parent respawns
        with contextlib.suppress(BaseException):
            # The type only at ERROR: the text may echo user content.
            log.error("worker %s crashed: %s", spec.slot, type(error).__name__)
            log.debug("worker crash detail: %s", error, exc_info=True)
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _after_fork(spec: ChildSpec, stop: ChildStop) -> None:
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # own group: the parent kills us and our helpers as one
    for sig in _RESET_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, stop.handle)
    signal.signal(signal.SIGINT, stop.handle)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # reloads are the parent's business
    set_pdeathsig(signal.SIGKILL)
    if os.getppid() != spec.parent_pid:  # the parent died before prctl took effect
        os._exit(EXIT_OK)
    for fd in spec.inherited_fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _boot_error_text(error: BaseException) -> str:
    from derivd.errors import Transient
    from derivd.handlers.registry import UnknownHandler
    from derivd.storage.base import StorageConfigError

    if isinstance(error, Transient | StorageConfigError | UnknownHandler):
        return one_line(error)
    return f"{type(error).__name__}: {one_line(error)}"


def _jittered(n: int, rng: random.Random) -> int:
    # +-10% so that workers started together do not all recycle at the same moment.
    return 0 if n <= 0 else max(1, round(n * rng.uniform(0.9, 1.1)))


def _main(spec: ChildSpec) -> int:
    stop = ChildStop()
    _after_fork(spec, stop)
    reporter = Reporter(spec)
    set_proctitle(f"derivd: worker {spec.slot} booting")
    config = spec.config
    try:
        worker = Worker.create(config, spec.dsn, hooks=reporter)
        worker.storage.check()
    except Exception as error:
        log.debug("worker %s boot failure detail", spec.slot, exc_info=True)
        reporter.send({"t": "boot_error", "msg": _boot_error_text(error)})
        return EXIT_BOOT_ERROR
    # No LISTEN here: the supervisor holds the one LISTEN connection and wakes idle
    # workers through cmd_r; poll_interval remains the fallback.
    idle = IdleWait([stop.wake_r, spec.cmd_r])
    reporter.send({"t": "ready"})
    reporter.idle()

    def should_stop() -> bool:
        return stop.requested or reporter.recycle or os.getppid() != spec.parent_pid

    max_jobs = _jittered(config.supervisor.max_jobs_per_worker, random.Random())
    try:
        reason = worker.run(should_stop, idle=idle, burst=spec.burst, max_jobs=max_jobs)
    finally:
        idle.close()
        worker.close()
    if reason == "stopped" and reporter.recycle and not stop.requested:
        reason = "rss"
    reporter.send({"t": "exiting", "reason": reason})
    return EXIT_OK
