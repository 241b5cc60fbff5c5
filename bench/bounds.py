"""What the bounds of issue 27 (items 5, 6) cost on their hot paths, side by side in one run.

1. A worker's claim, now bounded client-side (`bounded`, derivd.queue.session): the claim
   as the worker sends it (QueueDB.claim_many, limit 1, on an empty queue: the statement
   alone, the most frequent one of an idle or a noop fleet), with three ways to bound it,
   interleaved round by round on one connection:
     none      no client-side bound (the worker's claim before this change)
     timer     a threading.Timer per statement (how `bounded` did it before, for the
               supervisor's statements)
     watchdog  the per-process watchdog thread `bounded` arms now
   Client CPU per claim (process CPU time, every thread of the process: the watchdog's
   and the timers' included) and wall time per claim.
2. An fs store PUT (4 KiB, a new key each, as a variant's), with and without the
   directory fsyncs FsStorage now issues (after the rename, and for each new directory).

    .venv/bin/python bench/bounds.py [--rounds 7] [--claims 2000] [--puts 300]

Prints a table per part and writes bench/out/bounds.json (bench/plots.py draws it).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import cluster, fresh_db, machine, save_results, table

from derivd.queue import session
from derivd.queue.db import QueueDB
from derivd.storage.base import derived_key
from derivd.storage.fs import FsStorage, fsync_dir


class TimerBounds:
    """The bound as `bounded` set it before: a threading.Timer per statement (same
    arm/disarm contract as session.Watchdog)."""

    def __init__(self) -> None:
        self._timers: dict[int, threading.Timer] = {}
        self._next = 0

    def arm(self, conn: Any, seconds: float, bound: session.Bound) -> int:
        timer = threading.Timer(seconds, session._shut_down, args=(conn,))
        timer.daemon = True
        timer.start()
        self._next += 1
        self._timers[self._next] = timer
        return self._next

    def disarm(self, ticket: int) -> None:
        self._timers.pop(ticket).cancel()


def claims(queue: QueueDB, arm: str, n: int) -> tuple[float, float]:
    """(CPU us, wall us) per claim with the bound `arm`."""
    queue.claim_bound_s = None if arm == "none" else 10.0
    session.WATCHDOG = TimerBounds() if arm == "timer" else WATCHDOG  # type: ignore[assignment]
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        queue.claim_many(limit=1, lease_s=60, max_attempts=3)
    per = 1e6 / n
    return (time.process_time() - cpu) * per, (time.perf_counter() - wall) * per


def mechanism(conn: Any, arm: str, n: int) -> float:
    """CPU us of the bound itself per statement: `bounded` armed and disarmed around no
    statement (what it adds to every bounded statement, whatever the statement costs)."""
    session.WATCHDOG = TimerBounds() if arm == "timer" else WATCHDOG  # type: ignore[assignment]
    seconds = None if arm == "none" else 10.0
    cpu = time.process_time()
    for _ in range(n):
        with session.bounded(conn, seconds):
            pass
    return (time.process_time() - cpu) * 1e6 / n


def puts(root: Path, sync: Callable[[Path], None], n: int) -> float:
    """Wall ms per PUT of a 4 KiB variant under a new attempt's prefix each."""
    store = FsStorage(root, sync_dir=sync)
    data = b"x" * 4096
    started = time.perf_counter()
    for i in range(n):
        store.put(derived_key(i, uuid.uuid4(), "preview", "webp"), data, "image/webp")
    return (time.perf_counter() - started) * 1000 / n


WATCHDOG = session.WATCHDOG
ARMS = ("none", "timer", "watchdog")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--claims", type=int, default=2000)
    parser.add_argument("--puts", type=int, default=300)
    args = parser.parse_args()

    results: dict[str, Any] = {"rounds": args.rounds, "claims": {}, "puts": {}}
    with cluster() as pg:
        dsn = fresh_db(pg, "bounds")
        env = machine(dsn)
        with QueueDB.open(dsn, role="bench-worker") as queue:
            claims(queue, "watchdog", 200)  # warm: plans, the watchdog thread
            runs: dict[str, list[tuple[float, float]]] = {a: [] for a in ARMS}
            alone: dict[str, list[float]] = {a: [] for a in ARMS}
            for r in range(args.rounds):
                order = ARMS if r % 2 == 0 else tuple(reversed(ARMS))
                for arm in order:
                    alone[arm].append(mechanism(queue.conn, arm, 10 * args.claims))
                    runs[arm].append(claims(queue, arm, args.claims))
        session.WATCHDOG = WATCHDOG
    rows = []
    for arm in ARMS:
        cpu = statistics.median(c for c, _ in runs[arm])
        wall = statistics.median(w for _, w in runs[arm])
        bound = statistics.median(alone[arm])
        results["claims"][arm] = {
            "bound_cpu_us": bound, "cpu_us": cpu, "wall_us": wall, "runs": runs[arm]
        }  # fmt: skip
        rows.append([arm, f"{bound:.1f}", cpu, wall])
    print("\n".join(env))
    print(f"\nthe bound alone ({10 * args.claims} per round), then claim_many(limit=1) on "
          f"an empty queue ({args.claims} per round), median of {args.rounds} interleaved "
          "rounds")  # fmt: skip
    headers = ["bound", "its CPU us/statement", "claim: client CPU us", "claim: wall us"]
    print(table(headers, rows))

    with tempfile.TemporaryDirectory(dir=Path(__file__).parent / "out") as tmp:
        put_runs: dict[str, list[float]] = {"no dir fsync": [], "dir fsyncs": []}
        for r in range(args.rounds):
            arms: list[tuple[str, Callable[[Path], None]]] = [
                ("no dir fsync", lambda p: None),
                ("dir fsyncs", fsync_dir),
            ]
            for name, sync in arms if r % 2 == 0 else arms[::-1]:
                root = Path(tmp) / f"{name.replace(' ', '-')}-{r}"
                put_runs[name].append(puts(root, sync, args.puts))
        fs = Path(tmp).resolve()
    put_rows = []
    for name, values in put_runs.items():
        ms = statistics.median(values)
        results["puts"][name] = {"ms": ms, "runs": values}
        put_rows.append([name, ms])
    print(f"\nfs PUT, 4 KiB under a new prefix each, {args.puts} per round ({fs.parent})")
    print(table(["fs store", "ms/PUT"], put_rows))
    print(f"\nwrote {save_results('bounds', results)}")


if __name__ == "__main__":
    main()
