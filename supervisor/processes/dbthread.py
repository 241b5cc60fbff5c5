"""The supervisor's own database work, on a thread beside its loop.

Heartbeats, failing the attempt of a worker killed past `job_timeout`, releasing jobs,
rejecting exhausted rows, queue stats, the host registry and the one LISTEN connection
all run here, one task at a time. The loop hands a task over (`submit`) and gets its
result back as a callback it runs itself (`poll`), woken through its signal pipe: it
never waits on the network, so it reaps, replaces and kills workers on time while the
database hangs or refuses connections.

Each task has its own bound: connecting gives up after the driver's connect timeout,
and a statement stuck longer than `task_timeout` (a server that accepts and never
answers) gets its socket shut down from the loop (`check_stuck`), which fails the
statement and lets the next task reconnect. An outage is logged once and survived.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from derivd.config import Config
from derivd.queue.db import DatabaseUnavailable, QueueDB, QueueListener, one_line

log = logging.getLogger("derivd.supervisor")

LISTEN_RETRY_MAX = 5.0  # seconds between attempts to reopen the LISTEN connection
TASK_TIMEOUT = 10.0  # seconds a statement may wait for its server (at least)


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
        listen: bool,
        listen_dsn: str = "",
        listen_retry: float = 1.0,
        task_timeout: float = 10.0,
    ) -> None:
        self.dsn = dsn
        self.wake = wake  # wakes the loop (its signal pipe): thread-safe, never blocks
        self.task_timeout = task_timeout
        self.listen_wanted = listen
        self.listen_retry = min(listen_retry, LISTEN_RETRY_MAX)
        self.on_notify: Callable[[int], None] = lambda count: None
        self.on_listening: Callable[[], None] = lambda: None
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._inflight: dict[str, int] = {}  # by name; loop thread only
        self._task_r, self._task_w = os.pipe()
        os.set_blocking(self._task_r, False)
        os.set_blocking(self._task_w, False)
        # Written by the thread, read by the loop (single values: atomic under the GIL).
        self._busy: tuple[float, int, Any] | None = None  # since, fd, peer
        self._queue: QueueDB | None = None
        # LISTEN needs a session of its own: a direct connection when dsn is a pooler.
        self._listener = QueueListener(listen_dsn or dsn) if listen else None
        self._warned = False
        self._thread = threading.Thread(target=self._main, name="derivd-db", daemon=True)

    @classmethod
    def for_supervisor(
        cls, dsn: str, config: Config, *, wake: Callable[[], None], listen: bool
    ) -> DatabaseThread:
        q = config.queue
        return cls(
            dsn,
            wake=wake,
            listen=listen,
            listen_dsn=config.database.listen_dsn,
            listen_retry=q.poll_interval,
            task_timeout=max(TASK_TIMEOUT, 2 * q.heartbeat_s),
        )

    # -- the loop's side (never blocks) ------------------------------------------------

    def start(self) -> None:
        self._thread.start()

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

    def pending(self, name: str | None = None) -> int:
        if name is None:
            return sum(self._inflight.values())
        return self._inflight.get(name, 0)

    def poll(self) -> None:
        """Run the callbacks of finished tasks and notifications, in order."""
        while True:
            try:
                callback = self._done.get_nowait()
            except queue.Empty:
                return
            callback()

    def check_stuck(self, now: float) -> None:
        """Fail a statement that has waited longer than `task_timeout` for its server:
        shutting its socket down wakes the thread's blocked read with an error."""
        busy = self._busy
        if busy is None or now - busy[0] < self.task_timeout:
            return
        since, fd, peer = busy
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return
        try:
            if sock.getpeername() == peer:  # still that connection, not a reused number
                sock.shutdown(socket.SHUT_RDWR)
                log.warning("supervisor: database did not answer for %.0fs", now - since)
        except OSError:
            pass
        finally:
            sock.close()
        self._busy = None

    def fds(self) -> list[int]:
        """Descriptors a forked child must close (the thread's connections come and go:
        the child closes what it inherited of them by number, see child.py)."""
        fds = [self._task_r, self._task_w]
        for conn in (self._queue.conn if self._queue else None, self._listen_conn()):
            with contextlib.suppress(Exception):
                if conn is not None and not conn.closed:
                    fds.append(conn.fileno())
        return fds

    def close(self, timeout: float) -> None:
        """Finish the queued tasks within `timeout` seconds, then stop the thread; what is
        left when time runs out is dropped (leases expire on their own)."""
        if self._thread.is_alive():
            self._tasks.put(None)
            with contextlib.suppress(BlockingIOError):
                os.write(self._task_w, b"t")
            deadline = time.monotonic() + timeout
            while self._thread.is_alive() and time.monotonic() < deadline:
                self._thread.join(min(0.05, max(0.0, deadline - time.monotonic())))
                self.check_stuck(time.monotonic())
            self.poll()
        if not self._thread.is_alive():
            for fd in (self._task_r, self._task_w):
                with contextlib.suppress(OSError):
                    os.close(fd)

    # -- the thread --------------------------------------------------------------------

    def _listen_conn(self) -> psycopg.Connection[Any] | None:
        return self._listener.conn if self._listener is not None else None

    def _main(self) -> None:
        listen_retry_at = 0.0
        try:
            while True:
                now = time.monotonic()
                if self._listener is not None and not self._listener.connected:
                    if now >= listen_retry_at and self._open_listener():
                        self._post(self.on_listening)
                    listen_retry_at = now + self.listen_retry
                listen_fd = self._listener.fileno() if self._listener else None
                fds = [self._task_r] + ([listen_fd] if listen_fd is not None else [])
                with contextlib.suppress(InterruptedError):
                    ready, _, _ = select.select(fds, [], [], self.listen_retry)
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
            if self._listener is not None:
                self._listener.close()

    def _open_listener(self) -> bool:
        # Bounded by the driver's connect timeout; LISTEN itself is one round trip.
        return self._listener is not None and self._listener.connect()

    def _drain_notifies(self) -> None:
        assert self._listener is not None
        count = self._listener.drain()
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
        try:
            if self._queue is None or self._queue.conn.closed or self._queue.conn.broken:
                # A fresh connection before the statement, so the statement is the one
                # `check_stuck` watches (connecting is bounded by its own timeout).
                if self._queue is not None:
                    self._queue.close()
                self._queue = None
                self._queue = QueueDB.open(self.dsn, role="derivd-supervisor")
            db = self._queue
            result = self._bounded(lambda: task.run(db), db.conn)
        except DatabaseUnavailable as error:
            if not self._warned:
                log.warning("supervisor: %s", error)
                self._warned = True
            return None
        except psycopg.Error as error:  # not an outage: a schema missing, a bug
            log.warning("supervisor: %s failed: %s", task.name, one_line(error))
            return None
        self._warned = False
        return result

    def _bounded(self, call: Callable[[], Any], conn: psycopg.Connection[Any] | None = None) -> Any:
        """Run `call`, marked busy on `conn`'s socket so the loop can break a hang."""
        if conn is not None and not conn.closed:
            with contextlib.suppress(OSError):
                fd = conn.fileno()
                peer = socket.socket(fileno=os.dup(fd))
                try:
                    self._busy = (time.monotonic(), fd, peer.getpeername())
                finally:
                    peer.close()
        try:
            return call()
        finally:
            self._busy = None

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
