"""Tables that stay small: archive_events sheds whole days past retention (the
EventPartitions duty), `deleted` rows are purged after their setting (the sweep), and young
events stay append-only."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import psycopg
import pytest

from derivd.config import Config
from derivd.ops.sweep import Sweeper, SweepReport
from derivd.processes.duties import EventPartitions, PartitionRound
from derivd.queue.db import QueueDB
from derivd.storage.fs import FsStorage

OLD_DAYS = 10
OLD_PER_DAY = 100_000  # 1,000,000 old events in all
YOUNG = 10_000


def _one(conn: psycopg.Connection[Any], query: str) -> Any:
    row = conn.execute(query).fetchone()  # type: ignore[arg-type]  # test SQL
    assert row is not None
    return row[0]


def _events_size(conn: psycopg.Connection[Any]) -> int:
    return int(
        _one(
            conn,
            "SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree('archive_events')",
        )
    )


def _sweep(queue: QueueDB, fs_root: Path, **settings: int) -> SweepReport:
    """One sweep pass with the test guards and `settings` (purge, batch)."""
    guards = {"orphan_guard": 3600, "delete_guard": 300}
    return Sweeper(queue, FsStorage(fs_root), **guards, **settings).run_once()


def _partitions(queue: QueueDB, retention_days: int) -> PartitionRound:
    """One round of the event partition duty with `[sweep] events_retention_days`."""
    config = Config().replace("sweep", events_retention_days=retention_days)
    return EventPartitions(lambda: config).run_once(queue)


def test_one_round_drops_old_events_whole_and_keeps_young_ones_append_only(
    dsn: str, fs_root: Path
) -> None:
    queue = QueueDB.open(dsn)
    conn = queue.conn
    # Days of events from long ago, in the partitions the sweep made back then ...
    first = (dt.datetime.now(dt.UTC) - dt.timedelta(days=100)).date()
    assert len(queue.create_event_partitions(OLD_DAYS, first=first)) == OLD_DAYS
    conn.execute(
        "INSERT INTO archive_events (file_id, kind, attempt, at)"
        " SELECT n, 'ready', 1,"
        "        %s::date::timestamp AT TIME ZONE 'UTC' + (n %% %s) * interval '1 day'"
        "        + (n %% 86000) * interval '1 s'"
        "   FROM generate_series(1, %s) AS n",
        (first, OLD_DAYS, OLD_DAYS * OLD_PER_DAY),
    )
    # ... and some from days no partition covered (a long sweep outage): DEFAULT.
    conn.execute(
        "INSERT INTO archive_events (file_id, kind, at)"
        " SELECT n, 'retry', now() - interval '200 days' FROM generate_series(1, 1000) AS n"
    )
    conn.execute(
        "INSERT INTO archive_events (file_id, kind, attempt)"
        " SELECT n, 'ready', 1 FROM generate_series(1, %s) AS n",
        (YOUNG,),
    )
    young_before = conn.execute(
        "SELECT count(*), sum(file_id), min(id), max(id) FROM archive_events"
        " WHERE at > now() - interval '1 day'"
    ).fetchone()
    big = _events_size(conn)

    done = _partitions(queue, 90)

    assert not done.busy
    assert len(done.dropped) == OLD_DAYS  # the old days; DEFAULT's old rows went with it
    assert _one(conn, "SELECT count(*) FROM archive_events_default") == 0
    assert (
        _one(conn, "SELECT count(*) FROM archive_events WHERE at < now() - interval '90 days'") == 0
    )
    assert (
        conn.execute(
            "SELECT count(*), sum(file_id), min(id), max(id) FROM archive_events"
        ).fetchone()
        == young_before
    )
    # The table is about the young rows' size again (nothing rewritten, no dead rows).
    today = _one(conn, "SELECT tableoid::regclass::text FROM archive_events LIMIT 1")
    young_size = _one(conn, f"SELECT pg_total_relation_size('{today}')")
    size = _events_size(conn)
    assert size <= 2 * young_size < big, (size, young_size, big)
    # Young events are still append-only, through the table and through their partition.
    for statement in (
        "UPDATE archive_events SET kind = 'retry'",
        "DELETE FROM archive_events",
        "TRUNCATE archive_events",
        f"UPDATE {today} SET kind = 'retry'",
        f"DELETE FROM {today}",
        f"TRUNCATE {today}",
        "TRUNCATE archive_events_default",
    ):
        with pytest.raises(psycopg.errors.RaiseException):
            conn.execute(statement)  # type: ignore[arg-type]  # test SQL
    # Partitions exist a week ahead, so tomorrow's events land in a droppable day too.
    tomorrow = conn.execute(
        "INSERT INTO archive_events (file_id, kind, at) VALUES (1, 'ready', now() + interval"
        " '1 day') RETURNING tableoid::regclass::text"
    ).fetchone()
    assert tomorrow is not None and tomorrow[0].startswith("archive_events_to_")
    queue.close()


def test_retention_zero_keeps_every_event(dsn: str) -> None:
    with QueueDB.open(dsn) as queue:
        first = (dt.datetime.now(dt.UTC) - dt.timedelta(days=400)).date()
        queue.create_event_partitions(1, first=first)
        queue.conn.execute(
            "INSERT INTO archive_events (file_id, kind, at) VALUES (1, 'ready', %s)",
            (dt.datetime.combine(first, dt.time(12), dt.UTC),),
        )
        assert _partitions(queue, 0).dropped == []
        assert _one(queue.conn, "SELECT count(*) FROM archive_events") == 1


def test_deleted_rows_are_purged_after_their_setting_only(dsn: str, fs_root: Path) -> None:
    with QueueDB.open(dsn) as queue:
        ids = queue.enqueue([(f"originals/{n}", "1") for n in range(5)])
        queue.request_delete(ids, actor="test")
        for file_id in ids:
            queue.conn.execute(
                "UPDATE archive_files SET status = 'deleted', finished_at = now() - %s"
                " WHERE id = %s",
                (dt.timedelta(days=40 if file_id in ids[:3] else 10), file_id),
            )

        def sweep(days: int) -> list[int]:
            return _sweep(queue, fs_root, purge_deleted_days=days, batch=2).purged

        assert sweep(0) == []  # the default keeps them
        assert sorted(sweep(30)) == sorted(ids[:3])
        assert queue.statuses(ids) == {i: "deleted" for i in ids[3:]}
