"""The worker process side of the prefork supervisor.

After fork a child: leaves the parent's process group, resets signals, dies with the
parent (PR_SET_PDEATHSIG), then opens its own database connection, storage client and
image library (`Worker.create`). It reports to the parent over its status pipe, one JSON
object per line (each line is far below PIPE_BUF, so writes are atomic):

    {"t": "ready"}                                   booted, about to claim
    {"t": "boot_error", "msg": "..."}                could not boot; exit EXIT_BOOT_ERROR
    {"t": "started", "job": {...}, "at": <monotonic>} claimed a job (the parent's deadline)
    {"t": "finished", "outcome": ..., ...}          one attempt ended
    {"t": "exiting", "reason": "stopped|drained|max_jobs|rss"}

The parent writes to the child's command pipe to wake it from an idle wait (any byte
wakes it); stopping is SIGTERM (finish the current job, then exit), killing is SIGKILL
to the child's process group.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn

from supervisor.procutil import rss_mb, set_pdeathsig, set_proctitle
from supervisor.queue import Job, one_line
from supervisor.settings import Config
from supervisor.worker import IdleWait, JobResult, Worker

log = logging.getLogger("derivd.worker")

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_BOOT_ERROR = 3  # gunicorn style: the parent halts instead of respawning
WAKE = b"w"

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
    cmd_r: int
    parent_pid: int
    burst: bool
    inherited_fds: tuple[int, ...]  # the parent's pipes to other children: close them


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def job_to_dict(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "token": str(job.token),
        "attempt": job.attempt,
        "original_key": job.original_key,
        "original_version": job.original_version,
        "wait_s": job.wait_s,
    }


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
    """WorkerHooks over the status pipe; also decides an RSS recycle after each job."""

    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.recycle = False

    def send(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # the parent is gone; PR_SET_PDEATHSIG ends us
            os.write(self.spec.status_w, encode(message))

    def idle(self) -> None:
        set_proctitle(f"derivd: worker {self.spec.slot} idle")

    def job_started(self, job: Job) -> None:
        set_proctitle(f"derivd: worker {self.spec.slot} job {job.id}")
        self.send({"t": "started", "job": job_to_dict(job), "at": time.monotonic()})

    def job_finished(self, result: JobResult) -> None:
        limit = self.spec.config.supervisor.max_worker_rss_mb
        rss = rss_mb()
        if limit and rss > limit:
            self.recycle = True
        self.send(
            {
                "t": "finished",
                "job_id": result.job.id,
                "outcome": result.outcome,
                "code": result.code,
                "duration_s": result.duration_s,
                "wait_s": result.job.wait_s,
                "rss_mb": round(rss, 1),
            }
        )
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
    from handlers.registry import UnknownHandler
    from supervisor.outcomes import Transient
    from supervisor.storage import StorageConfigError

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
