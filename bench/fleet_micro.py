"""One client's cost per job on the server: claim + commit, or commit-and-claim.

    .venv/bin/python bench/fleet_micro.py [--jobs 3000] [--ready 100000] [--repeat 3]

No fleet contention: one connection drains `--jobs` no-op jobs (after a warm-up of 200,
so psycopg has prepared its statements and the server has cached its plans) on a fresh
database with `--ready` finished rows, in each way a worker can talk to the queue:
two statements per job (claim, then the fenced commit) or one (the commit of a job with
the claim of the next), with psycopg's prepared statements or with nothing prepared (as
through a transaction pooler). Reported per job: that backend's user and system CPU
(from /proc), the whole server's CPU (every PostgreSQL process: WAL writer, autovacuum
...), and WAL bytes. Each mode runs `--repeat` times, interleaved; the median run is
reported, since the machine may be shared. Also: the same steady state at
claim_batch = 10, and this machine's floor measured in the same run: pgbench's
simple-update (one durable transaction of one UPDATE, one SELECT and one INSERT), whose
server CPU per transaction bounds what one durable transaction per job can cost.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import psycopg
from common import cluster, fresh_db, machine, median_run, pgbench, save_results, table
from fleet import _times, load_average, seed_derivd, server_cpu_s, wal_lsn

from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.queue.db import Finished, Job, QueueDB

WARMUP = 200
LEASE_S = 120.0


def _two_statements(queue: QueueDB) -> Callable[[], None]:
    def one_job() -> None:
        [job] = queue.claim_many(limit=1, lease_s=LEASE_S, max_attempts=3)
        queue.commit_many([Finished(job, [])])

    return one_job


def _one_statement(batch: int) -> Callable[[QueueDB], Callable[[], None]]:
    """The worker's steady state at claim_batch = `batch`: each call commits the
    `batch` jobs it holds and claims the next `batch`."""

    def make(queue: QueueDB) -> Callable[[], None]:
        held: list[Job] = queue.claim_many(limit=batch, lease_s=LEASE_S, max_attempts=3)

        def jobs() -> None:
            _, held[:] = queue.commit_and_claim(
                [Finished(job, []) for job in held], limit=batch, lease_s=LEASE_S, max_attempts=3
            )

        return jobs

    return make


# (label, how one call is made, prepared, jobs per call)
MODES: list[tuple[str, Callable[[QueueDB], Callable[[], None]], bool, int]] = [
    ("claim, then commit", _two_statements, True, 1),
    ("commit + next claim in one statement", _one_statement(1), True, 1),
    ("claim, then commit, nothing prepared", _two_statements, False, 1),
    ("commit + next claim, nothing prepared", _one_statement(1), False, 1),
    ("commit + next claim, claim_batch = 10", _one_statement(10), True, 10),
]
# The machine's floor, same run, sent by the same client library as the rows above:
# (label, statements, in one explicit transaction). The first is the least a durable
# job can cost (one round trip, one row updated by primary key, one WAL flush); the
# second is pgbench's simple-update transaction (BEGIN, UPDATE, SELECT, INSERT, COMMIT).
UPDATE_ACCOUNT = "UPDATE pgbench_accounts SET abalance = abalance + %(delta)s WHERE aid = %(aid)s"
FLOORS: list[tuple[str, list[str], bool]] = [
    ("floor: one UPDATE by primary key, durable, per statement", [UPDATE_ACCOUNT], False),
    (
        "floor: pgbench simple-update, per transaction",
        [
            UPDATE_ACCOUNT,
            "SELECT abalance FROM pgbench_accounts WHERE aid = %(aid)s",
            "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime)"
            " VALUES (%(tid)s, %(bid)s, %(aid)s, %(delta)s, CURRENT_TIMESTAMP)",
        ],
        True,
    ),
]


def run_mode(
    pg: EmbeddedCluster, work: Path, mode: int, jobs: int, ready: int
) -> tuple[float, float, float, float]:
    """(backend user ms, backend sys ms, server ms, WAL bytes) per job."""
    _label, make, prepared, per_call = MODES[mode]
    calls = jobs // per_call
    dsn = seed_derivd(pg, "fleet_micro", work, ready, (WARMUP + calls + 10) * per_call)
    with QueueDB.open(dsn, role="bench") as queue:
        if not prepared:
            queue.conn.prepare_threshold = None
        one_call = make(queue)
        for _ in range(WARMUP):
            one_call()
        pid = queue.conn.info.backend_pid
        lsn, server, (user, system, _, _) = wal_lsn(dsn), server_cpu_s(pg), _times(pid)
        for _ in range(calls):
            one_call()
        user2, system2, _, _ = _times(pid)
        server2, lsn2 = server_cpu_s(pg), wal_lsn(dsn)
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    done = calls * per_call
    return (
        (user2 - user) * tick_ms / done,
        (system2 - system) * tick_ms / done,
        (server2 - server) * 1000 / done,
        (lsn2 - lsn) / done,
    )


def run_floor(
    pg: EmbeddedCluster, floor: int, transactions: int
) -> tuple[float, float, float, float]:
    """(backend user ms, backend sys ms, server ms, WAL bytes) per transaction."""
    _label, statements, explicit = FLOORS[floor]
    dsn = fresh_db(pg, "fleet_floor", derivd_schema=False)
    pgbench(pg, dsn, "-i", "-q", "-s", "10", "fleet_floor")
    rng = random.Random(1)

    def one_transaction(conn: psycopg.Connection[tuple[object, ...]]) -> None:
        params = {"aid": rng.randint(1, 1_000_000), "bid": rng.randint(1, 10),
                  "tid": rng.randint(1, 100), "delta": rng.randint(-5000, 5000)}  # fmt: skip
        if not explicit:
            conn.execute(statements[0], params, prepare=True)  # type: ignore[arg-type]
            return
        with conn.transaction():
            for statement in statements:
                conn.execute(statement, params, prepare=True)  # type: ignore[arg-type]

    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(WARMUP):
            one_transaction(conn)
        pid = conn.info.backend_pid
        lsn, server, (user, system, _, _) = wal_lsn(dsn), server_cpu_s(pg), _times(pid)
        for _ in range(transactions):
            one_transaction(conn)
        user2, system2, _, _ = _times(pid)
        server2, lsn2 = server_cpu_s(pg), wal_lsn(dsn)
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    return (
        (user2 - user) * tick_ms / transactions,
        (system2 - system) * tick_ms / transactions,
        (server2 - server) * 1000 / transactions,
        (lsn2 - lsn) / transactions,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--ready", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--label", default="", help="a name for this build in the output")
    args = parser.parse_args()
    runs: dict[int, list[tuple[float, float, float, float]]] = {m: [] for m in range(len(MODES))}
    floors: dict[int, list[tuple[float, float, float, float]]] = {f: [] for f in range(len(FLOORS))}
    load = [load_average()]
    with cluster() as pg, tempfile.TemporaryDirectory(prefix="derivd-micro-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        for n in range(args.repeat):
            for mode in range(len(MODES)):
                print(f"run {n + 1}: {MODES[mode][0]} ...", file=sys.stderr, flush=True)
                runs[mode].append(run_mode(pg, work, mode, args.jobs, args.ready))
            for floor in range(len(FLOORS)):
                print(f"run {n + 1}: {FLOORS[floor][0]} ...", file=sys.stderr, flush=True)
                floors[floor].append(run_floor(pg, floor, args.jobs))
        lines = machine(pg.dsn())
    load.append(load_average())
    measured = [(MODES[m][0], r) for m, r in runs.items()]
    measured += [(FLOORS[f][0], r) for f, r in floors.items()]
    rows: list[list[object]] = []
    for label, results in measured:
        median, spread = median_run(results, key=lambda r: r[0] + r[1])  # backend CPU
        rows.append([label, *median[:3], round(median[3]), spread])
    print(f"## fleet micro {args.label}".rstrip())
    print("\n".join(lines))
    print(f"load average before/after: {load[0]} / {load[1]}")
    print(f"one client, {args.jobs:,} jobs per run on {args.ready:,} finished rows, "
          f"median of {args.repeat} runs")  # fmt: skip
    headers = ["path (one client)", "backend user ms/job", "backend sys ms/job",
               "server CPU ms/job", "WAL B/job", "stdev of backend ms"]  # fmt: skip
    print(table(headers, rows))
    keys = ("path", "user_ms", "sys_ms", "server_ms", "wal_bytes", "stdev_ms")
    save_results(
        f"fleet_micro{('_' + args.label) if args.label else ''}",
        {"machine": lines, "load": load, "rows": [dict(zip(keys, r, strict=True)) for r in rows]},
    )


if __name__ == "__main__":
    main()
