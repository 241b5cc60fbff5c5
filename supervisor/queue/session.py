"""Connection and session policy: how derivd opens a connection (autocommit,
keepalives, a pooler detected and respected), bounds its statements, and says in one
line that the database is unavailable."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg

from derivd.errors import Transient
from derivd.queue.sqlfiles import query
from derivd.redact import one_line


class DatabaseUnavailable(Transient):
    """The database could not be reached or dropped the connection: retry later."""


class LockBusy(Exception):
    """A DDL statement gave up waiting for its lock (DDL_LOCK_TIMEOUT_S): retry later."""


# Every connection: TCP keepalives, so a server host that vanished (power, network) is
# noticed within about a minute instead of a read that waits forever.
KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 30,
                              "keepalives_interval": 10, "keepalives_count": 3}  # fmt: skip
# The supervisor's own statements (its database thread, LISTEN, the start-up check, the
# dashboard) wait at most this long: server-side on a direct connection
# (statement_timeout, lock_timeout), client-side everywhere (`bounded`: the socket is shut
# down), which is what holds through a pooler whose server froze.
PARENT_STATEMENT_TIMEOUT_S = 10.0
# Every connection's opening (TCP, TLS, authentication) waits at most this long.
CONNECT_TIMEOUT_S = 10
PARENT_LOCK_TIMEOUT_S = 5.0
# Partition DDL takes ACCESS EXCLUSIVE on archive_events: it waits at most this long for
# its lock (every job's commit would queue behind it), then gives up and is retried.
DDL_LOCK_TIMEOUT_S = 2.0


def connect(
    dsn: str, *, application_name: str = "derivd", bound_s: float | None = None
) -> psycopg.Connection[Any]:
    """Open an autocommit connection, or raise DatabaseUnavailable with one line.

    Through a transaction-mode pooler the next statement may run on another server
    connection, where a statement prepared on this one does not exist: there psycopg
    prepares nothing (`prepare_threshold = None`). A direct connection keeps psycopg's
    prepared statements, which spare the server a parse and plan per call.

    `bound_s` (the supervisor's connections): the pooler probe waits at most that long,
    and a direct connection gets it as its statement_timeout (PARENT_LOCK_TIMEOUT_S as
    its lock_timeout).
    """
    return open_connection(dsn, application_name=application_name, bound_s=bound_s)[0]


def open_connection(
    dsn: str, *, application_name: str, bound_s: float | None, generic_plans: bool = False
) -> tuple[psycopg.Connection[Any], bool]:
    """`connect`, and whether the connection goes through a pooler. `generic_plans`
    (a worker's connection): a direct connection plans each prepared statement once
    (`generic_plans` in sql/queries.sql)."""
    try:
        conn = psycopg.connect(
            dsn,
            autocommit=True,
            application_name=application_name,
            connect_timeout=CONNECT_TIMEOUT_S,
            **KEEPALIVES,
        )
    except psycopg.errors.ConnectionTimeout:
        raise StatementTimeout(
            f"the database did not answer within {CONNECT_TIMEOUT_S}s (connecting)"
        ) from None
    except psycopg.OperationalError as error:
        raise DatabaseUnavailable(f"database unavailable: {one_line(error)}") from None
    bound = Bound(bound_s)
    try:
        with bounded(conn, bound_s) as bound:
            pooled = is_pooled(conn)
            if pooled:
                conn.prepare_threshold = None
            else:
                if bound_s is not None:
                    timeouts = _session_timeouts(bound_s)
                    conn.execute(query("session_timeouts"), timeouts, prepare=False)
                if generic_plans:
                    conn.execute(query("generic_plans"), prepare=False)
    except psycopg.Error as error:
        conn.close()
        raise bound.unavailable(error) from None
    return conn, pooled


def _session_timeouts(bound_s: float) -> dict[str, str]:
    lock_s = min(bound_s, PARENT_LOCK_TIMEOUT_S)
    return {"statement": f"{int(bound_s * 1000)}ms", "lock": f"{int(lock_s * 1000)}ms"}


class StatementTimeout(DatabaseUnavailable):
    """A statement ran past its bound (derivd's client-side one, or the server's
    statement_timeout): the database did not answer in time."""


@dataclass
class Bound:
    """One `bounded` block: its limit, and whether the watchdog had to end it."""

    seconds: float | None
    fired: bool = False

    def unavailable(self, error: psycopg.Error) -> DatabaseUnavailable:
        """`error` (raised in the block) in one line: a StatementTimeout that says how
        long it waited when the bound ended it, else "database unavailable: ..."."""
        if self.fired or isinstance(error, psycopg.errors.QueryCanceled):
            return StatementTimeout(f"the database did not answer within {self.seconds:g}s")
        return DatabaseUnavailable(f"database unavailable: {one_line(error)}")


@contextmanager
def bounded(conn: psycopg.Connection[Any], seconds: float | None) -> Iterator[Bound]:
    """Run the block's statements on `conn` for at most `seconds` (None: no bound): past
    it the connection's socket is shut down, which fails the waiting read (psycopg raises
    OperationalError, the connection is broken; the Bound says it `fired`). A
    client-side bound holds whatever sits between us and the server (a pooler waiting
    for a frozen server, a hung network)."""
    bound = Bound(seconds)
    if seconds is None:
        yield bound
        return
    ticket = WATCHDOG.arm(conn, seconds, bound)
    try:
        yield bound
    finally:
        WATCHDOG.disarm(ticket)


class Watchdog:
    """The one thread of a process that shuts down the sockets of statements past their
    bound (`bounded`). Arming and disarming are a dict write under a lock: a thread per
    statement (threading.Timer) cost ~100 us of CPU, a tenth of a noop job's, on every
    bounded claim. The thread sleeps until the nearest deadline, and at most IDLE_S while
    nothing is armed, so arming never has to wake it unless its deadline comes first."""

    IDLE_S = 1.0

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._armed: dict[int, tuple[float, psycopg.Connection[Any], Bound]] = {}
        self._tickets = itertools.count()
        self._wakes_at = math.inf  # when the thread's current wait ends
        self._thread: threading.Thread | None = None

    def arm(self, conn: psycopg.Connection[Any], seconds: float, bound: Bound) -> int:
        deadline = time.monotonic() + seconds
        with self._cond:
            ticket = next(self._tickets)
            self._armed[ticket] = (deadline, conn, bound)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="derivd-bound", daemon=True)
                self._thread.start()
            elif deadline < self._wakes_at:
                self._cond.notify()
        return ticket

    def disarm(self, ticket: int) -> None:
        with self._cond:
            self._armed.pop(ticket, None)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for ticket, (deadline, conn, bound) in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[ticket]
                        bound.fired = True
                        _shut_down(conn)
                nearest = min((a[0] for a in self._armed.values()), default=now + self.IDLE_S)
                self._wakes_at = nearest
                self._cond.wait(max(0.0, nearest - now))


WATCHDOG = Watchdog()


def _new_watchdog_after_fork() -> None:
    # A forked child has no watchdog thread, and the lock may have been held at the fork.
    global WATCHDOG
    WATCHDOG = Watchdog()


os.register_at_fork(after_in_child=_new_watchdog_after_fork)


def _shut_down(conn: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(Exception), socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)


def is_pooled(conn: psycopg.Connection[Any]) -> bool:
    """Whether `conn` goes through a connection pooler: the server process that answers
    is not the one the connection was told about at start-up (a pooler such as PgBouncer
    hands out a process id of its own)."""
    row = conn.execute(query("backend_pid"), prepare=False).fetchone()
    return row is None or int(row[0]) != conn.info.backend_pid
