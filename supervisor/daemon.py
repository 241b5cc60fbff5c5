"""`derivd run`: bring up the database and store, then work until stopped.

This is the single-process runner; the prefork supervisor builds on the same pieces.
Signal handlers only set a flag and write to a wake-up pipe; the loop does the rest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from types import FrameType

from supervisor.logs import event
from supervisor.runtime import database
from supervisor.settings import Config
from supervisor.storage import open_storage
from supervisor.worker import IdleWait, Worker

log = logging.getLogger("derivd")


class StopFlag:
    """Set by SIGTERM/SIGINT; the write to `wake_w` interrupts an idle wait at once."""

    def __init__(self) -> None:
        self.signals = 0
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1
        with contextlib.suppress(BlockingIOError):
            os.write(self.wake_w, b"x")

    def __call__(self) -> bool:
        return self.signals > 0


def run_daemon(config: Config, *, burst: bool = False) -> int:
    storage = open_storage(config)
    storage.check()  # refuse to start on a store without versions, before any claim
    stop = StopFlag()
    stop.install()
    with database(config) as dsn:
        worker = Worker.create(config, dsn)
        idle = IdleWait([stop.wake_r], dsn if config.queue.listen else None)
        event(log, "worker ready", backend=config.derive.backend, storage=storage.name)
        try:
            reason = worker.run(stop, idle=idle, burst=burst)
        finally:
            idle.close()
            worker.close()
    event(log, "stopped", reason=reason, jobs=worker.jobs_done)
    return 0
