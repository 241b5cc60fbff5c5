"""procrastinate's side of bench/queue_peers.py (runs with bench/.peers-venv's python).

    procrastinate_drain.py --dsn DSN seed --jobs 20000
    procrastinate_drain.py --dsn DSN drain --processes 2 --concurrency 10

`seed` applies procrastinate's schema and defers the no-op jobs with batch_defer, 1,000
at a time. `drain` starts that many processes, each one worker with `wait=False` (exit
once no job is left), the given concurrency (an async no-op task, so concurrency is what
the docs recommend for I/O-bound tasks), LISTEN/NOTIFY on (the default), finished jobs
kept (the default). Prints one JSON line like pgqueuer_drain.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import time
from typing import Any

import procrastinate

QUEUE = "bench"


def make_app(dsn: str) -> tuple[procrastinate.App, list[int]]:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))
    done = [0]

    @app.task(name="noop", queue=QUEUE)
    async def noop() -> None:
        done[0] += 1

    return app, done


def seed(dsn: str, jobs: int) -> None:
    app, _ = make_app(dsn)
    noop = app.tasks["noop"]
    with app.open():
        app.schema_manager.apply_schema()
        for start in range(0, jobs, 1000):
            n = min(1000, jobs - start)
            noop.batch_defer(*({} for _ in range(n)))


async def _drain_one(dsn: str, concurrency: int) -> dict[str, float]:
    app, done = make_app(dsn)
    async with app.open_async():
        started = time.time()
        await app.run_worker_async(
            queues=[QUEUE], concurrency=concurrency, wait=False, install_signal_handlers=False
        )
        ended = time.time()
    return {"start": started, "end": ended, "jobs": done[0]}


def _drain_process(dsn: str, concurrency: int, out: Any) -> None:
    logging.basicConfig(level=logging.WARNING)
    out.put(asyncio.run(_drain_one(dsn, concurrency)))


def drain(dsn: str, processes: int, concurrency: int) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_drain_process, args=(dsn, concurrency, out)) for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=900) for _ in procs]
    for proc in procs:
        proc.join()
    return {
        "start": min(r["start"] for r in results),
        "end": max(r["end"] for r in results),
        "jobs": sum(r["jobs"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True)
    sub = parser.add_subparsers(dest="command", required=True)
    seed_p = sub.add_parser("seed")
    seed_p.add_argument("--jobs", type=int, required=True)
    drain_p = sub.add_parser("drain")
    drain_p.add_argument("--processes", type=int, default=1)
    drain_p.add_argument("--concurrency", type=int, default=10)
    args = parser.parse_args()
    if args.command == "seed":
        seed(args.dsn, args.jobs)
        print(json.dumps({"seeded": args.jobs}))
    else:
        print(json.dumps(drain(args.dsn, args.processes, args.concurrency)))


if __name__ == "__main__":
    main()
