"""Pickup latency: how long a row queued while every worker is idle waits for its claim.

Runs the real `derivd run` (noop backend, default poll_interval of 1 s) with listen = yes
and with listen = no. Once its workers sit idle, a producer queues rows one at a time
(autocommit INSERTs, as an upload API would, at random gaps so that no arrival lines up
with a poll), then queues bursts of rows in one transaction (one folded notification).
Latency is the row's claimed_at - created_at, both from the database clock; created_at is
the INSERT's transaction start, a fraction of a millisecond before its commit.

    .venv/bin/python bench/latency.py [--rows 300] [--workers 2] [--bursts 20 --burst 20]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from common import ROOT, cluster, fresh_db, machine, percentile, save_results, table

from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.storage.fs import FsStorage

DERIVD = Path(sys.executable).parent / "derivd"


def idle(conn: psycopg.Connection[object], workers: int, listen: bool) -> bool:
    rows = conn.execute(
        "SELECT application_name, state, query FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    ).fetchall()
    ready = [
        r
        for r in rows
        if str(r[0]).startswith("derivd-worker") and r[1] == "idle" and "SKIP LOCKED" in r[2]
    ]
    listening = any("LISTEN DERIVD_QUEUED" in str(r[2]).upper() for r in rows)
    return len(ready) >= workers and (listening or not listen)


def wait_until(predicate: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise SystemExit("derivd did not become idle in time")


def measure(
    pg: EmbeddedCluster,
    work: Path,
    *,
    listen: bool,
    workers: int,
    rows: int,
    bursts: int,
    burst: int,
) -> tuple[list[float], list[float]]:
    name = f"latency_{'listen' if listen else 'poll'}"
    dsn = fresh_db(pg, name)
    store = work / f"objects-{name}"
    version = FsStorage(store).put("originals/lat", b"x", "application/octet-stream")
    ini = work / f"{name}.ini"
    ini.write_text(
        f"[database]\ndsn = {dsn}\n[storage]\nbackend = fs\nroot = {store}\n"
        f"[supervisor]\nworkers = {workers}\nstate_dir = {work / 'state'}\n"
        f"[queue]\nlisten = {'yes' if listen else 'no'}\n[derive]\nbackend = noop\n"
        "[logging]\nlevel = warning\n",
        encoding="utf-8",
    )
    insert = (
        "INSERT INTO archive_files (status, original_key, original_version)"
        " SELECT 'queued', 'originals/lat', %(v)s FROM generate_series(1, %(n)s)"
    )
    rng = random.Random(7)
    proc = subprocess.Popen(
        [str(DERIVD), "-c", str(ini), "run"], stdin=subprocess.DEVNULL, cwd=ROOT
    )
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            wait_until(lambda: idle(conn, workers, listen), 60)
            single_ids = []
            for _ in range(rows):
                time.sleep(rng.uniform(0.01, 0.05))
                single_ids.append(
                    conn.execute(insert + " RETURNING id", {"v": version, "n": 1}).fetchone()[0]
                )  # type: ignore[index]
            burst_ids = []
            for _ in range(bursts):
                wait_until(lambda: idle(conn, workers, listen) and not _pending(conn), 60)
                time.sleep(rng.uniform(0.01, 0.05))
                burst_ids += [
                    r[0] for r in conn.execute(insert + " RETURNING id", {"v": version, "n": burst})
                ]
            wait_until(lambda: not _pending(conn), 120)
            single = _latencies(conn, single_ids)
            bulk = _latencies(conn, burst_ids)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return single, bulk


def _pending(conn: psycopg.Connection[object]) -> bool:
    row = conn.execute(
        "SELECT count(*) FROM archive_files WHERE status IN ('queued', 'processing')"
    ).fetchone()
    return bool(row and row[0])


def _latencies(conn: psycopg.Connection[object], ids: list[int]) -> list[float]:
    rows = conn.execute(
        "SELECT extract(epoch FROM claimed_at - created_at)::float8 * 1000"
        "  FROM archive_files WHERE id = ANY(%s) AND status = 'ready'",
        (ids,),
    ).fetchall()
    if len(rows) != len(ids):
        raise SystemExit(f"{len(ids) - len(rows)} rows did not end ready")
    return [float(r[0]) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--bursts", type=int, default=20)
    parser.add_argument("--burst", type=int, default=20, help="rows per burst transaction")
    args = parser.parse_args()
    results = []
    series = []  # every latency, for the distribution chart (bench/plots.py)
    with cluster() as pg, tempfile.TemporaryDirectory(prefix="derivd-bench-lat-") as tmp:
        work = Path(tmp)
        work.chmod(0o755)
        for listen in (True, False):
            print(f"listen = {'yes' if listen else 'no'} ...", file=sys.stderr, flush=True)
            single, bulk = measure(
                pg,
                work,
                listen=listen,
                workers=args.workers,
                rows=args.rows,
                bursts=args.bursts,
                burst=args.burst,
            )
            for label, values in (
                ("one row per commit", single),
                (f"{args.burst} rows per commit", bulk),
            ):
                series.append({"listen": "yes" if listen else "no", "enqueue": label, "ms": values})
                results.append(
                    [
                        "yes" if listen else "no",
                        label,
                        len(values),
                        percentile(values, 50),
                        percentile(values, 99),
                        max(values),
                    ]
                )
        lines = machine(pg.dsn())
    print("## latency")
    print("\n".join(lines))
    print(
        f"`derivd run`, {args.workers} idle workers, noop backend, poll_interval 1 s (the "
        "default); latency = claimed_at - created_at (database clock)"
    )
    print()
    print(table(["listen", "enqueue", "rows", "p50 ms", "p99 ms", "max ms"], results))
    save_results("latency", {"machine": lines, "workers": args.workers, "series": series})


if __name__ == "__main__":
    main()
