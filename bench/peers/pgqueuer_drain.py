"""pgqueuer's side of bench/queue_peers.py (runs with bench/.peers-venv's python, not derivd's).

    pgqueuer_drain.py --dsn DSN seed --jobs 20000
    pgqueuer_drain.py --dsn DSN drain --processes 2 --batch 10 [--driver asyncpg|psycopg]

    pgqueuer_drain.py --dsn DSN claims --samples 2000 --batch 1

`seed` installs pgqueuer's schema and enqueues the no-op jobs in batches of 1,000.
`claims` times `samples` dequeues of up to `batch` jobs from one connection (each
batch marked done after), and prints their durations in ms (bench/fleet.py).
`drain` starts that many processes, each one QueueManager in drain mode (the documented
`run(mode=drain)`) with its own connection and no concurrency cap, and prints one JSON
line: the earliest start and latest end over the processes (time.time(), after imports
and connect) and the jobs processed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import time
from datetime import timedelta
from typing import Any

from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver, PsycopgDriver
from pgqueuer.domain.types import QueueExecutionMode
from pgqueuer.models import Job
from pgqueuer.queries import Queries

ENTRYPOINT = "noop"


async def _driver(dsn: str, kind: str) -> tuple[Any, Any]:
    if kind == "asyncpg":
        import asyncpg

        conn = await asyncpg.connect(_asyncpg_dsn(dsn))
        return AsyncpgDriver(conn), conn
    import psycopg

    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    return PsycopgDriver(conn), conn


def _asyncpg_dsn(dsn: str) -> str:
    # asyncpg takes URLs; the bench passes libpq key=value strings.
    parts = dict(item.split("=", 1) for item in dsn.split())
    return (
        f"postgresql://{parts.get('user', 'postgres')}@{parts.get('host', '127.0.0.1')}:"
        f"{parts.get('port', '5432')}/{parts.get('dbname', 'postgres')}"
    )


async def seed(dsn: str, jobs: int, kind: str) -> None:
    driver, conn = await _driver(dsn, kind)
    queries = Queries(driver)
    with contextlib.suppress(Exception):  # already installed (a second seed)
        await queries.install()
    for start in range(0, jobs, 1000):
        n = min(1000, jobs - start)
        await queries.enqueue([ENTRYPOINT] * n, [None] * n, [0] * n)
    await conn.close()


async def _drain_one(dsn: str, batch: int, kind: str) -> dict[str, float]:
    driver, conn = await _driver(dsn, kind)
    pgq = PgQueuer(driver)
    done = 0

    @pgq.entrypoint(ENTRYPOINT)
    async def noop(job: Job) -> None:
        nonlocal done
        done += 1

    started = time.time()
    await pgq.qm.run(mode=QueueExecutionMode.drain, batch_size=batch)
    ended = time.time()
    await conn.close()
    return {"start": started, "end": ended, "jobs": done}


def _drain_process(dsn: str, batch: int, kind: str, out: Any) -> None:
    out.put(asyncio.run(_drain_one(dsn, batch, kind)))


def drain(dsn: str, processes: int, batch: int, kind: str) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_drain_process, args=(dsn, batch, kind, out)) for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    return {
        "start": min(r["start"] for r in results),
        "end": max(r["end"] for r in results),
        "jobs": sum(r["jobs"] for r in results),
    }


async def claims(dsn: str, samples: int, batch: int, kind: str) -> list[float]:
    driver, conn = await _driver(dsn, kind)
    queries = Queries(driver)
    times: list[float] = []
    for _ in range(samples):
        started = time.perf_counter()
        jobs = await queries.dequeue(
            batch_size=batch,
            entrypoints={ENTRYPOINT: _entrypoint_settings()},
            queue_manager_id=_QM_ID,
            global_concurrency_limit=None,
            heartbeat_timeout=timedelta(seconds=30),
        )
        times.append((time.perf_counter() - started) * 1000)
        if not jobs:
            break
        await queries.log_jobs([(job, "successful", None) for job in jobs])
    await conn.close()
    return times


_QM_ID = __import__("uuid").uuid4()


def _entrypoint_settings() -> Any:
    from pgqueuer.queries import EntrypointExecutionParameter

    return EntrypointExecutionParameter(concurrency_limit=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--driver", choices=("asyncpg", "psycopg"), default="asyncpg")
    sub = parser.add_subparsers(dest="command", required=True)
    seed_p = sub.add_parser("seed")
    seed_p.add_argument("--jobs", type=int, required=True)
    drain_p = sub.add_parser("drain")
    drain_p.add_argument("--processes", type=int, default=1)
    drain_p.add_argument("--batch", type=int, default=10)
    claims_p = sub.add_parser("claims")
    claims_p.add_argument("--samples", type=int, default=2000)
    claims_p.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    if args.command == "seed":
        asyncio.run(seed(args.dsn, args.jobs, args.driver))
        print(json.dumps({"seeded": args.jobs}))
    elif args.command == "claims":
        ms = asyncio.run(claims(args.dsn, args.samples, args.batch, args.driver))
        print(json.dumps({"ms": ms}))
    else:
        print(json.dumps(drain(args.dsn, args.processes, args.batch, args.driver)))


if __name__ == "__main__":
    main()
