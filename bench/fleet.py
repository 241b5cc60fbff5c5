"""The database's cost per job for a fleet: derivd direct and through PgBouncer, pgqueuer.

    .venv/bin/python bench/fleet.py [--queued 100000] [--ready 1000000] [--no-peers]
                                    [--stats-rows 1000000 10000000]

One embedded PostgreSQL (durable settings) serves everything. Per derivd run: a fresh
database with `--ready` finished rows (history) and `--queued` no-op jobs, then 4
supervisors x 2 workers (`derivd run --burst`, noop, defaults otherwise: claim_batch 1)
drain it, direct, through a PgBouncer in transaction mode, and direct with every file
awaited (a waiter registered for each, so each finish sends a `derivd_finished`
notification: `--paths`). pgqueuer drains the same number of jobs with 8 processes at
batch 1 and 10 (its enqueue is not counted).

- server CPU ms/job: CPU time of every PostgreSQL server process over the drain, read
  from /proc (the postmaster's own and its reaped children's times plus each live
  backend's), divided by the jobs. Includes everything the server did meanwhile
  (autovacuum, WAL writer, the supervisors' background duties).
- WAL B/job: pg_current_wal_lsn() before and after.
- claim p50/p99: one client claims and commits 2,000 jobs one at a time on the same
  history (derivd's claim statement; for pgqueuer its dequeue), timing each claim.
- stats ms: derivd's queue statistics (`derivd status`, uncached) at each table size.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from common import DERIVD, ROOT, cluster, fresh_db, machine, percentile, save_results, table
from throughput import PEERS_PYTHON, ensure_peers_venv, peer

sys.path.insert(0, str(ROOT / "tests" / "support"))
from fixtures.pgbouncer import PgBouncer

from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.queue.db import Finished, QueueDB
from derivd.storage.fs import FsStorage

BENCH = ROOT / "bench"
PGQUEUER = "pgqueuer_drain.py"
SUPERVISORS = 4
WORKERS = 2
CLAIM_SAMPLES = 2000


@dataclass
class Result:
    system: str
    path: str
    batch: int
    jobs: int
    seconds: float
    cpu_s: float
    wal_bytes: int
    claim_ms: list[float]

    def row(self) -> list[object]:
        claims = self.claim_ms or [0.0]
        return [
            self.system,
            self.path,
            self.batch,
            self.jobs,
            round(self.jobs / self.seconds) if self.seconds else 0,
            self.cpu_s * 1000 / self.jobs,
            # What one database core would sustain if the server did nothing else.
            round(self.jobs / self.cpu_s) if self.cpu_s else 0,
            round(self.wal_bytes / self.jobs),
            percentile(claims, 50),
            percentile(claims, 99),
        ]


# --------------------------------------------------------------------------- measuring


def _times(pid: int) -> tuple[int, int, int, int]:
    """utime, stime, cutime, cstime in clock ticks (fields 14-17 of /proc/pid/stat)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12]), int(fields[13]), int(fields[14])


def _ticks(pid: int, children: bool) -> int:
    utime, stime, cutime, cstime = _times(pid)
    return utime + stime + (cutime + cstime if children else 0)


def server_cpu_s(pg: EmbeddedCluster) -> float:
    """CPU seconds of the whole server so far: the postmaster with its reaped children
    (ended backends, autovacuum workers) and every live child."""
    pidfile = (pg.data_dir / "postmaster.pid").read_text().split()
    postmaster = int(pidfile[0])
    total = _ticks(postmaster, children=True)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            with open(entry / "stat", encoding="ascii") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            if ppid == postmaster:
                total += _ticks(int(entry.name), children=False)
        except (OSError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (the machine may be shared)."""
    with open("/proc/loadavg", encoding="ascii") as loadavg:
        return " ".join(loadavg.read().split()[:3])


def wal_lsn(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def measured(pg: EmbeddedCluster, dsn: str, run: Callable[[], None]) -> tuple[float, float, int]:
    """(seconds, server CPU seconds, WAL bytes) of `run`."""
    lsn, cpu, started = wal_lsn(dsn), server_cpu_s(pg), time.perf_counter()
    run()
    seconds = time.perf_counter() - started
    return seconds, server_cpu_s(pg) - cpu, wal_lsn(dsn) - lsn


# --------------------------------------------------------------------------- derivd


SEED_READY = """
INSERT INTO archive_files (status, original_key, original_version, finished_at,
                           derived_key, derived_version, sha256, width, height)
SELECT 'ready', 'originals/bench', %(version)s, now(), 'derived/x', '1', repeat('0', 64),
       100, 100
  FROM generate_series(1, %(ready)s)
"""
SEED_QUEUED = """
INSERT INTO archive_files (status, original_key, original_version)
SELECT 'queued', 'originals/bench', %(version)s FROM generate_series(1, %(queued)s)
"""


# Path "awaited": every queued file has a waiter (derivd_waiters), so every finish is
# announced on derivd_finished, as migration 0007 did for every file. A NOTIFY takes a
# lock on the whole instance at commit, held until the commit is flushed: the run shows
# what announcing every job costs next to the default (nobody waits: nothing announced).
AWAIT_ALL = """
INSERT INTO derivd_waiters (file_id, waiter, until)
SELECT id, gen_random_uuid(), now() + interval '1 day' FROM archive_files
 WHERE status = 'queued'
"""


PATHS = ("direct", "pgbouncer", "awaited")


def seed_derivd(
    pg: EmbeddedCluster, name: str, work: Path, ready: int, queued: int, *, awaited: bool = False
) -> str:
    dsn = fresh_db(pg, name)
    version = FsStorage(work / "objects").put("originals/bench", b"x", "application/x")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SEED_READY, {"version": version, "ready": ready})
        conn.execute(SEED_QUEUED, {"version": version, "queued": queued})
        if awaited:
            conn.execute(AWAIT_ALL)
        conn.execute("VACUUM (ANALYZE) archive_files")
        conn.execute("CHECKPOINT")
    return dsn


def derivd_fleet(
    pg: EmbeddedCluster, dsn: str, db_dsn: str, work: Path, jobs: int, path: str
) -> Result:
    """`dsn`: where derivd connects (direct or the pooler); `db_dsn`: direct."""
    procs = []
    for n in range(SUPERVISORS):
        ini = work / f"fleet{n}.ini"
        ini.write_text(
            f"[database]\ndsn = {dsn}\nlisten_dsn = {db_dsn}\n"
            f"[storage]\nbackend = fs\nroot = {work / 'objects'}\n"
            f"[supervisor]\nworkers = {WORKERS}\nstate_dir = {work / f'state{n}'}\n"
            "[derive]\nbackend = noop\n[logging]\nlevel = warning\n",
            encoding="utf-8",
        )
        procs.append(ini)

    def run() -> None:
        running = [
            subprocess.Popen(
                [str(DERIVD), "-c", str(ini), "run", "--burst"],
                stdin=subprocess.DEVNULL,
                stdout=(work / f"{ini.stem}.log").open("w"),
                stderr=subprocess.STDOUT,
            )
            for ini in procs
        ]
        for proc in running:
            if proc.wait() != 0:
                raise SystemExit(f"derivd run failed; see {work}")

    seconds, cpu, wal = measured(pg, db_dsn, run)
    with psycopg.connect(db_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'queued'),"
            " extract(epoch FROM max(finished_at) - min(claimed_at))::float8"
            " FROM archive_files WHERE claimed_at IS NOT NULL OR status = 'queued'"
        ).fetchone()
    assert row is not None and row[0] == 0, row
    return Result("derivd", path, 1, jobs, float(row[1] or seconds), cpu, wal, [])


def derivd_claims(dsn: str, samples: int) -> list[float]:
    """One client: claim (timed) and commit, `samples` times."""
    times: list[float] = []
    with QueueDB.open(dsn, role="bench") as queue:
        for _ in range(samples):
            started = time.perf_counter()
            [job] = queue.claim_many(limit=1, lease_s=120, max_attempts=3)
            times.append((time.perf_counter() - started) * 1000)
            queue.commit_many([Finished(job, [])])
    return times


def stats_ms(dsn: str, repeat: int = 5) -> tuple[float, float]:
    """Best of `repeat` uncached queue statistics (max_age 0), in ms: the first call on
    a new connection (`derivd status`: the server plans every statement) and later
    calls on the same connection (a supervisor's: the plans are kept)."""
    cold = warm = float("inf")
    for _ in range(repeat):
        with QueueDB.open(dsn, role="bench") as queue:
            started = time.perf_counter()
            queue.queue_stats()
            cold = min(cold, (time.perf_counter() - started) * 1000)
            for _ in range(repeat):
                started = time.perf_counter()
                queue.queue_stats()
                warm = min(warm, (time.perf_counter() - started) * 1000)
    return cold, warm


# --------------------------------------------------------------------------- pgqueuer


def pgqueuer_run(pg: EmbeddedCluster, dsn: str, jobs: int, batch: int) -> Result:
    peer(PGQUEUER, dsn, "seed", "--jobs", str(jobs))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
        conn.execute("CHECKPOINT")
    out: dict[str, Any] = {}

    def run() -> None:
        out.update(
            peer(
                PGQUEUER,
                dsn,
                "drain",
                "--processes",
                str(SUPERVISORS * WORKERS),
                "--batch",
                str(batch),
            )
        )

    _seconds, cpu, wal = measured(pg, dsn, run)
    assert int(str(out["jobs"])) == jobs, out
    peer(PGQUEUER, dsn, "seed", "--jobs", str(CLAIM_SAMPLES))
    claims = peer(PGQUEUER, dsn, "claims", "--samples", str(CLAIM_SAMPLES), "--batch", str(batch))
    drain_s = float(str(out["end"])) - float(str(out["start"]))
    return Result(
        "pgqueuer", "direct", batch, jobs, drain_s, cpu, wal, [float(x) for x in claims["ms"]]
    )  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--ready", type=int, default=1_000_000)
    parser.add_argument(
        "--paths",
        nargs="*",
        choices=PATHS,
        default=list(PATHS),
        help="direct; pgbouncer (derivd through the pooler); awaited (direct, every file "
        "has a waiter, so every finish is announced on derivd_finished)",
    )
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--pgqueuer-batch", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--stats-rows", type=int, nargs="*", default=[1_000_000, 10_000_000])
    parser.add_argument(
        "--pg-setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a server setting for the whole run (e.g. autovacuum=off)",
    )
    args = parser.parse_args()
    if not args.no_peers:
        ensure_peers_venv()
    results: list[Result] = []
    stats: list[tuple[int, float, float]] = []
    load = [load_average()]
    settings = dict(item.split("=", 1) for item in args.pg_setting)
    with cluster(settings) as pg, tempfile.TemporaryDirectory(prefix="derivd-fleet-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        bouncer = PgBouncer(
            work / "pgbouncer", pg_host="127.0.0.1", pg_port=pg.port, user="derivd", pool_size=10
        ).start()
        try:
            for path in args.paths:
                print(f"derivd {path}: seeding ...", file=sys.stderr, flush=True)
                db = seed_derivd(
                    pg, f"fleet_{path}", work, args.ready, args.queued, awaited=path == "awaited"
                )
                dsn = bouncer.dsn(db) if path == "pgbouncer" else db
                print(f"derivd {path}: draining ...", file=sys.stderr, flush=True)
                result = derivd_fleet(pg, dsn, db, work, args.queued, path)
                with psycopg.connect(db, autocommit=True) as conn:
                    conn.execute(
                        "UPDATE archive_files SET status = 'queued', available_at = now(),"
                        " finished_at = NULL, derived_key = NULL WHERE id IN (SELECT id FROM"
                        " archive_files WHERE status = 'ready' LIMIT %s)",
                        (CLAIM_SAMPLES,),
                    )
                    conn.execute("VACUUM ANALYZE archive_files")
                result.claim_ms = derivd_claims(dsn, CLAIM_SAMPLES)
                results.append(result)
            if not args.no_peers:
                for batch in args.pgqueuer_batch:
                    print(f"pgqueuer batch {batch} ...", file=sys.stderr, flush=True)
                    dsn = fresh_db(pg, f"pgqueuer_{batch}", derivd_schema=False)
                    results.append(pgqueuer_run(pg, dsn, args.queued, batch))
            for rows in args.stats_rows:
                print(f"stats at {rows:,} rows ...", file=sys.stderr, flush=True)
                db = seed_derivd(pg, f"stats_{rows}", work, rows, 1000)
                stats.append((rows, *stats_ms(db)))
        finally:
            bouncer.stop()
        lines = machine(pg.dsn(), None if args.no_peers else str(PEERS_PYTHON))
        lines.append(f"pgbouncer {bouncer_version()}")
    load.append(load_average())
    lines.append(f"load average at start / end: {load[0]} / {load[1]}")
    if settings:
        lines.append("server settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print("## fleet")
    print("\n".join(lines))
    print(
        f"{SUPERVISORS} supervisors x {WORKERS} workers (pgqueuer: {SUPERVISORS * WORKERS} "
        f"processes), noop, {args.queued:,} jobs on {args.ready:,} finished rows; "
        "claim latency: one client, "
        f"{CLAIM_SAMPLES:,} claims"
    )
    print()
    print(table(["system", "path", "batch", "jobs", "jobs/s", "server CPU ms/job",
                 "jobs/s per DB core", "WAL B/job", "claim p50 ms", "claim p99 ms"],
                [r.row() for r in results]))  # fmt: skip
    if stats:
        print()
        print(table(["archive_files rows", "queue stats ms, new connection",
                     "queue stats ms, plans kept"], stats))  # fmt: skip
    keys = ("system", "path", "batch", "jobs", "jobs_per_s", "server_cpu_ms_per_job",
            "jobs_per_s_per_db_core", "wal_bytes_per_job", "claim_p50_ms",
            "claim_p99_ms")  # fmt: skip
    figures = [dict(zip(keys, r.row(), strict=True)) for r in results]
    for figure in figures:
        figure["label"] = f"{figure.pop('system')} {figure.pop('path')} batch {figure['batch']}"
    save_results("fleet", {"machine": lines, "results": figures,
                           "stats": [{"rows": n, "ms": warm, "first_call_ms": cold}
                                     for n, cold, warm in stats]})  # fmt: skip


def bouncer_version() -> str:
    from fixtures.pgbouncer import find_pgbouncer

    binary = find_pgbouncer()
    if binary is None:
        return "-"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True)
    return out.stdout.split("\n")[0].split()[-1] if out.stdout else "-"


if __name__ == "__main__":
    main()
