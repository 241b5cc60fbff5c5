"""The supervisor's background duties (derivd.processes.duties): one contract, each paced
by its own setting, each round (`run_once`) driven directly here without forking."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fixtures.pgbouncer import PgBouncer, find_pgbouncer
from fixtures.pgproxy import PgProxy
from fixtures.work import claim_one
from helpers import sql
from psycopg.conninfo import conninfo_to_dict

from derivd.config import Config
from derivd.ops.health import DEFAULT_EVENTS, collect
from derivd.processes.duties import (
    EventPartitions,
    ExhaustedRejection,
    Listening,
    PartitionRound,
)
from derivd.queue.db import DatabaseUnavailable, QueueDB, QueueListener, connect

LIVENESS_S = 30.0  # bounds a thread that would hang if the fix were missing; not a timing


class FakeThread:
    """The database thread's `submit` and `watch`, recorded instead of run."""

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.dsn = ""

    def submit(self, name: str, run: Any, then: Any = None, *, single: bool = False) -> bool:
        self.submitted.append(name)
        return True

    def watch(self, listener: Any) -> None:
        return None


def settings(**sections: dict[str, Any]) -> Callable[[], Config]:
    config = Config()
    for section, values in sections.items():
        config = config.replace(section, **values)
    return lambda: config


# -- the contract ------------------------------------------------------------------------


def test_each_duty_is_paced_by_its_own_setting_not_poll_interval() -> None:
    config = settings(
        queue={"poll_interval": 0.2, "exhausted_interval": 30.0},
        database={"listen_retry": 7.0},
        sweep={"partitions_interval": 600.0},
    )
    thread = FakeThread()
    duties = [
        ExhaustedRejection(config, thread),  # type: ignore[arg-type]
        EventPartitions(config, thread),  # type: ignore[arg-type]
        Listening(config, thread, QueueListener("dbname=unused"), lambda: None),  # type: ignore[arg-type]
    ]
    for duty in duties:
        duty.start(100.0)
        duty.tick(100.0)  # the first round at the first chance
        duty.tick(100.5)  # poll_interval later: not again
    assert thread.submitted == ["reject_exhausted", "event_partitions", "listen"]
    for duty in duties:
        duty.tick(106.9)
    assert thread.submitted[3:] == []
    for duty in duties:
        duty.tick(107.0)
    assert thread.submitted[3:] == ["listen"]
    for duty in duties:
        duty.tick(130.0)
    assert thread.submitted[4:] == ["reject_exhausted", "listen"]
    for duty in duties:
        duty.stop()
        duty.tick(10_000.0)
    assert len(thread.submitted) == 6


def test_an_interval_of_zero_is_off_and_a_reload_turns_the_duty_back_on() -> None:
    current = [Config().replace("queue", exhausted_interval=0.0)]
    thread = FakeThread()
    duty = ExhaustedRejection(lambda: current[0], thread)  # type: ignore[arg-type]
    duty.start(0.0)
    duty.tick(1000.0)
    assert thread.submitted == [] and duty.next_round == float("inf")  # no busy loop
    current[0] = Config().replace("queue", exhausted_interval=30.0)  # SIGHUP
    duty.tick(1001.0)
    assert thread.submitted == ["reject_exhausted"] and duty.next_round == 1031.0


# -- rows whose worker died on their last attempt ---------------------------------------


def test_expired_lease_on_the_last_attempt_is_rejected_once(queue: QueueDB) -> None:
    (file_id,) = queue.enqueue([(f"originals/{uuid.uuid4().hex}", "v1")])
    for attempt in (1, 2, 3):
        job = claim_one(queue, lease_s=60.0, max_attempts=3)
        assert job is not None and job.attempt == attempt
        sql(queue.dsn or "", "UPDATE archive_files SET lease_until = now() - interval '1 s'")
    assert claim_one(queue, lease_s=60.0, max_attempts=3) is None  # not a fourth run
    duty = ExhaustedRejection(settings(queue={"max_attempts": 3}))
    assert duty.run_once(queue) == [file_id]
    assert duty.run_once(queue) == []
    row = queue.file_row(file_id)
    assert row is not None
    assert (row["status"], row["error_code"]) == ("rejected", "attempts_exhausted")


# -- event partitions -------------------------------------------------


def _insert_event(queue: QueueDB, at_sql: str) -> str:
    row = queue.conn.execute(
        f"INSERT INTO archive_events (file_id, kind, at) VALUES (1, 'ready', {at_sql})"  # type: ignore[arg-type]
        " RETURNING tableoid::regclass::text"
    ).fetchone()
    assert row is not None
    return str(row[0])


def _partitions(queue: QueueDB, retention_days: int = 90) -> PartitionRound:
    return EventPartitions(settings(sweep={"events_retention_days": retention_days})).run_once(
        queue
    )


def test_after_a_long_outage_default_is_emptied_into_days_and_past_retention_dropped(
    queue: QueueDB,
) -> None:
    # The partition duty was away longer than the week it makes ahead: those days' events (and
    # ones from long ago no partition covered) sit in DEFAULT, and status says so.
    for at in ("now() + interval '10 days'", "now() + interval '11 days'"):
        assert _insert_event(queue, at) == "archive_events_default"
    assert _insert_event(queue, "now() - interval '200 days'") == "archive_events_default"
    assert DEFAULT_EVENTS in collect(queue, Config().status).warnings

    done = _partitions(queue, retention_days=90)

    assert not done.busy
    assert len(done.rehomed) == 2 and all(p.startswith("archive_events_to_") for p in done.rehomed)
    count = "SELECT count(*) AS n FROM {}"
    assert sql(queue.dsn or "", count.format("archive_events_default")) == [{"n": 0}]
    assert sql(queue.dsn or "", count.format("archive_events")) == [{"n": 2}]  # the old one: gone
    assert collect(queue, Config().status).warnings == []
    # Those days are partitions now: their next events land there, not in DEFAULT.
    assert _insert_event(queue, "now() + interval '10 days'") in done.rehomed
    # Still append-only, DEFAULT included.
    for statement in ("DELETE FROM archive_events", "TRUNCATE archive_events_default"):
        with pytest.raises(psycopg.errors.RaiseException):
            queue.conn.execute(statement)  # type: ignore[arg-type]


def test_without_retention_every_default_row_moves(queue: QueueDB) -> None:
    _insert_event(queue, "now() - interval '400 days'")
    done = _partitions(queue, retention_days=0)
    assert len(done.rehomed) == 1
    assert sql(queue.dsn or "", "SELECT count(*) AS n FROM archive_events") == [{"n": 1}]


def test_partition_ddl_gives_up_behind_a_long_reader_and_a_later_round_does_it(
    queue: QueueDB, dsn: str
) -> None:
    _insert_event(queue, "now() + interval '12 days'")  # DEFAULT: DDL to do
    with psycopg.connect(dsn) as reader:  # a long report, holding its lock
        reader.execute("SELECT count(*) FROM archive_events")
        result: list[PartitionRound] = []
        worker = threading.Thread(target=lambda: result.append(_partitions(queue)))
        worker.start()
        worker.join(LIVENESS_S)  # without a lock_timeout it waits for the reader
        assert not worker.is_alive() and result and result[0].busy
    done = _partitions(queue)
    assert not done.busy and len(done.rehomed) == 1


# -- LISTEN -----------------------------------------------------------


@pytest.mark.pooler
def test_every_reconnect_checks_for_a_pooler_and_says_so_once(
    dsn: str, direct_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    pooled = dsn != direct_dsn
    woken: list[bool] = []
    listener = QueueListener(dsn)
    duty = Listening(settings(), FakeThread(), listener, lambda: woken.append(True))  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="derivd.supervisor"):
        for _ in range(3):  # three reconnect attempts
            duty.on_result(duty.run_once(None))  # type: ignore[arg-type]
    if pooled:
        assert not listener.connected and woken == []
        assert duty.problem is not None and "listen_dsn" in duty.problem
        assert sum("connection pooler" in r.getMessage() for r in caplog.records) == 1
    else:
        assert listener.connected and woken == [True] and duty.problem is None
    listener.close()


# -- bounded statements -----------------------------------------------


def test_a_supervisor_statement_gives_up_when_the_server_freezes(dsn: str) -> None:
    proxy = PgProxy(dsn).start()
    try:
        db = QueueDB.open(proxy.dsn(dsn), role="test", bound_s=1.0)
        assert db.default_events() is False
        proxy.hang()
        errors: list[Exception] = []

        def read() -> None:
            try:
                db.default_events()
            except DatabaseUnavailable as error:
                errors.append(error)

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(LIVENESS_S)  # unbounded, it would wait for the frozen server forever
        assert not reader.is_alive() and len(errors) == 1
        db.close()
    finally:
        proxy.stop()


def test_the_pooler_probe_of_a_connection_gives_up_when_the_server_behind_freezes(
    dsn: str, tmp_path: Path
) -> None:
    """PgBouncer answers the connection itself and holds the probe's statement for the
    frozen server (up to its query_wait_timeout, 120 s): the bound ends it."""
    if find_pgbouncer() is None:
        pytest.skip("pgbouncer is not installed")
    proxy = PgProxy(dsn).start()
    user = str(conninfo_to_dict(dsn).get("user", "derivd"))
    bouncer = PgBouncer(tmp_path / "pgb", pg_host="127.0.0.1", pg_port=proxy.port, user=user)
    bouncer.start()
    try:
        pooled = bouncer.dsn(dsn)
        connect(pooled, bound_s=1.0).close()  # a server connection, through the proxy
        proxy.hang()
        errors: list[Exception] = []

        def open_one() -> None:
            try:
                connect(pooled, bound_s=1.0).close()
            except DatabaseUnavailable as error:
                errors.append(error)

        opener = threading.Thread(target=open_one)
        opener.start()
        opener.join(LIVENESS_S)
        assert not opener.is_alive() and len(errors) == 1
    finally:
        proxy.stop()
        bouncer.stop()
