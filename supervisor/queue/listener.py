"""LISTEN: the notification channels derivd's triggers send on, and the supervisor's
wake-up connection."""

from __future__ import annotations

from typing import Any, Final

import psycopg
from psycopg import sql

from derivd.queue.session import (
    PARENT_STATEMENT_TIMEOUT_S,
    DatabaseUnavailable,
    bounded,
    open_connection,
)
from derivd.queue.sqlfiles import query

# The notification channels, as the triggers in sql/functions.sql spell them
# (archive_files_notify_queued, archive_files_notify_finished): a row entering `queued`
# wakes the supervisors; a finished row wakes whoever waits for it (derivd.client.wait).
QUEUED_CHANNEL: Final = "derivd_queued"
FINISHED_CHANNEL: Final = "derivd_finished"


def on_channel(name: str, channel: str) -> sql.Composed:
    """`listen` or `unlisten` on `channel`, composed as an identifier."""
    return sql.SQL(query(name)).format(channel=sql.Identifier(channel))


class QueueListener:
    """One LISTEN connection on QUEUED_CHANNEL (held by the supervisor).

    `connect` (re)opens it and says how that went; `drain` reads whatever has arrived
    without blocking. Any database error closes the connection: the caller polls until a
    later `connect` succeeds, and notifications sent meanwhile are lost (hence the
    caller's wake-everyone after a reconnect, and the workers' poll_interval fallback).
    Every (re)connect checks for a pooler, where LISTEN would hear nothing: such a
    connection is closed again and reported `pooled`.
    """

    def __init__(
        self,
        dsn: str,
        *,
        bound_s: float | None = PARENT_STATEMENT_TIMEOUT_S,
        channel: str = QUEUED_CHANNEL,  # the webhook deliverer listens on its own
    ) -> None:
        self.dsn = dsn
        self.bound_s = bound_s
        self.channel = channel
        self.conn: psycopg.Connection[Any] | None = None

    @property
    def connected(self) -> bool:
        return self.conn is not None and not (self.conn.closed or self.conn.broken)

    def connect(self) -> str:
        """Open and LISTEN if not connected: `listening` (a new connection), `connected`
        (it was), `pooled` (through a pooler: closed again) or `unavailable`."""
        if self.connected:
            return "connected"
        self.close()
        try:
            conn, pooled = open_connection(
                self.dsn, application_name="derivd-listen", bound_s=self.bound_s
            )
        except DatabaseUnavailable:
            return "unavailable"
        if pooled:
            conn.close()
            return "pooled"
        try:
            with bounded(conn, self.bound_s):
                conn.execute(on_channel("listen", self.channel))
        except psycopg.Error:
            conn.close()
            return "unavailable"
        self.conn = conn
        return "listening"

    def fileno(self) -> int | None:
        return self.conn.fileno() if self.connected and self.conn is not None else None

    def drain(self) -> int:
        """How many notifications have arrived (0 when none, or when the connection
        broke: it is closed then)."""
        if self.conn is None:
            return 0
        try:
            # Iterate to the end: leaving the generator early drops the rest of a packet.
            return sum(1 for _ in self.conn.notifies(timeout=0.0))
        except psycopg.Error:
            self.close()
            return 0

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
