"""Connection and session policy: how derivd opens a connection (autocommit,
keepalives, a pooler detected and respected), bounds its statements, and says in one
line that the database is unavailable."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
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
    dsn: str, *, application_name: str, bound_s: float | None
) -> tuple[psycopg.Connection[Any], bool]:
    """`connect`, and whether the connection goes through a pooler."""
    try:
        conn = psycopg.connect(
            dsn,
            autocommit=True,
            application_name=application_name,
            connect_timeout=10,
            **KEEPALIVES,
        )
    except psycopg.OperationalError as error:
        raise DatabaseUnavailable(f"database unavailable: {one_line(error)}") from None
    try:
        with bounded(conn, bound_s):
            pooled = is_pooled(conn)
            if pooled:
                conn.prepare_threshold = None
            elif bound_s is not None:
                conn.execute(query("session_timeouts"), _session_timeouts(bound_s), prepare=False)
    except psycopg.Error as error:
        conn.close()
        raise DatabaseUnavailable(f"database unavailable: {one_line(error)}") from None
    return conn, pooled


def _session_timeouts(bound_s: float) -> dict[str, str]:
    lock_s = min(bound_s, PARENT_LOCK_TIMEOUT_S)
    return {"statement": f"{int(bound_s * 1000)}ms", "lock": f"{int(lock_s * 1000)}ms"}


@contextmanager
def bounded(conn: psycopg.Connection[Any], seconds: float | None) -> Iterator[None]:
    """Run the block's statements on `conn` for at most `seconds` (None: no bound): past
    it the connection's socket is shut down, which fails the waiting read (psycopg raises
    OperationalError, the connection is broken). A client-side bound holds whatever sits
    between us and the server (a pooler waiting for a frozen server, a hung network)."""
    if seconds is None:
        yield
        return
    timer = threading.Timer(seconds, _shut_down, args=(conn,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _shut_down(conn: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(Exception), socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)


def is_pooled(conn: psycopg.Connection[Any]) -> bool:
    """Whether `conn` goes through a connection pooler: the server process that answers
    is not the one the connection was told about at start-up (a pooler such as PgBouncer
    hands out a process id of its own)."""
    row = conn.execute(query("backend_pid"), prepare=False).fetchone()
    return row is None or int(row[0]) != conn.info.backend_pid
