"""What `derivd.client.similar` costs as the table grows to 1,000,000 analysed rows, and
what a band index would buy and cost.

Seeds `ready` rows with random dhashes (generate_series: seconds, not minutes) plus
near-duplicates planted at 1-7 bits, then times `client.similar(max_distance=6)` at each size:
as shipped (derivd_similar scans the ready rows) and with the optional GIN index of
docs/integrating.md on the dhash's four 16-bit bands (derivd_similar then probes
it: migration 0013).
The index's price: its size, build time, and what a job's fenced commit pays for it (time
and WAL per job, claim + commit with an analysis).

    .venv/bin/python bench/similar.py [--sizes 10000,100000,1000000] [--queries 30]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import psycopg
from common import cluster, fresh_db, machine, percentile, save_results, table

from derivd import client
from derivd.handlers.base import Analysis
from derivd.queue.db import Finished, QueueDB

PLACEHOLDER = "YJqGPQw7sFlslqhFafSE+Q6oJ1h2iHB2Rw"
SEED = """
INSERT INTO archive_files (status, original_key, original_version, attempts, finished_at,
                           original_width, original_height, original_format, original_frames,
                           original_has_alpha, original_colour, original_placeholder,
                           original_dhash)
SELECT 'ready', 'originals/' || g, 'v1', 1, now(), 4032, 3024, 'jpeg', 1, false, '#808080',
       'YJqGPQw7sFlslqhFafSE+Q6oJ1h2iHB2Rw',
       ((floor(random() * 4294967296)::bigint - 2147483648) << 32)
       | floor(random() * 4294967296)::bigint
  FROM generate_series(1, %(n)s) AS g;
"""

# Copies of `n` random rows with 1-7 random bits flipped: what similar is meant to find.
PLANT = """
INSERT INTO archive_files (status, original_key, original_version, attempts, finished_at,
                           original_width, original_height, original_format, original_frames,
                           original_has_alpha, original_colour, original_placeholder,
                           original_dhash)
SELECT 'ready', f.original_key || '-copy', 'v1', 1, now(), 4032, 3024, 'jpeg', 1, false,
       '#808080', f.original_placeholder,
       f.original_dhash # (SELECT bit_or(1::bigint << b)
                             FROM (SELECT (random() * 63)::int AS b
                                     FROM generate_series(1, 1 + f.id %% 7)) AS bits)
  FROM (SELECT * FROM archive_files ORDER BY random() LIMIT %(n)s) AS f;
"""

COPIES = "SELECT id FROM archive_files WHERE original_key LIKE '%%-copy' LIMIT %(n)s"

SIZES = """
SELECT pg_relation_size('archive_files_dhash_bands') / 1048576.0,
       pg_table_size('archive_files') / 1048576.0
"""
# The optional index of docs/integrating.md ("From Python"), as written there.
INDEX = """
CREATE INDEX archive_files_dhash_bands ON archive_files
 USING gin (derivd_dhash_bands(original_dhash)) WHERE original_dhash IS NOT NULL;
"""


def timed(calls: list[Any], fn: Any) -> tuple[list[float], list[Any]]:
    times, results = [], []
    for arg in calls:
        started = time.perf_counter()
        results.append(fn(arg))
        times.append((time.perf_counter() - started) * 1000)
    return times, results


def similar_row(conn: psycopg.Connection[Any], label: str, ids: list[int], path: str) -> list[Any]:
    """Time client.similar(max_distance=6) on each id."""
    client.similar(conn, ids[0])  # plan and cache once
    times, found = timed(ids, lambda i: client.similar(conn, i))
    return [label, path, statistics.median(times), percentile(times, 95),
            sum(len(f) for f in found)]  # fmt: skip


def commit_cost(dsn: str, jobs: int) -> tuple[float, float]:
    """Median ms and mean WAL bytes per job: claim, then the fenced commit with an analysis."""
    rng = random.Random(7)
    with QueueDB.open(dsn) as queue:
        queue.enqueue([(f"originals/new{i}", "v1") for i in range(jobs)])
        lsn = queue.conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
        times = []
        for _ in range(jobs):
            started = time.perf_counter()
            [job] = queue.claim_many(limit=1, lease_s=60, max_attempts=3)
            dhash = rng.getrandbits(64) - 2**63
            original = Analysis(4032, 3024, "jpeg", 1, False, "#808080", PLACEHOLDER, dhash)
            queue.commit_many([Finished(job, [], original)])
            times.append((time.perf_counter() - started) * 1000)
        wal = queue.conn.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (lsn,)
        ).fetchone()[0]  # type: ignore[index]
    return statistics.median(times), float(wal) / jobs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--queries", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=1000, help="jobs per commit-cost round")
    parser.add_argument("--rounds", type=int, default=2, help="commit-cost rounds, each way")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = random.Random(19)
    rows: list[list[Any]] = []
    index_rows: list[list[Any]] = []
    with cluster() as pg:
        dsn = fresh_db(pg, "similar")
        print("\n".join(machine(dsn)))
        with psycopg.connect(dsn, autocommit=True) as conn:
            have = 0
            for size in sizes:
                conn.execute(SEED, {"n": size - have - size // 100})
                conn.execute(PLANT, {"n": size // 100})
                have = size
                conn.execute("VACUUM ANALYZE archive_files")
                # Half the questions about a planted copy (it has a near-duplicate), half
                # about any row (it usually has none).
                copies = [r[0] for r in conn.execute(COPIES, {"n": args.queries // 2})]
                top = conn.execute("SELECT max(id) FROM archive_files").fetchone()[0]  # type: ignore[index]
                ids = copies + [rng.randint(1, top) for _ in range(args.queries - len(copies))]
                label = f"{size:,}"
                rows.append(similar_row(conn, label, ids, "scan"))
                started = time.perf_counter()
                conn.execute(INDEX)
                built = time.perf_counter() - started
                conn.execute("VACUUM ANALYZE archive_files")
                index_mb, table_mb = conn.execute(SIZES).fetchone()  # type: ignore[misc]
                rows.append(similar_row(conn, label, ids, "GIN band index"))
                assert rows[-1][4] == rows[-2][4], "the index must find what the scan finds"
                index_rows.append([label, float(table_mb), float(index_mb), built])
                conn.execute("DROP INDEX archive_files_dhash_bands")
        # Alternate, so that the shared machine's noise falls on both alike.
        costs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for indexed in (False, True):
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute(
                        INDEX if indexed else "DROP INDEX IF EXISTS archive_files_dhash_bands"
                    )
                costs[indexed].append(commit_cost(dsn, args.jobs))
        without, with_index = (
            tuple(statistics.median(c[k] for c in costs[i]) for k in (0, 1)) for i in (False, True)
        )
    print("\nclient.similar(max_distance=6), ready rows with random dhashes, 1 % planted copies")
    print(table(["ready rows", "path", "median ms", "p95 ms", "found (all queries)"], rows))
    print("\nthe band index (GIN, 4 keys per analysed row)")
    print(table(["ready rows", "table MB", "index MB", "build s"], index_rows))
    print(f"\nclaim + fenced commit with an analysis, {args.rounds} x {args.jobs} jobs each "
          f"way on {sizes[-1]:,} rows (medians of the rounds)")  # fmt: skip
    print(table(["", "median ms per job", "WAL bytes per job"],
                [["no band index", *without], ["band index", *with_index]]))  # fmt: skip
    save_results("similar", {"similar": rows, "index": index_rows,
                             "commit": {"without": without, "with": with_index}})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
