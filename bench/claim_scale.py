"""Claim latency at scale: 1,000,000 finished (`ready`) rows and 100,000 `queued` rows.

Seeds the table with generate_series (seconds, not minutes), then claims through the
product's own `QueueDB.claim` (client round trip included) and commits each job with the
noop commit, so the claim index sees the churn a real drain gives it. Prints claim
p50/p99 and the plans (auto_explain, ANALYZE, BUFFERS) of the statements inside one claim.
With `--baseline REF` a second database gets REF's migrations and functions.sql (as
bench/traffic.py builds its baseline) and the same rows; the two take their claims in
interleaved blocks of 100 (a shared machine's load moves within a minute).

    .venv/bin/python bench/claim_scale.py [--ready 1000000] [--queued 100000] [--claims 5000]
                                          [--baseline main]
"""

from __future__ import annotations

import argparse
import time

import psycopg
from common import cluster, fresh_db, machine, percentile, table
from traffic import baseline_db

from derivd.queue.db import Finished, QueueDB
from derivd.queue.sqlfiles import queries

SEED = """
INSERT INTO archive_files (status, original_key, original_version, derived_key,
                           derived_version, sha256, width, height, attempts,
                           created_at, updated_at, claimed_at, finished_at)
SELECT 'ready', 'originals/' || g, 'v1', 'derived/' || g || '/t/preview.webp', 'v1',
       repeat('ab', 32), 1600, 1200, 1,
       now() - interval '30 days' + g * interval '1 second',
       now() - interval '30 days' + g * interval '1 second',
       now() - interval '30 days' + g * interval '1 second',
       now() - interval '30 days' + g * interval '1 second'
  FROM generate_series(1, %(ready)s) AS g;
"""

SEED_QUEUED = """
INSERT INTO archive_files (status, original_key, original_version, available_at)
SELECT 'queued', 'originals/q' || g, 'v1', now() - interval '1 hour' + g * interval '1 ms'
  FROM generate_series(1, %(queued)s) AS g;
"""


def seed(dsn: str, ready: int, queued: int) -> float:
    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SEED, {"ready": ready})
        conn.execute(SEED_QUEUED, {"queued": queued})
        conn.execute("VACUUM (ANALYZE) archive_files")
    return time.perf_counter() - started


def explain_claim(dsn: str) -> str:
    """The plans of one real claim, rolled back so it changes nothing. The claim is a
    server-side function (derivd_claim, migration 0008): EXPLAIN of the call shows only
    "Function Scan", so auto_explain reports the statements inside it (nested), sent back
    to this client as LOG messages."""
    plans: list[str] = []
    with psycopg.connect(dsn) as conn:
        conn.add_notice_handler(lambda diag: plans.append(diag.message_primary or ""))
        for setting in (
            "LOAD 'auto_explain'",
            "SET client_min_messages = log",
            "SET auto_explain.log_min_duration = 0",
            "SET auto_explain.log_nested_statements = on",
            "SET auto_explain.log_analyze = on",
            "SET auto_explain.log_buffers = on",
            "SET auto_explain.log_timing = on",
        ):
            conn.execute(setting)
        conn.execute(
            queries()["claim"],  # type: ignore[arg-type]
            {
                "lease_s": 120.0,
                "max_attempts": 3,
                "limit": 1,
                "host": "claim-scale",
                "tenant_cap": 0,
                "prefix_format": None,
            },
        ).fetchall()
        conn.rollback()
    nested = [p for p in plans if "Function Scan on derivd_claim" not in p]
    return "\n\n".join(nested or plans)


BLOCK = 100  # claims per database before the next one's turn


def measure(dsns: list[str], claims: int) -> list[list[float]]:
    """Claim round trips (s) per database, `claims` each, interleaved in blocks."""
    times: list[list[float]] = [[] for _ in dsns]
    queues = [QueueDB.open(dsn, role="bench") for dsn in dsns]
    try:
        for block in range(0, claims, BLOCK):
            for queue, measured in zip(queues, times, strict=True):
                for _ in range(min(BLOCK, claims - block)):
                    started = time.perf_counter()
                    jobs = queue.claim_many(limit=1, lease_s=120.0, max_attempts=3)
                    measured.append(time.perf_counter() - started)
                    if not jobs:
                        raise SystemExit("queue ran dry: seed more queued rows than claims")
                    queue.commit_many([Finished(jobs[0], [])])
    finally:
        for queue in queues:
            queue.close()
    return times


def sizes(dsn: str) -> list[tuple[str, str]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT c.relname, pg_size_pretty(pg_relation_size(c.oid))"
            "  FROM pg_class c WHERE c.relname LIKE 'archive_files%' ORDER BY c.relname"
        ).fetchall()
    return [(r[0], r[1]) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ready", type=int, default=1_000_000)
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--claims", type=int, default=5000)
    parser.add_argument("--baseline", help="git ref to compare with, in the same run")
    args = parser.parse_args()
    with cluster() as pg:
        dsn = fresh_db(pg, "claim_scale")
        builds = [("this build", dsn)]
        if args.baseline:
            builds.append((args.baseline, baseline_db(pg, "claim_scale_base", args.baseline)))
        seed_s = [seed(d, args.ready, args.queued) for _, d in builds]
        plan_before = explain_claim(dsn)
        all_times = measure([d for _, d in builds], args.claims)
        plan_after = explain_claim(dsn)
        print("## claim_scale")
        print("\n".join(machine(dsn)))
        print(
            f"table: {args.ready:,} ready + {args.queued:,} queued rows "
            f"(seeded in {' / '.join(f'{s:.1f}' for s in seed_s)} s); "
            f"{args.claims:,} claims per build, each followed by its "
            "noop commit; one client, claim round trip timed"
        )
        rows = []
        for (label, _), times in zip(builds, all_times, strict=True):
            ms = [t * 1000 for t in times]
            rows.append(
                [
                    label,
                    len(ms),
                    percentile(ms, 50),
                    percentile(ms, 90),
                    percentile(ms, 99),
                    max(ms),
                    sum(ms) / len(ms),
                ]
            )
        print()
        print(table(["build", "claims", "p50 ms", "p90 ms", "p99 ms", "max ms", "mean ms"], rows))
        print()
        print(table(["relation", "size"], sizes(dsn)))
        print("\nPlans (auto_explain: ANALYZE, BUFFERS) inside one claim, before the run:\n")
        print(plan_before)
        print(f"\n... and after {args.claims:,} claims and commits:\n")
        print(plan_after)


if __name__ == "__main__":
    main()
