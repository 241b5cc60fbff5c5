"""The database alone under a fleet's concurrency: the worker's statement from N clients.

    .venv/bin/python bench/fleet_concurrent.py [--clients 8] [--jobs 8000] [--repeat 3]

bench/fleet.py runs real supervisors: on a small machine their Python workers take most
of the CPU and the database's share is inflated by sharing it. Here pgbench (C, little
client CPU) plays `--clients` workers at claim_batch = 1, each sending derivd's steady
state, `derivd_commit_and_claim` (commit the job it holds, claim the next) in one
durable transaction per job, on `--ready` finished rows. Two ways, interleaved, each run
on a fresh database, the median of `--repeat` runs reported:

- nobody waits: no file has a waiter, so no finish is announced (an upload API that
  answered 202; the default since migration 0011);
- every file awaited: a waiter registered for each file, so every finish sends a
  `derivd_finished` notification. That is what migration 0007 did for every file; a
  NOTIFY makes its transaction take a lock on the whole instance at commit, held until
  the commit is flushed.

Reported per job: the whole server's CPU (every PostgreSQL process, from /proc, after
the clients' backends have exited), WAL bytes, and jobs/s. A build without migration
0011 (`PYTHONPATH` to an older tree) announces every finish: run it with `--ways none`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from common import cluster, machine, median_run, pgbench, save_results, table
from fleet import load_average, seed_derivd, server_cpu_s, wal_lsn

from derivd.embedded.pgcluster import EmbeddedCluster

# derivd's steady-state statement (sql/queries.sql, commit_and_claim) as a pgbench
# script: the job held is in :id / :tok (a dummy before the first claim, whose fence
# fails: one lease_lost event per client), the claimed one is stored back.
JOB = (
    "SELECT id, lease_token::text AS tok FROM derivd_commit_and_claim(jsonb_build_array("
    "jsonb_build_object('id', :id::bigint, 'token', :tok::text, 'attempt', 1,"
    " 'derived_key', 'derived/x', 'derived_version', '1', 'sha256', repeat('0', 64),"
    " 'width', 100, 'height', 100, 'variants', '[]'::jsonb)), 1, 120, 3, 'bench', 0)"
    " WHERE kind = 'claimed' \\gset\n"
)
WAYS = {"none": ("nobody waits", False), "all": ("every file awaited", True)}
GONE_WITHIN_S = 30.0


def _backends_of(user: str, db: str) -> list[int]:
    """Live server processes serving `user` on `db` (their process title says so)."""
    title = f"postgres: {user} {db} ".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(title):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _wait_gone(user: str, db: str) -> None:
    """Until the clients' backends have exited (their CPU time is then the postmaster's)."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while _backends_of(user, db):
        if time.monotonic() > deadline:
            raise SystemExit(f"backends of {db} still running after {GONE_WITHIN_S:.0f} s")
        time.sleep(0.05)


def run_way(
    pg: EmbeddedCluster, work: Path, awaited: bool, clients: int, jobs: int, ready: int
) -> tuple[float, float, float]:
    """(jobs/s, server CPU ms per job, WAL bytes per job)."""
    per_client = jobs // clients
    db = "fleet_concurrent"
    dsn = seed_derivd(pg, db, work, ready, per_client * clients + 10 * clients, awaited=awaited)
    script = work / "job.sql"
    script.write_text(JOB, encoding="ascii")
    user = str(psycopg.conninfo.conninfo_to_dict(dsn)["user"])
    _wait_gone(user, db)
    lsn, cpu, started = wal_lsn(dsn), server_cpu_s(pg), time.perf_counter()
    pgbench(pg, dsn, "-n", "-M", "prepared", "-f", str(script), "-c", str(clients),
            "-j", "2", "-t", str(per_client), "-D", "id=0",
            "-D", "tok=00000000-0000-0000-0000-000000000000", db)  # fmt: skip
    seconds = time.perf_counter() - started
    _wait_gone(user, db)
    done = per_client * clients
    return done / seconds, (server_cpu_s(pg) - cpu) * 1000 / done, (wal_lsn(dsn) - lsn) / done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8, help="workers (the fleet's 4 x 2)")
    parser.add_argument("--jobs", type=int, default=8000, help="jobs per run, all clients")
    parser.add_argument("--ready", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ways", nargs="+", choices=list(WAYS), default=list(WAYS))
    parser.add_argument("--label", default="", help="a name for this build in the output")
    args = parser.parse_args()
    runs: dict[str, list[tuple[float, float, float]]] = {w: [] for w in args.ways}
    load = [load_average()]
    with cluster() as pg, tempfile.TemporaryDirectory(prefix="derivd-conc-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        for n in range(args.repeat):
            for way in args.ways:
                label, awaited = WAYS[way]
                print(f"run {n + 1}: {label} ...", file=sys.stderr, flush=True)
                runs[way].append(run_way(pg, work, awaited, args.clients, args.jobs, args.ready))
        lines = machine(pg.dsn())
    load.append(load_average())
    rows: list[list[object]] = []
    for way, results in runs.items():
        (jobs_s, cpu_ms, wal), spread = median_run(results, key=lambda r: r[1])  # server CPU
        rows.append([WAYS[way][0], jobs_s, cpu_ms, 1000 / cpu_ms, round(wal), spread])
    print(f"## fleet concurrent {args.label}".rstrip())
    print("\n".join(lines))
    print(f"load average before/after: {load[0]} / {load[1]}")
    print(f"{args.clients} clients (pgbench), claim_batch = 1, {args.jobs:,} jobs per run on "
          f"{args.ready:,} finished rows, median of {args.repeat} runs")  # fmt: skip
    headers = ["way", "jobs/s", "server CPU ms/job", "jobs/s per DB core", "WAL B/job",
               "stdev of server ms"]  # fmt: skip
    print(table(headers, rows))
    keys = ("way", "jobs_per_s", "server_ms", "jobs_per_s_per_db_core", "wal_bytes", "stdev_ms")
    save_results(
        f"fleet_concurrent{('_' + args.label) if args.label else ''}",
        {"machine": lines, "load": load, "rows": [dict(zip(keys, r, strict=True)) for r in rows]},
    )


if __name__ == "__main__":
    main()
