"""`derivd status --json` as a health probe runs it: a new process every few seconds.

Seeds two databases: `small` (10,000 finished rows, an hour of events at 1/s) and `large`
(4,000,000 finished rows, an hour of events at 100/s), each with a few queued rows and one
live host. Then, per database, it times the whole command (process start to exit) over
several runs and prints min and median, and the parts inside one run: the interpreter
and the imports the command needs, the schema check and the status statements, each on
a fresh connection as the command opens them.

    .venv/bin/python bench/status_probe.py [--runs 7] [--large 4000000]
    .venv/bin/python bench/status_probe.py --serve   # seed, print the DSNs, keep running

With --serve the databases stay up until Ctrl-C or SIGTERM, to time the command with any
other tool (e.g. `/usr/bin/time -v derivd status --json` with DERIVD_DATABASE_DSN set).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import psycopg
from common import DERIVD, cluster, fresh_db, machine, table

from derivd.queue.db import HostInfo, QueueDB, check_schema, connect

SEED_FINISHED = """
INSERT INTO archive_files (status, original_key, original_version, derived_key,
                           derived_version, sha256, width, height, attempts,
                           created_at, updated_at, claimed_at, finished_at)
SELECT 'ready', 'originals/' || g, 'v1', 'derived/' || g || '/t/preview.webp', 'v1',
       repeat('ab', 32), 1600, 1200, 1, t, t, t, t
  FROM generate_series(1, %(rows)s) AS g,
       LATERAL (SELECT now() - interval '30 days' + g * interval '1 ms' AS t) AS at;
"""

SEED_QUEUED = """
INSERT INTO archive_files (status, original_key, original_version, available_at)
SELECT 'queued', 'originals/q' || g, 'v1', now() FROM generate_series(1, 20) AS g;
"""

# An hour of finished jobs' events, `rate` a second: what the window counts read.
SEED_EVENTS = """
INSERT INTO archive_events (file_id, at, kind, attempt, lease_token, error_code)
SELECT g, now() - interval '1 hour' + g * make_interval(secs => 1.0 / %(rate)s),
       CASE WHEN g %% 50 = 0 THEN 'rejected' ELSE 'ready' END, 1, gen_random_uuid(),
       CASE WHEN g %% 50 = 0 THEN 'corrupt_content' END
  FROM generate_series(1, 3600 * %(rate)s) AS g;
"""


def seed(dsn: str, rows: int, rate: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SEED_FINISHED, {"rows": rows})
        conn.execute(SEED_QUEUED)
    with QueueDB.open(dsn, role="bench") as queue:
        queue.create_event_partitions(3, first=(datetime.now(UTC) - timedelta(days=1)).date())
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SEED_EVENTS, {"rate": rate})
            conn.execute("VACUUM (ANALYZE)")
        queue.register_host(HostInfo("bench-host", os.getpid(), "bench", "noop", 2, 0, 3600.0))


def whole_command(dsn: str, runs: int) -> list[float]:
    """Wall seconds of `derivd status --json`, process start to exit, after a warm-up."""
    env = {**os.environ, "DERIVD_DATABASE_DSN": dsn}
    times = []
    for n in range(runs + 1):
        started = time.perf_counter()
        done = subprocess.run(
            [str(DERIVD), "status", "--json"], env=env, capture_output=True, check=False
        )
        if done.returncode not in (0, 1):
            raise SystemExit(f"derivd status failed: {done.stderr.decode().strip()}")
        if n:
            times.append(time.perf_counter() - started)
    return times


def interpreter_and_imports(runs: int) -> list[float]:
    """A process that only imports what `derivd status` imports before it connects."""
    code = "import derivd.cli, derivd.ops.status"
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - started)
    return times


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def on_fresh_connection(dsn: str, call: Callable[[QueueDB], object]) -> Callable[[], object]:
    def run() -> object:
        with QueueDB(connect(dsn, application_name="bench"), dsn) as queue:
            return call(queue)

    return run


def parts(dsn: str, runs: int, window_s: float) -> list[tuple[str, list[float]]]:
    def fresh(call: Callable[[QueueDB], object]) -> list[float]:
        return timed(on_fresh_connection(dsn, call), runs)

    return [
        ("connect", timed(lambda: connect(dsn).close(), runs)),
        ("schema check (own connection)", timed(lambda: check_schema(dsn), runs)),
        ("queue_stats, computed", fresh(lambda q: q.queue_stats())),
        ("queue_stats, cached", fresh(lambda q: q.queue_stats(max_age_s=3600))),
        ("event_window, computed", fresh(lambda q: q.event_window(window_s=window_s))),
        (
            "event_window, cached",
            fresh(lambda q: q.event_window(window_s=window_s, max_age_s=3600)),
        ),
        ("hosts", fresh(lambda q: q.hosts())),
    ]


def ms(values: list[float]) -> tuple[float, float]:
    return min(values) * 1000, statistics.median(values) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--large", type=int, default=4_000_000)
    parser.add_argument("--serve", action="store_true", help="seed, print DSNs, keep running")
    args = parser.parse_args()
    with cluster() as pg:
        dsns = {}
        for name, rows, rate in (("small", args.small, 1), ("large", args.large, 100)):
            started = time.perf_counter()
            dsns[name] = fresh_db(pg, f"status_{name}")
            seed(dsns[name], rows, rate)
            print(f"{name}: {rows:,} finished rows, {3600 * rate:,} events in the last hour "
                  f"(seeded in {time.perf_counter() - started:.1f} s)", flush=True)  # fmt: skip
        if args.serve:
            for name, dsn in dsns.items():
                print(f"DERIVD_DATABASE_DSN='{dsn}'  # {name}", flush=True)
            # SIGTERM too (a background job ignores SIGINT): the cluster is stopped on exit.
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                return
        print("\n".join(machine(dsns["small"])))
        rows: list[list[object]] = []
        imports = interpreter_and_imports(args.runs)
        rows.append(["python + imports of `derivd status`", "-", *ms(imports)])
        for name, dsn in dsns.items():
            whole = whole_command(dsn, args.runs)
            rows.append(["`derivd status --json`, whole process", name, *ms(whole)])
            for label, values in parts(dsn, args.runs, 3600.0):
                rows.append([f"  {label}", name, *ms(values)])
        print(table(["what", "table", "min ms", "median ms"], rows))


if __name__ == "__main__":
    main()
