"""derivd through a real PgBouncer in transaction mode: what a pooler changes.

(The tests of the queue's statements also run through it: see `pooler` in
tests/support/fixtures/services.py.) Here: prepared statements, migrations, the sweep's
single runner, LISTEN through `listen_dsn`, the refusal of a pooled `dsn` without one, two
supervisors.
"""

from __future__ import annotations

import itertools
import subprocess
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from configs import write_ini
from fixtures.cli import derivd_command
from fixtures.idle import idle_daemon
from fixtures.pgbouncer import PgBouncer
from fixtures.work import claim_one, commit_one

from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.ops.budget import connection_budget
from derivd.queue.db import QueueDB, connect, is_pooled, migrate

_names = itertools.count(1)


@pytest.fixture
def pooled(dsn: str, pgbouncer: PgBouncer) -> str:
    """The test database through PgBouncer (`dsn` stays the direct one)."""
    return pgbouncer.dsn(dsn)


def test_a_pooled_connection_prepares_nothing_and_a_direct_one_does(dsn: str, pooled: str) -> None:
    with connect(pooled) as through, connect(dsn) as direct:
        assert is_pooled(through) and through.prepare_threshold is None
        assert not is_pooled(direct) and direct.prepare_threshold is not None
    # Many executions of every statement of a job never trip over a statement prepared
    # on another server connection (psycopg prepares after 5 by default).
    with QueueDB.open(pooled) as queue:
        queue.enqueue([(f"originals/{i}", "1") for i in range(30)])
        for _ in range(30):
            job = claim_one(queue, lease_s=60, max_attempts=3)
            assert job is not None and commit_one(queue, job, [])
        assert queue.queue_stats().counts == {"ready": 30}


def test_migrations_run_through_the_pooler(
    pgbouncer: PgBouncer, pg_cluster: EmbeddedCluster
) -> None:
    """One transaction under a transaction-scoped lock: nothing needs a session."""
    name = f"pooled_migrate_{next(_names)}"
    pg_cluster.create_database(name)
    try:
        through = pgbouncer.dsn(pg_cluster.dsn(name))
        first = migrate(through)
        assert first and first[0] == "0001_initial"
        assert migrate(through) == []
        with QueueDB.open(through) as queue:
            assert queue.enqueue([("originals/a", "1")])
    finally:
        pg_cluster.drop_database(name)


def test_two_sweepers_racing_through_the_pooler_never_both_hold_the_lease(pooled: str) -> None:
    holders: list[list[bool]] = [[], []]
    start = threading.Barrier(2)

    def race(slot: int) -> None:
        with QueueDB.open(pooled) as queue:
            for _ in range(20):
                start.wait()
                me = uuid.uuid4()
                got = queue.take_lease("sweep", me, ttl_s=60)
                holders[slot].append(got)
                start.wait()  # both have tried before either gives it back
                if got:
                    queue.drop_lease("sweep", me)

    threads = [threading.Thread(target=race, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads)
    assert len(holders[0]) == len(holders[1]) == 20
    # Exactly one winner per round: never both, never neither.
    assert all(a != b for a, b in zip(holders[0], holders[1], strict=True))


def test_run_refuses_a_pooled_dsn_without_listen_dsn(
    pooled: str, tmp_path: Path, run_cli: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    env = {
        "DERIVD_DATABASE_DSN": pooled,
        "DERIVD_STORAGE_BACKEND": "fs",
        "DERIVD_STORAGE_ROOT": str(tmp_path / "objects"),
        "DERIVD_SUPERVISOR_STATE_DIR": str(tmp_path / "state"),
        "DERIVD_DERIVE_BACKEND": "noop",
    }
    result = run_cli("run", env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "[database] listen_dsn" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    # The same with listen = no polls instead: nothing to refuse (a burst run here).
    polled = run_cli("run", "--burst", env={**env, "DERIVD_QUEUE_LISTEN": "no"})
    assert polled.returncode == 0, polled.stderr


def _start(ini: Path, log: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*derivd_command(), "-c", str(ini), "run", *args],
        stdin=subprocess.DEVNULL,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_an_idle_daemon_behind_the_pooler_wakes_through_listen_dsn(
    dsn: str, pooled: str, tmp_path: Path
) -> None:
    """`derivd run` through the pooler, LISTEN on the direct `listen_dsn`, 60 s poll."""
    with (
        idle_daemon(tmp_path, pooled, listen_dsn=dsn) as idle,
        psycopg.connect(dsn, autocommit=True) as producer,
    ):
        idle.wait_idle(producer)
        file_id = idle.queue_original(producer)
        # Far below the 60 s poll: only the NOTIFY heard on listen_dsn can have woken it.
        idle.wait_ready(producer, file_id)


def test_two_supervisors_through_the_pooler_finish_every_row_once(
    dsn: str, pooled: str, tmp_path: Path
) -> None:
    with QueueDB.open(dsn) as queue:
        ids = queue.enqueue([(f"originals/{i}", "1") for i in range(300)])
    procs = []
    for n in (1, 2):
        ini = write_ini(
            tmp_path / f"derivd{n}.ini",
            {
                "database": {"dsn": pooled, "listen_dsn": dsn},
                "storage": {"backend": "fs", "root": tmp_path / "objects"},
                "supervisor": {
                    "workers": 2,
                    "state_dir": tmp_path / f"state{n}",
                    "host_id": f"pooled-{n}",
                },  # one live run per name
                "derive": {"backend": "noop"},
            },
        )
        procs.append(_start(ini, tmp_path / f"derivd{n}.log", "--burst"))
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    with psycopg.connect(dsn) as conn:
        statuses = conn.execute(
            "SELECT status, count(*) FROM archive_files WHERE id = ANY(%s) GROUP BY status",
            (ids,),
        ).fetchall()
        assert statuses == [("ready", 300)]
        events = conn.execute(
            "SELECT kind, count(DISTINCT file_id), count(*) FROM archive_events GROUP BY kind"
        ).fetchall()
        assert events == [("ready", 300, 300)]


def test_connection_budget_counts_every_role() -> None:
    budget = connection_budget(8)
    assert (budget.dsn, budget.total) == (11, 12)
    roles = (budget.workers, budget.supervisor, budget.sweep, budget.listen)
    assert roles == (8, 2, 1, 1)
    quiet = connection_budget(2, listen=False, sweeps=False)
    assert (quiet.dsn, quiet.total) == (4, 4)
