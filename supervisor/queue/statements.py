"""`Statements`: the one place that executes derivd's SQL. Every query API of
derivd.queue (worker, supervisor, maintenance, operator, backfill, client) builds on it;
each method is one named statement of sql/queries.sql in autocommit mode."""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Self

import psycopg
from psycopg.rows import dict_row

from derivd.queue.listener import on_channel
from derivd.queue.schema import check_schema_on
from derivd.queue.session import (
    DDL_LOCK_TIMEOUT_S,
    Bound,
    DatabaseUnavailable,
    LockBusy,
    bounded,
    is_pooled,
    open_connection,
)
from derivd.queue.sqlfiles import query
from derivd.redact import one_line


class Statements:
    """A connection (reopened when broken) and the statements run on it."""

    def __init__(self, conn: psycopg.Connection[Any], dsn: str | None = None) -> None:
        self.conn = conn
        self.dsn = dsn
        self.application_name = "derivd"
        self.bound_s: float | None = None  # the supervisor's connections: see `connect`
        self.generic_plans = False  # a worker's connection: see `open_connection`
        self._pooled: bool | None = None  # found when this handle opened `conn`
        # One statement at a time: a worker loop's threads share this handle.
        self._lock = threading.RLock()
        # Tokens claimed by a claim that did not wait for its WAL flush, so their
        # write-ahead prefix (`claim` in sql/queries.sql) may not be durable yet; emptied
        # by the next statement that writes and waits for its flush: WAL is flushed in
        # order, so that flush covers every claim committed before it.
        self._unflushed: set[uuid.UUID] = set()

    @classmethod
    def open(
        cls,
        dsn: str,
        *,
        role: str = "derivd",
        bound_s: float | None = None,
        generic_plans: bool = False,
    ) -> Self:
        """`bound_s`: every statement waits at most that long (the supervisor's own
        connections; a worker's statements are bounded by its job's deadline).
        `generic_plans`: a worker's connection (`open_connection`)."""
        name = f"{role}@{socket.gethostname()}"
        conn, pooled = open_connection(
            dsn, application_name=name, bound_s=bound_s, generic_plans=generic_plans
        )
        queue = cls(conn, dsn)
        queue.application_name = name
        queue.bound_s = bound_s
        queue.generic_plans = generic_plans
        queue._pooled = pooled
        return queue

    def _reconnect_if_broken(self) -> None:
        # After a database restart the old connection is dead; the next call gets a new
        # one (or DatabaseUnavailable, which the caller treats as transient).
        if (self.conn.closed or self.conn.broken) and self.dsn is not None:
            self.conn, self._pooled = open_connection(
                self.dsn,
                application_name=self.application_name,
                bound_s=self.bound_s,
                generic_plans=self.generic_plans,
            )

    def close(self) -> None:
        self.conn.close()

    def pooled(self) -> bool:
        """Whether this connection goes through a connection pooler (`is_pooled`): known
        since it was opened here (no second round trip), else asked once."""
        self._reconnect_if_broken()
        if self._pooled is None:
            try:
                self._pooled = is_pooled(self.conn)
            except psycopg.OperationalError as error:
                raise DatabaseUnavailable(f"database unavailable: {one_line(error)}") from None
        return self._pooled

    def check_schema(self) -> None:
        """SchemaMismatch unless the schema is this version's (module check_schema)."""
        self._reconnect_if_broken()
        check_schema_on(self.conn, bound_s=self.bound_s)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _cursor(self, bound_s: float | None = None) -> Iterator[psycopg.Cursor[dict[str, Any]]]:
        """`bound_s`: this statement's client-side bound, else the connection's."""
        with self._lock:
            yield from self._locked_cursor(bound_s or self.bound_s)

    def _locked_cursor(self, bound_s: float | None) -> Iterator[psycopg.Cursor[dict[str, Any]]]:
        self._reconnect_if_broken()
        bound = Bound(bound_s)
        try:
            with (
                bounded(self.conn, bound_s) as bound,
                self.conn.cursor(row_factory=dict_row) as cur,
            ):
                yield cur
        except psycopg.errors.LockNotAvailable:
            raise LockBusy("gave up waiting for a lock; retried later") from None
        except psycopg.OperationalError as error:
            raise bound.unavailable(error) from None

    def _all(
        self, name: str, params: dict[str, Any] | None = None, *, bound_s: float | None = None
    ) -> list[dict[str, Any]]:
        with self._cursor(bound_s) as cur:
            cur.execute(query(name), params or {})
            return cur.fetchall() if cur.description else []

    def _one(self, name: str, params: dict[str, Any] | None = None) -> dict[str, Any] | None:
        rows = self._all(name, params)
        return rows[0] if rows else None

    def _ddl(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        """`name` in a transaction of its own whose lock waits last at most
        DDL_LOCK_TIMEOUT_S (LockBusy past it): partition DDL, never queued for long."""
        with self._cursor() as cur, self.conn.transaction():
            cur.execute(query("lock_timeout"), {"timeout": f"{int(DDL_LOCK_TIMEOUT_S * 1000)}ms"})
            cur.execute(query(name), params)
            return cur.fetchall() if cur.description else []

    def _on_channel(self, name: str, channel: str) -> None:
        with self._cursor() as cur:
            cur.execute(on_channel(name, channel))
