"""Wake-up without polling: a row entering `queued` notifies `derivd_queued`, and an idle
daemon picks a new row up long before its poll interval.

Timeouts here are liveness bounds (a broken wake-up hangs until them), not performance
assertions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fixtures.idle import LIVENESS_S, IdleDaemon, idle_daemon
from fixtures.work import claim_one, commit_one
from helpers import listens_on, wait_for

from derivd.queue.db import QUEUED_CHANNEL, QueueDB

MARKER = "marker"


class Inbox:
    """A LISTEN connection and the notifications it has received but not yet handed out
    (several can arrive in one packet: leaving the generator early would drop them)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.pending: deque[psycopg.Notify] = deque()

    def next_payload(self) -> str | None:
        """The payload of the next notification on the channel, or None past the bound."""
        if not self.pending:
            self.pending.extend(self.conn.notifies(timeout=LIVENESS_S, stop_after=1))
        if not self.pending:
            return None
        notify = self.pending.popleft()
        assert notify.channel == QUEUED_CHANNEL
        return notify.payload


@pytest.fixture
def listener(dsn: str) -> Iterator[Inbox]:
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute(f"LISTEN {QUEUED_CHANNEL}")
    yield Inbox(conn)
    conn.close()


@pytest.fixture
def producer(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """Another client, as an upload API in any language would be: plain SQL."""
    conn = psycopg.connect(dsn, autocommit=True)
    yield conn
    conn.close()


def mark(producer: psycopg.Connection[Any]) -> None:
    # Notifications arrive in commit order: when the marker comes first, nothing that
    # committed before it notified.
    producer.execute(f"NOTIFY {QUEUED_CHANNEL}, '{MARKER}'")


def insert(producer: psycopg.Connection[Any], status: str) -> int:
    row = producer.execute(
        "INSERT INTO archive_files (status, original_key, original_version)"
        " VALUES (%s, 'originals/x', '1') RETURNING id",
        (status,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_insert_of_a_queued_row_notifies(
    listener: Inbox, producer: psycopg.Connection[Any]
) -> None:
    insert(producer, "queued")
    assert listener.next_payload() == ""


def test_enqueue_notifies_once_per_transaction(
    listener: Inbox, dsn: str, producer: psycopg.Connection[Any]
) -> None:
    with QueueDB.open(dsn) as queue:
        queue.enqueue([(f"originals/{n}", "1") for n in range(50)])
    mark(producer)
    assert listener.next_payload() == ""
    assert listener.next_payload() == MARKER  # the 50 rows folded into one wake-up


def test_pending_insert_does_not_notify(listener: Inbox, producer: psycopg.Connection[Any]) -> None:
    insert(producer, "pending")
    mark(producer)
    assert listener.next_payload() == MARKER


def test_update_to_queued_notifies(listener: Inbox, producer: psycopg.Connection[Any]) -> None:
    file_id = insert(producer, "pending")
    producer.execute("UPDATE archive_files SET status = 'queued' WHERE id = %s", (file_id,))
    assert listener.next_payload() == ""


def test_release_back_to_queued_notifies(
    listener: Inbox, dsn: str, producer: psycopg.Connection[Any]
) -> None:
    with QueueDB.open(dsn) as queue:
        queue.enqueue([("originals/a", "1")])
        assert listener.next_payload() == ""
        job = claim_one(queue, lease_s=60, max_attempts=3)
        assert job is not None
        assert queue.release(job)
    assert listener.next_payload() == ""


def test_updates_that_stay_queued_do_not_notify(
    listener: Inbox, producer: psycopg.Connection[Any]
) -> None:
    file_id = insert(producer, "queued")
    assert listener.next_payload() == ""
    producer.execute(
        "UPDATE archive_files SET available_at = now() + interval '1 hour' WHERE id = %s",
        (file_id,),
    )
    producer.execute("UPDATE archive_files SET status = 'queued' WHERE id = %s", (file_id,))
    mark(producer)
    assert listener.next_payload() == MARKER


# --------------------------------------------------------------------------- the daemon


@pytest.fixture
def idle(dsn: str, tmp_path: Path) -> Iterator[IdleDaemon]:
    with idle_daemon(tmp_path, dsn) as daemon:
        yield daemon


def test_idle_daemon_picks_up_a_new_row_without_waiting_for_the_poll(
    idle: IdleDaemon, producer: psycopg.Connection[Any]
) -> None:
    idle.wait_idle(producer)
    file_id = idle.queue_original(producer)
    # Far below the 60 s poll: only the NOTIFY can have woken the worker.
    idle.wait_ready(producer, file_id)


def _listen_pids(conn: psycopg.Connection[Any]) -> set[int]:
    rows = conn.execute(
        "SELECT pid, query FROM pg_stat_activity WHERE datname = current_database()"
    ).fetchall()
    return {int(r[0]) for r in rows if listens_on(str(r[1]), QUEUED_CHANNEL)}


def test_lost_listen_connection_is_replaced(
    idle: IdleDaemon, producer: psycopg.Connection[Any]
) -> None:
    """The supervisor's LISTEN connection dies (server-side kill): it listens again, and
    a row queued after that is picked up without waiting for the 60 s poll."""
    idle.wait_idle(producer)
    (old,) = _listen_pids(producer)
    producer.execute("SELECT pg_terminate_backend(%s)", (old,))
    wait_for(
        lambda: bool(_listen_pids(producer) - {old}),
        "a new LISTEN connection",
        LIVENESS_S,
        detail=idle.log,
    )
    assert old not in _listen_pids(producer)
    idle.wait_ready(producer, idle.queue_original(producer))


# --------------------------------------------------------------------------- claim path


def test_claim_skips_the_flush_wait_for_itself_only(dsn: str) -> None:
    """The claim commits with synchronous_commit off (transaction-local); the fenced
    commit that follows on the same connection must still wait for its flush."""
    with QueueDB.open(dsn) as queue:
        queue.enqueue([("originals/a", "1")])
        queue.conn.execute("SET synchronous_commit = on")  # the test cluster runs with off
        job = claim_one(queue, lease_s=60, max_attempts=3)
        assert job is not None
        assert queue.conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        assert commit_one(queue, job, [])
        row = queue.file_row(job.id)
        assert row is not None and row["status"] == "ready"
