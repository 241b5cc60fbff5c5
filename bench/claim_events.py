"""What the capped claim's `claimed` event costs (migration 0015, for the history checker):
the worker's steady state (fenced noop commit of the last job + claim of the next, one
statement) under `[queue] max_in_flight_per_tenant`, on this build and on this build
with the event's INSERT taken out of derivd_claim, side by side in one run: interleaved
rounds, each database drained by the same client, server CPU (every PostgreSQL
process), WAL and wall time per job; then the same at the default (no cap), where the
claim writes no event.

    .venv/bin/python bench/claim_events.py [--rows 20000] [--tenants 100] [--jobs 1000]
                                           [--rounds 5]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import psycopg
from common import cluster, fresh_db, machine, save_results, table
from fleet import server_cpu_s

from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.queue.db import Finished, Job, QueueDB
from derivd.queue.sqlfiles import functions

CAP = 2
SEED = """
INSERT INTO archive_files (status, original_key, original_version, tenant)
SELECT 'queued', 'originals/' || g, 'v1', 't' || (g %% %(tenants)s)
  FROM generate_series(1, %(rows)s) AS g
"""
# The event's block in derivd_claim, which the comparison build leaves out.
EVENT_BLOCK = re.compile(
    r"\n    IF tenant_cap > 0 THEN\n        INSERT INTO archive_events.*?END IF;\n", re.S
)


def without_events(dsn: str) -> None:
    """Replace derivd_claim by the same body without its `claimed` INSERT."""
    stripped, n = EVENT_BLOCK.subn("\n", functions())
    assert n == 1, "derivd_claim's event block not found"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(stripped)  # type: ignore[arg-type]


def drain(queue: QueueDB, jobs: int, cap: int) -> float:
    """Run `jobs` steady-state rounds (commit the previous job, claim the next); wall s."""
    held: list[Job] = []
    started = time.perf_counter()
    for _ in range(jobs):
        _, held = queue.commit_and_claim(
            [Finished(j, []) for j in held], limit=1, lease_s=300, max_attempts=3,
            host="bench", tenant_cap=cap,
        )  # fmt: skip
    queue.commit_and_claim([Finished(j, []) for j in held], limit=0, lease_s=300, max_attempts=3)
    return time.perf_counter() - started


def wal(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def measure(pg: EmbeddedCluster, dsn: str, jobs: int, cap: int) -> dict[str, float]:
    with QueueDB.open(dsn, role="bench") as queue:
        cpu, wal0 = server_cpu_s(pg), wal(dsn)
        wall = drain(queue, jobs, cap)
        cpu_ms = (server_cpu_s(pg) - cpu) * 1000 / jobs
    return {"server_ms": cpu_ms, "wal_b": (wal(dsn) - wal0) / jobs, "wall_ms": wall * 1000 / jobs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=1000, help="per round and build")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with cluster() as pg:
        builds = {"with claimed events": fresh_db(pg, "events"), "without": fresh_db(pg, "none")}
        without_events(builds["without"])
        for dsn in builds.values():
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(SEED, {"rows": args.rows, "tenants": args.tenants})
                conn.execute("VACUUM ANALYZE archive_files")
        runs: dict[tuple[str, int], list[dict[str, float]]] = {}
        for n in range(args.rounds):  # interleaved, the order swapped every round
            order = list(builds.items())[:: 1 if n % 2 == 0 else -1]
            for cap in (CAP, 0):
                for name, dsn in order:
                    runs.setdefault((name, cap), []).append(measure(pg, dsn, args.jobs, cap))
        about = machine(builds["without"])
    rows = []
    for (name, cap), measured in runs.items():
        median = {k: statistics.median(m[k] for m in measured) for k in measured[0]}
        spread = statistics.pstdev(m["server_ms"] for m in measured)
        rows.append({"build": name, "cap": cap, **median, "server_ms_sd": spread})
    print(table(
        ["build", "tenant cap", "server CPU ms/job", "(sd)", "WAL B/job", "wall ms/job"],
        [(r["build"], r["cap"] or "none", r["server_ms"], r["server_ms_sd"], r["wal_b"],
          r["wall_ms"]) for r in rows],
    ))  # fmt: skip
    print("\n".join(about))
    path = save_results("claim_events", {"rows": rows, "args": vars(args), "machine": about})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
