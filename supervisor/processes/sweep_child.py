"""The supervisor's periodic sweep, run in a short-lived forked child.

A sweep opens a storage client (boto3 for s3), and the parent must never hold one: the
next fork would hand it to a worker. So every `[sweep] interval` the supervisor forks a
child that runs one `sweep_once` pass and exits; one pass at a time. A pass may outrun
its interval (the next one just waits for it); one still running after two intervals is
taken to hang and is killed. The pass's lease id is chosen here, before the fork: a pass
killed with its lease taken leaves it to the supervisor to give back (`abandoned`), so
the next pass need not wait for the lease to expire.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import uuid

from derivd.config import Config
from derivd.ops.logs import event
from derivd.processes.procutil import set_pdeathsig, set_proctitle

log = logging.getLogger("derivd.sweep")


class SweepChild:
    def __init__(self) -> None:
        self.pid: int | None = None
        self.started = 0.0
        self.next_at = 0.0  # monotonic; the first pass runs one interval after start
        self.holder: uuid.UUID | None = None  # the running pass's lease id
        self.abandoned: list[uuid.UUID] = []  # leases of killed passes, to give back

    def schedule(self, config: Config, now: float) -> None:
        if not self.next_at:
            self.next_at = now + config.sweep.interval

    def due(self, config: Config, now: float) -> bool:
        return config.sweep.interval > 0 and self.pid is None and now >= self.next_at

    def start(self, config: Config, dsn: str, inherited_fds: tuple[int, ...] = ()) -> None:
        now = time.monotonic()
        self.next_at = now + config.sweep.interval
        self.holder = uuid.uuid4()
        pid = os.fork()
        if pid == 0:
            _child(config, dsn, self.holder, inherited_fds)
        self.pid, self.started = pid, now

    def reap(self, config: Config) -> None:
        """Collect a finished pass; kill one that outlived its interval."""
        if self.pid is None:
            return
        try:
            done, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            done, status = self.pid, 0
        if done:
            if os.waitstatus_to_exitcode(status) != 0:
                event(log, "sweep pass failed", logging.WARNING, pid=self.pid)
            self.pid = None
        elif config.sweep.interval and time.monotonic() - self.started > 2 * config.sweep.interval:
            event(log, "sweep pass overran; killing it", logging.WARNING, pid=self.pid)
            os.kill(self.pid, signal.SIGKILL)
            if self.holder is not None:
                self.abandoned.append(self.holder)

    def stop(self) -> None:
        if self.pid is None:
            return
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        self.pid = None
        if self.holder is not None:
            self.abandoned.append(self.holder)


def _child(config: Config, dsn: str, holder: uuid.UUID, inherited_fds: tuple[int, ...]) -> None:
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        set_pdeathsig()
        for fd in inherited_fds:  # the parent's pipes are not ours to hold open
            with contextlib.suppress(OSError):
                os.close(fd)
        set_proctitle("derivd: sweeper")
        from derivd.ops.sweep import sweep_once

        report = sweep_once(config, dsn, holder=holder)
        code = 0 if report.error is None else 1
    finally:
        os._exit(code)
