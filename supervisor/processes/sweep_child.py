"""The sweep duty: every `[sweep] interval` the supervisor forks a child for one pass.

A pass (derivd.ops.sweep.Sweeper) opens a storage client (boto3 for s3), and the parent
must never hold one: the next fork would hand it to a worker. So each round is a
short-lived child that runs one pass (derivd.ops.sweep.sweep_once, the same entry as
`derivd sweep`) and exits; one pass at a time; none in `--burst` (the supervisor does not
list this duty then) and no new one once a graceful stop has begun. A pass may outrun
its interval (the next one just waits for it); one still running after two intervals is
taken to hang and is killed. The pass's lease id is chosen here, before the fork: a pass
killed with its lease taken has it given back at once (`give_back`, through the
supervisor's database thread), so the next pass need not wait for the lease to expire.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from collections.abc import Callable

from derivd.config import Config
from derivd.logs import event
from derivd.osproc import set_proctitle
from derivd.processes.duties import Duty
from derivd.processes.forked import become_child, exit_code, fork_child

log = logging.getLogger("derivd.sweep")


class SweepChild(Duty[None]):
    """Its rounds run in a child of their own (the parent never imports the sweep's
    storage clients), so it has no `run_once` here: the child calls sweep_once."""

    name = "sweep"

    def __init__(
        self,
        config: Callable[[], Config],
        dsn: str,
        inherited_fds: Callable[[], tuple[int, ...]] = tuple,
        give_back: Callable[[list[uuid.UUID]], None] = lambda abandoned: None,
    ) -> None:
        super().__init__(config)
        self.dsn = dsn
        self.inherited_fds = inherited_fds  # the parent's descriptors, closed in the child
        self.give_back = give_back  # drops the leases of killed passes (`abandoned`)
        self.pid: int | None = None
        self.started = 0.0
        self.holder: uuid.UUID | None = None  # the running pass's lease id
        self.abandoned: list[uuid.UUID] = []  # leases of killed passes, to give back

    @property
    def interval(self) -> float:
        return self.config().sweep.interval

    def start(self, now: float) -> None:
        """The first pass one interval after start (the other duties went first)."""
        super().start(now)
        self.due_at = now + self.interval

    def tick(self, now: float) -> None:
        """Collect a finished pass, then launch one when due (none once stopping)."""
        self.reap()
        if self.pid is None:
            super().tick(now)
        self.give_back(self.abandoned)

    def stopping(self) -> None:
        """A graceful stop began: no new pass; a running one may finish."""
        self.active = False

    def launch(self) -> None:
        self.holder = uuid.uuid4()
        self.pid = fork_child(self._child, self.inherited_fds())
        self.started = time.monotonic()

    def reap(self) -> None:
        """Collect a finished pass; kill one that outlived two intervals."""
        if self.pid is None:
            return
        code = exit_code(self.pid)
        interval = self.interval
        if code is not None:
            if code != 0:
                event(log, "sweep pass failed", logging.WARNING, pid=self.pid)
            self.pid = None
        elif interval and time.monotonic() - self.started > 2 * interval:
            event(log, "sweep pass overran; killing it", logging.WARNING, pid=self.pid)
            os.kill(self.pid, signal.SIGKILL)
            if self.holder is not None:
                self.abandoned.append(self.holder)

    def stop(self) -> None:
        super().stop()
        if self.pid is None:
            return
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        self.pid = None
        if self.holder is not None:
            self.abandoned.append(self.holder)
        self.give_back(self.abandoned)

    def _child(self, parent: int, inherited_fds: tuple[int, ...]) -> None:
        code = 1
        try:
            become_child(parent, close_fds=inherited_fds)  # the parent's pipes are not ours
            set_proctitle("derivd: sweeper")
            from derivd.ops.sweep import sweep_once

            report = sweep_once(self.config(), self.dsn, holder=self.holder)
            code = 0 if report.error is None else 1
        finally:
            os._exit(code)
