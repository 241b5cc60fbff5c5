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
reported, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from common import cluster, machine, save_results, table
from fleet import _times, load_average, seed_derivd, server_cpu_s, wal_lsn

from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.queue.db import Job, QueueDB

WARMUP = 200
LEASE_S = 120.0


def _two_statements(queue: QueueDB) -> Callable[[], None]:
    def one_job() -> None:
        [job] = queue.claim_many(limit=1, lease_s=LEASE_S, max_attempts=3)
        queue.commit_many([(job, [])])

    return one_job


def _one_statement(queue: QueueDB) -> Callable[[], None]:
    held: list[Job] = queue.claim_many(limit=1, lease_s=LEASE_S, max_attempts=3)

    def one_job() -> None:
        _, held[:] = queue.commit_and_claim(
            [(held[0], [])], limit=1, lease_s=LEASE_S, max_attempts=3
        )

    return one_job


MODES: list[tuple[str, Callable[[QueueDB], Callable[[], None]], bool]] = [
    ("claim, then commit", _two_statements, True),
    ("commit + next claim in one statement", _one_statement, True),
    ("claim, then commit, nothing prepared", _two_statements, False),
    ("commit + next claim, nothing prepared", _one_statement, False),
]


def run_mode(
    pg: EmbeddedCluster, work: Path, mode: int, jobs: int, ready: int
) -> tuple[float, float, float, float]:
    """(backend user ms, backend sys ms, server ms, WAL bytes) per job."""
    _label, make, prepared = MODES[mode]
    dsn = seed_derivd(pg, "fleet_micro", work, ready, WARMUP + jobs + 10)
    with QueueDB.open(dsn, role="bench") as queue:
        if not prepared:
            queue.conn.prepare_threshold = None
        one_job = make(queue)
        for _ in range(WARMUP):
            one_job()
        pid = queue.conn.info.backend_pid
        lsn, server, (user, system, _, _) = wal_lsn(dsn), server_cpu_s(pg), _times(pid)
        for _ in range(jobs):
            one_job()
        user2, system2, _, _ = _times(pid)
        server2, lsn2 = server_cpu_s(pg), wal_lsn(dsn)
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    return (
        (user2 - user) * tick_ms / jobs,
        (system2 - system) * tick_ms / jobs,
        (server2 - server) * 1000 / jobs,
        (lsn2 - lsn) / jobs,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--ready", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--label", default="", help="a name for this build in the output")
    args = parser.parse_args()
    runs: dict[int, list[tuple[float, float, float, float]]] = {m: [] for m in range(len(MODES))}
    load = [load_average()]
    with cluster() as pg, tempfile.TemporaryDirectory(prefix="derivd-micro-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        for n in range(args.repeat):
            for mode in range(len(MODES)):
                print(f"run {n + 1}: {MODES[mode][0]} ...", file=sys.stderr, flush=True)
                runs[mode].append(run_mode(pg, work, mode, args.jobs, args.ready))
        lines = machine(pg.dsn())
    load.append(load_average())
    rows = []
    for mode, results in runs.items():
        median = sorted(results, key=lambda r: r[0] + r[1])[len(results) // 2]
        spread = statistics.pstdev([r[0] + r[1] for r in results])
        rows.append([MODES[mode][0], *median[:3], round(median[3]), spread])
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
