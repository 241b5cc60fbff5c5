"""The server's instructions per job on the worker's hot path, counted, not timed: each
build's `commit_and_claim` (the commit of the last job, the claim of the next, as its
worker sends it, on its connection's settings) against its own schema, on a postmaster
run under valgrind's callgrind. Instruction counts repeat to a fraction of a percent
whatever else the machine does, where CPU time on a shared 2-core machine moves ±25 %
between rounds (bench/traffic.py --only drain): a change on the hot path is measured here
against the commit before it, and there as a whole daemon.

Each build gets a database built from its migrations and sql/functions.sql (from git; this
build: `derivd migrate`) with queued noop rows. One connection per count runs `--from`
jobs, another `--to` jobs; (Ir(to) - Ir(from)) / (to - from) is one job's cost, without
the connection's start and its first plans. `--clients` connections at once each (the
claims then skip each other's rows, as two workers do).

    .venv/bin/python bench/server_instructions.py [--refs 48206ad^ HEAD~1] [--from 100]
        [--to 700] [--clients 1]

Needs valgrind (`apt-get install valgrind`); without it, says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
from common import cluster, fresh_db, git, machine, save_results, table
from psycopg.rows import dict_row
from traffic import CLAIM_PARAMS, baseline_db

from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.embedded.pghome import RunAs
from derivd.queue.sqlfiles import parse_blocks, queries

# Every parameter any release's commit_and_claim names (traffic.py's, and the
# `write_ahead` of the releases before the claim took `prefix_format`); each takes the
# ones it uses.
PARAMS: dict[str, Any] = {**CLAIM_PARAMS, "write_ahead": False}
SEED = """
INSERT INTO archive_files (status, original_key, original_version)
SELECT 'queued', 'originals/bench', 'v1' FROM generate_series(1, %(n)s)
"""


class Build:
    """A build's database and the statements its worker sends."""

    def __init__(self, label: str, dsn: str, blocks: dict[str, str]) -> None:
        self.label = label
        self.dsn = dsn
        self.statement = blocks["commit_and_claim"]
        self.setup = blocks.get("generic_plans")  # a worker connection's own setting


def builds(pg: EmbeddedCluster, refs: list[str], rows: int) -> list[Build]:
    out = [
        Build(
            f"{ref} ({git('rev-parse', '--short', ref).strip()})",
            baseline_db(pg, f"instr_{n}", ref),
            parse_blocks(git("show", f"{ref}:sql/queries.sql")),
        )
        for n, ref in enumerate(refs)
    ]
    out.append(Build("this build", fresh_db(pg, "instr_this"), queries()))
    for b in out:
        with psycopg.connect(b.dsn, autocommit=True) as conn:
            conn.execute(SEED, {"n": rows})
            conn.execute("VACUUM (ANALYZE) archive_files")
    return out


def run_jobs(build: Build, jobs: int) -> int:
    """`jobs` commit + next claim on one new connection; its server process id."""
    with psycopg.connect(build.dsn, autocommit=True, row_factory=dict_row) as conn:
        if build.setup:
            conn.execute(build.setup)  # type: ignore[arg-type]
        held: list[dict[str, Any]] = []
        for _ in range(jobs):
            finished = [
                {"id": r["id"], "token": str(r["lease_token"]), "attempt": r["attempts"],
                 "derived_key": None, "variants": []}
                for r in held
            ]  # fmt: skip
            params = {**PARAMS, "jobs": json.dumps(finished)}
            rows = conn.execute(build.statement, params).fetchall()  # type: ignore[arg-type]
            held = [r for r in rows if r["kind"] == "claimed"]
            if not held:
                raise SystemExit(f"{build.label}: the claim found no row")
        return conn.info.backend_pid


def instructions(out: Path, pid: int) -> int:
    """A server process's total instructions, once callgrind has written them (at exit)."""
    path = out / f"callgrind.{pid}"
    for _ in range(1200):
        if path.exists():
            found = re.search(r"^totals: (\d+)", path.read_text(errors="replace"), re.M)
            if found:
                return int(found.group(1))
        time.sleep(0.1)
    raise SystemExit(f"callgrind wrote no totals for server process {pid}")


def as_server_user(argv: list[str]) -> list[str]:
    """`argv` run as the user the cluster's server runs as (`postgres` when we are root)."""
    who = RunAs.detect()
    return ["runuser", "-u", who.name, "--", *argv] if who.switch else argv


def under_callgrind(pg: EmbeddedCluster, out: Path) -> subprocess.Popen[bytes]:
    """The cluster's postmaster again, under callgrind (every backend it forks too)."""
    pg.stop("fast")
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/callgrind.%p",
            f"--log-file={out}/valgrind.log", str(pg.bindir / "postgres"), "-D",
            str(pg.data_dir), "-c", "autovacuum=off"]  # fmt: skip
    server = subprocess.Popen(as_server_user(argv), stdin=subprocess.DEVNULL)
    for _ in range(600):
        try:
            psycopg.connect(pg.dsn(), connect_timeout=2).close()
            return server
        except psycopg.OperationalError:
            time.sleep(0.2)
    raise SystemExit(f"the server did not start under valgrind: see {out}/valgrind.log")


def stop(pg: EmbeddedCluster, server: subprocess.Popen[bytes]) -> None:
    pg_ctl = [str(pg.bindir / "pg_ctl"), "-D", str(pg.data_dir), "stop", "-m", "fast"]
    subprocess.run(as_server_user(pg_ctl), check=True, capture_output=True)
    server.wait()


def per_job(build: Build, out: Path, lo: int, hi: int, clients: int) -> float:
    """Instructions of one job (thousands), from the difference of two counts."""
    totals = []
    for jobs in (lo, hi):
        with ThreadPoolExecutor(clients) as pool:
            pids = list(pool.map(run_jobs, [build] * clients, [jobs] * clients))
        totals.append(sum(instructions(out, pid) for pid in pids))
    return (totals[1] - totals[0]) / (hi - lo) / clients / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--refs", nargs="*", default=["48206ad^"])
    parser.add_argument("--from", dest="lo", type=int, default=100)
    parser.add_argument("--to", dest="hi", type=int, default=700)
    parser.add_argument("--clients", type=int, default=1)
    args = parser.parse_args()
    if not shutil.which("valgrind"):
        print("bench/server_instructions.py: valgrind is not installed", file=sys.stderr)
        raise SystemExit(2)
    rows = args.clients * (args.lo + args.hi + 50) + 100
    with cluster() as pg, tempfile.TemporaryDirectory(prefix="derivd-instr-") as tmp:
        out = Path(tmp)
        out.chmod(0o777)  # the server's user writes its counts here
        lines = machine(pg.dsn())
        measured = builds(pg, args.refs, rows)
        server = under_callgrind(pg, out)
        try:
            for b in measured:
                run_jobs(b, 20)  # this database's pages and catalogs read once
            result = {b.label: per_job(b, out, args.lo, args.hi, args.clients) for b in measured}
        finally:
            stop(pg, server)
            pg.start()
    first = next(iter(result.values()))
    print("## server instructions per job (bench/server_instructions.py)")
    print("\n".join(lines))
    print(
        f"commit + next claim as each build's worker sends it, noop (no variants), "
        f"{args.clients} client(s), jobs {args.lo} to {args.hi} on each connection"
    )
    print(
        table(
            ["build", "instructions per job (k)", f"vs {next(iter(result))}"],
            [
                [label, f"{k:,.1f}", f"{100 * (k / first - 1):+.1f} %"]
                for label, k in result.items()
            ],
        )
    )
    save_results(
        "server_instructions",
        {"machine": lines, "clients": args.clients, "jobs": [args.lo, args.hi], "kir": result},
    )


if __name__ == "__main__":
    main()
