"""Nothing waits on the database without a bound: the health probe
(`derivd status`), a worker's claim, and the supervisor's lease renewal, which has a
lane of its own beside the maintenance rounds. A frozen server is tests/support/fixtures/pgproxy
(it stops relaying); a lock is held by a real second connection. Each test waits on the
outcome with a liveness deadline only (a missing bound would wait forever)."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable

import psycopg
import pytest
from fixtures.daemon import DaemonRun
from fixtures.pgproxy import PgProxy
from helpers import wait_for

from derivd.queue.db import DatabaseUnavailable, QueueDB, StatementTimeout
from derivd.queue.worker_queries import CLAIM_TIMEOUT_S

RunCli = Callable[..., subprocess.CompletedProcess[str]]

LIVENESS_S = 60.0  # bounds a wait that would hang if the fix were missing; not a timing

pytestmark = pytest.mark.pooler


def probe(run_cli: RunCli, dsn: str) -> subprocess.CompletedProcess[str]:
    """`derivd status` as a health probe runs it, reading the shared stats afresh."""
    env = {"DERIVD_DATABASE_DSN": dsn, "DERIVD_STATUS_MAX_AGE": "0"}
    return run_cli("status", env=env, timeout=LIVENESS_S)


def test_status_gives_up_on_the_stats_row_another_connection_holds(
    run_cli: RunCli, dsn: str
) -> None:
    """The 25 s hang of the issue: the probe waited for whoever held the stats cache
    rows. Now it gives up (lock_timeout on a direct connection, the client-side bound
    through a pooler) and says so in one line, exit status 3 ("cannot tell")."""
    with QueueDB.open(dsn) as queue:
        queue.queue_stats()  # migrated, the cache rows exist
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT * FROM derivd_stats_cache FOR UPDATE")
        result = probe(run_cli, dsn)
    assert result.returncode == 3, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "did not answer within" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_status_gives_up_when_the_server_freezes(run_cli: RunCli, dsn: str) -> None:
    proxy = PgProxy(dsn).start()
    try:
        proxy.hang()
        result = probe(run_cli, proxy.dsn(dsn))
    finally:
        proxy.stop()
    assert result.returncode == 3, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("derivd: the database did not answer within"), line


def test_a_workers_claim_gives_up_when_the_server_freezes(dsn: str) -> None:
    """A worker opens its connection as here (Worker.create: no connection-wide bound,
    its jobs are bounded by job_timeout) and its claim is bounded on its own: a frozen
    server used to hold it forever."""
    proxy = PgProxy(dsn).start()
    try:
        queue = QueueDB.open(proxy.dsn(dsn), role="derivd-worker-test")
        assert queue.bound_s is None and queue.claim_bound_s == CLAIM_TIMEOUT_S
        assert queue.claim_many(limit=1, lease_s=60, max_attempts=3) == []
        proxy.hang()
        errors: list[Exception] = []

        def claim() -> None:
            try:
                queue.claim_many(limit=1, lease_s=60, max_attempts=3)
            except DatabaseUnavailable as error:
                errors.append(error)

        claimer = threading.Thread(target=claim, daemon=True)
        claimer.start()
        claimer.join(LIVENESS_S)
        assert not claimer.is_alive(), "the claim still waits for the frozen server"
        (error,) = errors
        assert isinstance(error, StatementTimeout)
        assert str(error) == f"the database did not answer within {CLAIM_TIMEOUT_S:g}s"
        queue.close()
    finally:
        proxy.stop()


def heartbeat_during_blocked_stats(dsn: str) -> bool:
    """Whether the host registry's last heartbeat is later than the start of a stats
    statement that still waits for its lock: a heartbeat ran while maintenance hung."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity AS a, derivd_hosts AS h"
            " WHERE a.wait_event_type = 'Lock' AND a.query LIKE '%%derivd_queue_stats%%'"
            " AND h.last_heartbeat > a.query_start)"
        ).fetchone()
    return bool(row and row[0])


def test_lease_renewal_keeps_its_pace_while_a_maintenance_round_hangs(
    supervisor: Callable[..., DaemonRun],
    dsn: str,
) -> None:
    """The stats round of a real `derivd run` waits for rows another connection locks
    (a slow database, as the supervisor sees it); heartbeats and renewals go on beside
    it on their own lane. On the one serial thread they waited behind it."""
    sup = supervisor(
        queue={"heartbeat": "0.3", "renew": "yes"}, metrics={"interval": "0.5"}
    ).start()
    wait_for(lambda: sup.ready_workers(1), "a ready worker", detail=sup.log)
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT * FROM derivd_stats_cache FOR UPDATE")
        wait_for(
            lambda: heartbeat_during_blocked_stats(dsn),
            "a heartbeat while the stats round waits for its lock",
            timeout=LIVENESS_S,
            detail=sup.log,
        )
