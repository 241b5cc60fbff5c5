"""A worker process's main, from right after fork to its exit.

After fork a child: leaves the parent's process group, resets signals, dies with the
parent (PR_SET_PDEATHSIG), then opens its own database connection, storage client and
image library (`Worker.create`) and works until told to stop. It talks to the parent
through `derivd.processes.pipe`; its exit status means what `derivd.processes.lifecycle`
says.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from types import FrameType
from typing import NoReturn

from derivd.config import Config
from derivd.osproc import keep_freed_heap, set_proctitle
from derivd.processes.forked import become_child
from derivd.processes.lifecycle import EXIT_BOOT_ERROR, EXIT_CRASH, EXIT_OK
from derivd.processes.pipe import Reporter
from derivd.processes.reasons import StopReason
from derivd.redact import one_line
from derivd.worker import IdleWait, Worker
from derivd.worker_loop import run

log = logging.getLogger("derivd.worker")


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


def crash_summary(error: BaseException) -> str:
    """A worker crash's one line at ERROR: the exception's type only (its text may echo
    user content), and for a failed import the module it could not find, so that a
    broken install says what is missing instead of a restart every 30 s saying nothing."""
    name = type(error).__name__
    if isinstance(error, ImportError) and error.name:
        return f"{name} (module {error.name})"
    return name


def run_child(spec: ChildSpec) -> NoReturn:
    """Entry point right after fork. Never returns into the parent's stack: the parent's
    `finally` blocks (stopping the embedded database!) must not run in a child."""
    code = EXIT_CRASH
    try:
        code = _main(spec)
    except BaseException as error:  # the last line of defence; the parent respawns
        with contextlib.suppress(BaseException):
            log.error("worker %s crashed: %s", spec.slot, crash_summary(error))
            log.debug("worker crash detail: %s", error, exc_info=True)
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _after_fork(spec: ChildSpec, stop: ChildStop) -> None:
    # The list was taken before fork while the parent's database thread may have closed
    # a connection and the number gone to one of our own pipes: never close those.
    own = {spec.status_w, spec.progress_w, spec.cmd_r}
    become_child(spec.parent_pid, close_fds=set(spec.inherited_fds) - own, on_stop=stop.handle)


def _boot_error_text(error: BaseException) -> str:
    from derivd.errors import Transient
    from derivd.handlers.base import MissingEncoder
    from derivd.handlers.registry import UnknownHandler
    from derivd.storage.base import StorageConfigError

    if isinstance(error, Transient | StorageConfigError | UnknownHandler | MissingEncoder):
        return one_line(error)
    return f"{type(error).__name__}: {one_line(error)}"


def _jittered(n: int, rng: random.Random) -> int:
    # +-10% so that workers started together do not all recycle at the same moment.
    return 0 if n <= 0 else max(1, round(n * rng.uniform(0.9, 1.1)))


def _main(spec: ChildSpec) -> int:
    stop = ChildStop()
    _after_fork(spec, stop)
    keep_freed_heap()
    config = spec.config
    reporter = Reporter(
        spec.status_w,
        spec.progress_w,
        slot=spec.slot,
        max_rss_mb=config.supervisor.max_worker_rss_mb,
    )
    set_proctitle(f"derivd: worker {spec.slot} booting")
    try:
        worker = Worker.create(config, spec.dsn, hooks=reporter)
        worker.storage.check()
    except Exception as error:
        log.debug("worker %s boot failure detail", spec.slot, exc_info=True)
        reporter.send({"t": "boot_error", "msg": _boot_error_text(error)})
        return EXIT_BOOT_ERROR
    # No LISTEN here: the supervisor holds the one LISTEN connection and wakes idle
    # workers through cmd_r; poll_interval remains the fallback.
    idle = IdleWait([stop.wake_r, spec.cmd_r], on_wait=reporter.idle)
    # CPU since fork (a forked child's counters start at zero): what a worker's boot
    # costs, reported so a `run --burst` of an autoscaled host can be read for it.
    # Its depth (derivd.pipeline.worker_depth): how many job starts its supervisor keeps.
    reporter.send({"t": "ready", "cpu_s": round(time.process_time(), 4), "depth": worker.depth})
    reporter.busy()

    def should_stop() -> bool:
        return stop.requested or reporter.recycle or os.getppid() != spec.parent_pid

    max_jobs = _jittered(config.supervisor.max_jobs_per_worker, random.Random())
    try:
        reason = StopReason(
            run(worker, should_stop, idle=idle, burst=spec.burst, max_jobs=max_jobs)
        )
    finally:
        worker.close()
    if reason is StopReason.STOPPED and reporter.recycle and not stop.requested:
        reason = StopReason.RSS
    reporter.send({"t": "exiting", "reason": reason})
    return EXIT_OK
