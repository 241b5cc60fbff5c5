"""Failover: how long a dead host's jobs wait before another host runs them, and what the
heartbeat costs the database.

    .venv/bin/python bench/failover.py [--trials 10] [--parallel 5]

Per configuration (the defaults; renewal with lease 30 s and heartbeat 10 s), `trials`
victim supervisors (`derivd run`, 1 worker each, host ids v1...) each claim one job that
hangs on its first attempt (tests/support/faulthandlers.py `hang-once`), next to a rescuer
supervisor (2 workers). Each victim is SIGKILLed with all its processes at a random
moment within one lease of its claim (the lease's age at a host's death is anything);
the time from the kill to the rescuer's claim of that job is its failover. Target: max
<= lease + poll_interval + 1 s.

The heartbeat's cost is the server-side time (EXPLAIN ANALYZE: planning + execution) of
the one statement a host sends per interval, with 1, 10 and 100 held jobs, with and
without renewal, per running job per minute.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from common import ROOT, cluster, fresh_db, machine, table

from derivd.config import Config
from derivd.osproc import children_of
from derivd.queue.db import Finished, HostInfo, QueueDB
from derivd.queue.sqlfiles import queries
from derivd.storage.base import new_original_key
from derivd.storage.fs import FsStorage

DERIVD = Path(sys.executable).parent / "derivd"
SUPPORT = ROOT / "tests" / "support"

CONFIGS = {
    "defaults (lease 45 s, heartbeat 10 s)": {},
    "renew (lease 30 s, heartbeat 10 s)": {
        "queue": {"lease": "30", "heartbeat": "10", "renew": "yes"},
        "supervisor": {"job_timeout": "60"},
    },
}


def write_ini(path: Path, dsn: str, store: Path, extra: dict[str, dict[str, str]]) -> None:
    sections: dict[str, dict[str, str]] = {
        "database": {"dsn": dsn},
        "storage": {"backend": "fs", "root": str(store)},
        "derive": {"backend": "faulthandlers:Script"},
        "supervisor": {"workers": "1"},
        "logging": {"level": "warning"},
    }
    for name, values in extra.items():
        sections.setdefault(name, {}).update(values)
    path.write_text(
        "".join(
            f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in values.items()) + "\n"
            for name, values in sections.items()
        )
    )


def start(ini: Path, host: str, root: Path, workers: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": str(SUPPORT),
        "DERIVD_SUPERVISOR_HOST_ID": host,
        "DERIVD_SUPERVISOR_STATE_DIR": str(root / f"state-{host}"),
        "DERIVD_SUPERVISOR_WORKERS": str(workers),
    }
    with (root / f"{host}.log").open("ab") as log:
        return subprocess.Popen(
            [str(DERIVD), "-c", str(ini), "run"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    for pid in [proc.pid, *children_of(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def held_by(queue: QueueDB, host: str) -> list[tuple[int, str]]:
    rows = queue.conn.execute(
        "SELECT id, lease_token::text FROM archive_files "
        "WHERE status = 'processing' AND claimed_by = %s",
        (host,),
    ).fetchall()
    return [(int(r[0]), str(r[1])) for r in rows]


def one_round(
    dsn: str, ini: Path, root: Path, victims: int, span: float, rng: random.Random, first: int
) -> list[float]:
    """`victims` victims each hold one job and die at a random moment of it; returns the
    seconds from each death to another host's claim of that job."""
    store = FsStorage(root / "objects")
    names = [f"v{first + n}" for n in range(victims)]
    procs = {name: start(ini, name, root, 1) for name in names}
    originals = []
    for _ in names:
        marker = root / f"marker-{uuid.uuid4().hex}"
        key = new_original_key()
        originals.append((key, store.put(key, f"hang-once {marker}".encode(), "text/plain")))
    try:
        with QueueDB.open(dsn, role="bench") as queue:
            queue.enqueue(originals)
            seen = wait_for_claims(queue, names)
            # The rescuer starts once every victim holds its job (else it would take some).
            procs["rescuer"] = start(ini, f"rescuer{first}", root, 2)
            # Each dies at a random moment of its job (its claim was seen within 50 ms); a
            # job runs at most job_timeout, so that is when a host can die holding it.
            deaths = sorted((seen[n] + rng.uniform(0, 0.95 * span), n) for n in names)
            return kill_and_watch(queue, procs, deaths)
    finally:  # nothing outlives the round, whatever happened
        for proc in procs.values():
            kill_tree(proc)


def wait_for_claims(queue: QueueDB, names: list[str]) -> dict[str, float]:
    """When each victim was first seen holding its job."""
    deadline = time.monotonic() + 120
    seen: dict[str, float] = {}
    while len(seen) < len(names):
        for name in names:
            if name not in seen and held_by(queue, name):
                seen[name] = time.monotonic()
        if time.monotonic() > deadline:
            raise SystemExit("victims did not claim their jobs")
        time.sleep(0.05)
    return seen


def kill_and_watch(
    queue: QueueDB, procs: dict[str, subprocess.Popen[bytes]], deaths: list[tuple[float, str]]
) -> list[float]:
    results: list[float] = []
    watching: dict[str, tuple[float, int, str]] = {}
    pending = list(deaths)
    while pending or watching:
        while pending and pending[0][0] <= time.monotonic():
            _, name = pending.pop(0)
            held = held_by(queue, name)
            kill_tree(procs[name])
            if held:  # else its job ended first (timed out): not a trial
                [(file_id, token)] = held
                watching[name] = (time.monotonic(), file_id, token)
        for name, (killed, file_id, token) in list(watching.items()):
            row = queue.conn.execute(
                "SELECT claimed_by FROM archive_files WHERE id = %s "
                "AND lease_token IS DISTINCT FROM %s",
                (file_id, token),
            ).fetchone()
            if row is not None:
                results.append(time.monotonic() - killed)
                del watching[name]
        time.sleep(0.02)
    return results


def failover(
    dsn: str, root: Path, label: str, extra: dict[str, dict[str, str]], args: argparse.Namespace
) -> list[float]:
    ini = root / f"{re.sub(r'[^a-z]+', '-', label)}.ini"
    write_ini(ini, dsn, root / "objects", extra)
    span = float(extra.get("supervisor", {}).get("job_timeout", Config().supervisor.job_timeout))
    rng = random.Random(args.seed)
    times: list[float] = []
    first = 1 if not root.joinpath("v1.log").exists() else 1 + len(list(root.glob("v*.log")))
    while len(times) < args.trials:
        batch = min(args.parallel, args.trials - len(times))
        times += one_round(dsn, ini, root, batch, span, rng, first)
        first += batch
        print(f"  {label}: {len(times)}/{args.trials} trials", flush=True)
    return times


def heartbeat_cost(dsn: str) -> list[tuple[str, int, float, float]]:
    """(renew, jobs, ms per statement, ms of server time per running job per minute)."""
    rows = []
    heartbeat_s = Config().queue.heartbeat_s
    with QueueDB.open(dsn, role="bench") as queue:
        host = HostInfo("bench", os.getpid(), "bench", "noop", 100, 100, heartbeat_s)
        for jobs_n in (1, 10, 100):
            queue.enqueue([(new_original_key(), "v") for _ in range(jobs_n)])
            jobs = queue.claim_many(limit=jobs_n, lease_s=600, max_attempts=3, host="bench")
            for renew in (False, True):
                samples = []
                for _ in range(50):
                    plan = queue.conn.execute(
                        "EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) " + queries()["heartbeat"],  # type: ignore[operator]
                        {
                            **host.__dict__,
                            "jobs": json.dumps([{"id": j.id, "token": str(j.token)} for j in jobs]),
                            "ids": [j.id for j in jobs],
                            "renew": renew,
                            "lease_s": 600.0,
                        },
                    ).fetchone()[0][0]
                    samples.append(plan["Planning Time"] + plan["Execution Time"])
                ms = statistics.median(samples)
                per_job_min = ms / jobs_n * 60 / heartbeat_s
                rows.append(("yes" if renew else "no", jobs_n, ms, per_job_min))
            queue.commit_many([Finished(j, []) for j in jobs])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--parallel", type=int, default=5, help="victims per round")
    parser.add_argument("--seed", type=int, default=20261201)
    args = parser.parse_args(argv)
    summary = []
    with cluster() as pg:
        dsn = fresh_db(pg, "failover")
        print("\n".join(machine(dsn)))
        root = Path(tempfile.mkdtemp(prefix="derivd-failover-"))
        root.chmod(0o711)
        for label, extra in CONFIGS.items():
            times = failover(dsn, root, label, extra, args)
            lease = float(extra.get("queue", {}).get("lease", Config().queue.lease))
            bound = lease + Config().queue.poll_interval + 1
            summary.append(
                (
                    label,
                    len(times),
                    statistics.median(times),
                    max(times),
                    bound,
                    "yes" if max(times) <= bound else "NO",
                )
            )
        cost = heartbeat_cost(dsn)
    print()
    print(table(["configuration", "trials", "p50 s", "max s", "bound s", "max <= bound"], summary))
    print()
    print(table(["renew", "held jobs", "ms per heartbeat", "ms per running job per minute"], cost))
    return 0


if __name__ == "__main__":
    sys.exit(main())
