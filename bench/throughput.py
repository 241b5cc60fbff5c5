"""Queue throughput: no-op jobs drained by derivd, pgqueuer and procrastinate.

One embedded PostgreSQL (durable settings, in a temp dir) serves the whole run; every
system gets its own fresh database on it, the same number of jobs, and the same number
of OS processes. derivd runs as the real `derivd run --burst` ([derive] backend = noop,
[supervisor] workers = N) on rows seeded with SQL, all pointing at one small original in
an fs store (the noop backend skips the GET: it measures the queue itself). The peers run
in their own virtual environment (bench/.peers-venv, created here on first use) through
bench/peers/*.py.

    .venv/bin/python bench/queue_peers.py [--jobs 20000] [--workers 2 4] [--no-peers]

"drain s" is the time from the first claim to the last finish: for derivd from the rows'
claimed_at/finished_at (database clock), for the peers from just before their run call
to its return, in-process (after imports and connect). "wall s" is the whole command,
interpreter start-up and boot included.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from common import ROOT, burst_drain, cluster, fresh_db, machine, save_results, table

from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.storage.fs import FsStorage

BENCH = ROOT / "bench"
PEERS_VENV = BENCH / ".peers-venv"
PEERS_PYTHON = PEERS_VENV / "bin" / "python"
# pgqueuer's README connects with asyncpg; procrastinate's default connector is psycopg.
PEERS_PACKAGES = ["pgqueuer", "procrastinate", "psycopg[binary]", "asyncpg"]


@dataclass
class Run:
    system: str
    processes: int
    concurrency: str
    jobs: int
    drain_s: float
    wall_s: float

    @property
    def rate(self) -> float:
        return self.jobs / self.drain_s if self.drain_s > 0 else 0.0


def ensure_peers_venv() -> None:
    """Create bench/.peers-venv with the peers' packages (git-ignored; kept across runs)."""
    if PEERS_PYTHON.exists():
        probe = subprocess.run(
            [str(PEERS_PYTHON), "-c", "import pgqueuer, procrastinate, psycopg, asyncpg"],
            capture_output=True,
        )
        if probe.returncode == 0:
            return
    print(f"creating {PEERS_VENV} (pip install {' '.join(PEERS_PACKAGES)}) ...", flush=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(PEERS_VENV)], check=True)
    subprocess.run([str(PEERS_PYTHON), "-m", "pip", "install", "-q", *PEERS_PACKAGES], check=True)


# --------------------------------------------------------------------------- derivd


SEED_DERIVD = """
INSERT INTO archive_files (status, original_key, original_version)
SELECT 'queued', %(key)s, %(version)s FROM generate_series(1, %(jobs)s)
"""


def run_derivd(
    pg: EmbeddedCluster, jobs: int, workers: int, work: Path, claim_batch: int = 1
) -> Run:
    name = f"{workers}_{claim_batch}"
    dsn = fresh_db(pg, f"derivd_{name}")
    store = work / f"objects-{name}"
    version = FsStorage(store).put("originals/bench", b"x" * 1024, "application/octet-stream")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SEED_DERIVD, {"key": "originals/bench", "version": version, "jobs": jobs})
        conn.execute("VACUUM (ANALYZE) archive_files")
    ini = work / f"derivd-{name}.ini"
    ini.write_text(
        f"[database]\ndsn = {dsn}\n"
        f"[storage]\nbackend = fs\nroot = {store}\n"
        f"[supervisor]\nworkers = {workers}\nstate_dir = {work / 'state'}\n"
        f"[queue]\nclaim_batch = {claim_batch}\n"
        f"[derive]\nbackend = noop\n",
        encoding="utf-8",
    )
    log = work / f"derivd-{name}.log"
    ready, drain_s, wall, _cpu, _rss = burst_drain(ini, log, dsn)
    if ready != jobs:
        raise SystemExit(f"derivd left {jobs - ready} jobs unfinished; see {log}")
    label = "1 job/process" if claim_batch == 1 else f"claim_batch {claim_batch}/process"
    return Run("derivd", workers, label, jobs, drain_s, wall)


# --------------------------------------------------------------------------- peers


def peer(script: str, dsn: str, *args: str) -> dict[str, Any]:
    """Run bench/peers/SCRIPT in the peers' venv; the JSON object of its last line."""
    out = subprocess.run(
        [str(PEERS_PYTHON), str(BENCH / "peers" / script), "--dsn", dsn, *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"{script} {args[0]} failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run_peer(
    pg: EmbeddedCluster, system: str, jobs: int, processes: int, option: tuple[str, int]
) -> Run:
    script = f"{system}_drain.py"
    dsn = fresh_db(pg, f"{system}_{processes}", derivd_schema=False)
    peer(script, dsn, "seed", "--jobs", str(jobs))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    started = time.perf_counter()
    result = peer(script, dsn, "drain", "--processes", str(processes), option[0], str(option[1]))
    wall = time.perf_counter() - started
    if int(result["jobs"]) != jobs:
        raise SystemExit(f"{system} processed {result['jobs']} of {jobs} jobs")
    label = f"{option[0].lstrip('-')} {option[1]}/process"
    return Run(system, processes, label, jobs, result["end"] - result["start"], wall)


# --------------------------------------------------------------------------- report


def report(runs: list[Run]) -> str:
    # The peers are compared with derivd's best configuration at the same process count.
    derivd: dict[int, float] = {}
    for r in runs:
        if r.system == "derivd":
            derivd[r.processes] = max(derivd.get(r.processes, 0.0), r.rate)
    rows = []
    for r in runs:
        ratio = derivd.get(r.processes, 0.0) / r.rate if r.rate else 0.0
        rows.append(
            [
                r.system,
                r.processes,
                r.concurrency,
                r.jobs,
                r.drain_s,
                r.wall_s,
                round(r.rate),
                "-" if r.system == "derivd" else f"{ratio:.2f}x",
            ]
        )
    return table(
        [
            "system",
            "processes",
            "concurrency",
            "jobs",
            "drain s",
            "wall s",
            "jobs/s",
            "derivd / this",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--no-peers", action="store_true", help="derivd only")
    parser.add_argument(
        "--claim-batch",
        type=int,
        nargs="+",
        default=[1, 10, 50],
        help="derivd [queue] claim_batch values to run",
    )
    parser.add_argument(
        "--pgqueuer-batch",
        type=int,
        nargs="+",
        default=[10, 50],
        help="pgqueuer batch sizes to run (10 is the issue's reference)",
    )
    args = parser.parse_args()
    if not args.no_peers:
        ensure_peers_venv()
    runs: list[Run] = []
    with cluster() as pg, tempfile.TemporaryDirectory(prefix="derivd-bench-q-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        for n in args.workers:
            for batch in args.claim_batch:
                print(f"derivd, {n} workers, claim_batch {batch} ...", file=sys.stderr, flush=True)
                runs.append(run_derivd(pg, args.jobs, n, work, batch))
            if args.no_peers:
                continue
            for batch in args.pgqueuer_batch:
                print(f"pgqueuer, {n} processes, batch {batch} ...", file=sys.stderr, flush=True)
                runs.append(run_peer(pg, "pgqueuer", args.jobs, n, ("--batch", batch)))
            print(f"procrastinate, {n} processes ...", file=sys.stderr, flush=True)
            runs.append(run_peer(pg, "procrastinate", args.jobs, n, ("--concurrency", 10)))
        lines = machine(pg.dsn(), None if args.no_peers else str(PEERS_PYTHON))
    print("## queue")
    print("\n".join(lines))
    print(
        f"{args.jobs:,} no-op jobs per run, one embedded PostgreSQL (fsync on), a fresh "
        "database per run; pgqueuer: drain mode, asyncpg, no concurrency cap; "
        "procrastinate: wait=False, async task, listen_notify on; derivd: `derivd run "
        "--burst`, noop backend (no GET: noop measures the queue itself), listen = yes, "
        "default logging (info, one line per job); derivd / this: derivd's best row at "
        "the same process count"
    )
    print()
    print(report(runs))
    runs_out = [{**r.__dict__, "rate": r.rate} for r in runs]
    save_results("throughput", {"machine": lines, "jobs": args.jobs, "runs": runs_out})


if __name__ == "__main__":
    main()
