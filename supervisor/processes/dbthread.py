"""The supervisor's database threads: its database work, one task at a time per lane,
beside its loop. Two lanes, each a thread with its own connection: `lease` (the
heartbeat, which checks and renews every held lease, and the writes that end attempts)
and `maintenance` (stats, event partitions, exhausted rows, LISTEN): a slow statistics
round on a slow database never delays a lease renewal behind it.

The rounds of the background duties (derivd.processes.duties: heartbeat, exhausted
rows, stats, event partitions, LISTEN), failing the attempt of a worker killed past
`job_timeout`, releasing jobs and the host registry all run here. The loop hands a task
over (`submit`) and gets its result back as a callback it runs itself (`poll`), woken
through its signal pipe: it never waits on the network, so it reaps, replaces and kills
workers on time while the database hangs or refuses connections. The thread also reads
the LISTEN connection's notifications (`watch`).

Every statement here is bounded (derivd.queue.db.connect with `bound_s`: connecting by
the driver's connect timeout, each statement server-side on a direct connection and
client-side everywhere, which holds through a pooler whose server froze): a stuck
statement fails, and the next task reconnects. An outage is logged once and survived.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from derivd.queue.db import (
    PARENT_STATEMENT_TIMEOUT_S,
    DatabaseUnavailable,
    LockBusy,
    QueueDB,
    QueueListener,
)
from derivd.redact import one_line

log = logging.getLogger("derivd.supervisor")

IDLE_WAKE_S = 1.0  # the thread looks at its queue at least this often


@dataclass
class Task:
    name: str
    run: Callable[[QueueDB], Any]
    then: Callable[[Any], None] | None  # called in the loop with the result (None: failed)


class DatabaseThread:
    def __init__(
        self,
        dsn: str,
        *,
        wake: Callable[[], None],
        bound_s: float = PARENT_STATEMENT_TIMEOUT_S,
        lane: str = "maintenance",
    ) -> None:
        self.dsn = dsn
        self.lane = lane  # names its thread and its connection (pg_stat_activity)
        self.wake = wake  # wakes the loop (its signal pipe): thread-safe, never blocks
        self.bound_s = bound_s
        self.on_notify: Callable[[int], None] = lambda count: None
        self.listener: QueueListener | None = None  # read here; (re)opened by a duty
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._inflight: dict[str, int] = {}  # by name; loop thread only
        self._task_r, self._task_w = os.pipe()
        os.set_blocking(self._task_r, False)
        os.set_blocking(self._task_w, False)
        self._queue: QueueDB | None = None
        self._warned = False
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name=f"derivd-db-{lane}", daemon=True)

    # -- the loop's side (never blocks) ------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def watch(self, listener: QueueListener) -> None:
        """Read `listener`'s notifications (before `start`); a duty (re)connects it."""
        self.listener = listener

    def submit(
        self,
        name: str,
        run: Callable[[QueueDB], Any],
        then: Callable[[Any], None] | None = None,
        *,
        single: bool = False,
    ) -> bool:
        """Queue `run` for the thread; `then(result)` runs in the loop afterwards (with
        None when the database failed). `single`: skip it while another task of that
        name is queued or running (periodic work must not pile up during an outage)."""
        if single and self._inflight.get(name):
            return False
        self._inflight[name] = self._inflight.get(name, 0) + 1
        self._tasks.put(Task(name, run, then))
        with contextlib.suppress(BlockingIOError):
            os.write(self._task_w, b"t")
        return True

    def poll(self) -> None:
        """Run the callbacks of finished tasks and notifications, in order."""
        while True:
            try:
                callback = self._done.get_nowait()
            except queue.Empty:
                return
            callback()

    def fds(self) -> list[int]:
        """Descriptors a forked child must close (the thread's connections come and go:
        the child closes what it inherited of them by number, see child.py)."""
        fds = [self._task_r, self._task_w]
        listen = self.listener.conn if self.listener is not None else None
        for conn in (self._queue.conn if self._queue else None, listen):
            with contextlib.suppress(Exception):
                if conn is not None and not conn.closed:
                    fds.append(conn.fileno())
        return fds

    def stop_soon(self) -> None:
        """Let the thread end once the tasks queued so far are done (`close` waits)."""
        if self._thread.is_alive() and not self._stopping:
            self._stopping = True
            self._tasks.put(None)
            with contextlib.suppress(BlockingIOError):
                os.write(self._task_w, b"t")

    def close(self, timeout: float) -> None:
        """Finish the queued tasks within `timeout` seconds, then stop the thread; what is
        left when time runs out is dropped (leases expire on their own)."""
        if self._thread.is_alive():
            self.stop_soon()
            self._thread.join(timeout)
            self.poll()
        if not self._thread.is_alive():
            for fd in (self._task_r, self._task_w):
                with contextlib.suppress(OSError):
                    os.close(fd)

    # -- the thread --------------------------------------------------------------------

    def _main(self) -> None:
        try:
            while True:
                listen_fd = self.listener.fileno() if self.listener is not None else None
                fds = [self._task_r] + ([listen_fd] if listen_fd is not None else [])
                with contextlib.suppress(InterruptedError):
                    ready, _, _ = select.select(fds, [], [], IDLE_WAKE_S)
                    if listen_fd is not None and listen_fd in ready:
                        self._drain_notifies()
                with contextlib.suppress(BlockingIOError):
                    os.read(self._task_r, 4096)
                if not self._run_tasks():
                    return
        finally:
            if self._queue is not None:
                with contextlib.suppress(Exception):
                    self._queue.close()
            if self.listener is not None:
                self.listener.close()

    def _drain_notifies(self) -> None:
        assert self.listener is not None
        count = self.listener.drain()
        if count:
            self._post(lambda: self.on_notify(count))

    def _run_tasks(self) -> bool:
        """Everything queued, in order. False once told to stop."""
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                return True
            if task is None:
                return False
            result = self._run(task)
            self._post(lambda task=task, result=result: self._finish(task, result))  # type: ignore[misc]

    def _run(self, task: Task) -> Any:
        started = time.monotonic()
        try:
            if self._queue is None or self._queue.conn.closed or self._queue.conn.broken:
                if self._queue is not None:
                    self._queue.close()
                self._queue = None
                role = f"derivd-supervisor-{self.lane}"
                self._queue = QueueDB.open(self.dsn, role=role, bound_s=self.bound_s)
            result = task.run(self._queue)
        except DatabaseUnavailable as error:
            if not self._warned:
                waited = time.monotonic() - started
                log.warning("supervisor: %s (%s, after %.0fs)", error, task.name, waited)
                self._warned = True
            return None
        except LockBusy as error:
            log.info("supervisor: %s: %s", task.name, error)
            return None
        except psycopg.Error as error:  # not an outage: a schema missing, a bug
            log.warning("supervisor: %s failed: %s", task.name, one_line(error))
            return None
        self._warned = False
        return result

    def _post(self, callback: Callable[[], None]) -> None:
        self._done.put(callback)
        self.wake()

    def _finish(self, task: Task, result: Any) -> None:
        count = self._inflight.get(task.name, 0) - 1
        if count > 0:
            self._inflight[task.name] = count
        else:
            self._inflight.pop(task.name, None)
        if task.then is not None:
            task.then(result)
