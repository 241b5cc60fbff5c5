"""Production traffic, side by side in one run, on one private cluster:

1. live uploads' queue wait (p50/p99) during a backfill of `--backfill` re-derivations,
   the backfill below live uploads (priority -10) vs at their priority (no priorities);
2. a small tenant's wait (20 files) while another holds `--backfill` queued, shared
   (tenants) vs not (no tenant: one FIFO);
3. claim p50/p99 at `--queued` queued rows over `--tenants` tenants, without and with
   `[queue] max_in_flight_per_tenant`, and what the rank trigger costs an enqueue;
4. server CPU per job at defaults (commit + next claim in one statement, one client,
   prepared) on this build vs the baseline (`--baseline`, default main: its migrations
   and functions.sql, built from git), interleaved, median of `--repeat`;
5. (`--only drain`) whole daemons: `--drain-jobs` noop rows queued, then `derivd run
   --burst` with `--workers` workers at defaults (claim_batch 1); the CPU of every
   PostgreSQL process between the drain's first claim and its last commit, per job,
   with jobs/s and WAL per job. Each `--drain-refs` ref runs as its own build (its
   tree from git, its own venv under bench/.builds, its own `derivd migrate`), beside
   this build without tenants and with `--drain-tenants` tenants under a cap of
   `--drain-cap`; rounds interleaved, median of `--repeat`.

Scenarios 1 and 2 run the real daemon (`derivd run`, noop backend, `--workers`).

    .venv/bin/python bench/traffic.py [--backfill 100000] [--queued 1000000]
    .venv/bin/python bench/traffic.py --only drain [--drain-refs 48206ad^] [--repeat 5] \
        [--drain-pipelines 1]
    .venv/bin/python bench/traffic.py --only capped   # 6: a capped tenant's rows ahead
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from common import (
    DERIVD,
    built,
    cluster,
    fresh_db,
    git,
    machine,
    median_run,
    percentile,
    save_results,
    table,
)
from fleet import _times, load_average, server_cpu_s, wal_lsn

from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.queue.sqlfiles import query

LIVE_RATE = 10  # live uploads per second while a backfill drains
LIVE_SECONDS = 15.0
SMALL = 20  # the small tenant's files
# How long the measured files may wait before the run stops (the machine is shared: a
# FIFO of 100,000 may take longer to drain than the session has; their waits are then
# censored, i.e. reported as at least this long).
CAP_S = 150.0

SEED_READY_AND_JOBS = """
WITH files AS (
    INSERT INTO archive_files (status, original_key, original_version, finished_at,
                               derived_key, derived_version, sha256, width, height)
    SELECT 'ready', 'originals/bench', 'v1', now(), 'derived/x', '1', repeat('0', 64), 1, 1
      FROM generate_series(1, %(n)s)
    RETURNING id
)
INSERT INTO derivd_rederivations (file_id, original_key, original_version, priority)
SELECT id, 'originals/bench', 'v1', %(priority)s FROM files
"""
SEED_TENANT = """
INSERT INTO archive_files (status, original_key, original_version, tenant, fair_rank)
SELECT 'queued', 'originals/bench', 'v1', %(tenant)s, g FROM generate_series(1, %(n)s) AS g
"""
# Round robin over the tenants, as the rank trigger gives it when they all enqueue.
SEED_MANY_TENANTS = """
INSERT INTO archive_files (status, original_key, original_version, tenant, fair_rank)
SELECT 'queued', 'originals/bench', 'v1', 't' || (g %% %(tenants)s), g / %(tenants)s
  FROM generate_series(1, %(n)s) AS g
"""
LIVE = (
    "INSERT INTO archive_files (status, original_key, original_version, priority, tenant)"
    " VALUES ('queued', 'originals/live', 'v1', 0, %(tenant)s) RETURNING id"
)
# A file not claimed yet has waited until now (censored); `before`: the jobs finished
# while it waited (from the events: a re-derivation's row is gone once committed).
WAITS = """
SELECT extract(epoch FROM coalesce(claimed_at, now()) - created_at)::float8 AS wait_s,
       (SELECT count(*) FROM archive_events AS e
         WHERE e.kind = 'ready' AND e.at > f.created_at
           AND e.at < coalesce(f.claimed_at, now()))::int AS before,
       claimed_at IS NULL AS censored
  FROM archive_files AS f WHERE f.id = ANY(%(ids)s)
"""


# -- 1 and 2: the daemon drains while others arrive ---------------------------------------


@contextmanager
def daemon(dsn: str, work: Path, workers: int) -> Iterator[None]:
    ini = work / "traffic.ini"
    ini.write_text(
        f"[database]\ndsn = {dsn}\n[storage]\nbackend = fs\nroot = {work / 'objects'}\n"
        f"[supervisor]\nworkers = {workers}\nstate_dir = {work / 'state'}\n"
        "[derive]\nbackend = noop\n[logging]\nlevel = warning\n",
        encoding="utf-8",
    )
    proc = subprocess.Popen(
        [str(DERIVD), "-c", str(ini), "run"],
        stdin=subprocess.DEVNULL,
        stdout=(work / "traffic.log").open("a"),
        stderr=subprocess.STDOUT,
    )
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def _until_done(dsn: str, ids: list[int], timeout: float = CAP_S) -> None:
    """Until every file in `ids` was claimed, or `timeout` (then their waits are censored)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM archive_files WHERE id = ANY(%s) AND claimed_at IS NULL",
                (ids,),
            ).fetchone()
            if row is not None and row[0] == 0:
                return
            time.sleep(0.5)


def _waits(dsn: str, ids: list[int]) -> tuple[list[float], list[int], int]:
    """Waits (s), claims made meanwhile, and how many were still waiting (censored)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(WAITS, {"ids": ids}).fetchall()
    return [float(r[0]) for r in rows], [int(r[1]) for r in rows], sum(bool(r[2]) for r in rows)


def _rate(dsn: str) -> float:
    """Jobs per second the daemon finished (its `ready` events, first to last)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) / greatest(extract(epoch FROM max(at) - min(at)), 0.001)"
            " FROM archive_events WHERE kind IN ('ready', 'rederived')"
        ).fetchone()
    return float(row[0]) if row else 0.0


def live_during_backfill(
    pg: EmbeddedCluster, work: Path, n: int, workers: int, priority: int
) -> dict[str, Any]:
    dsn = fresh_db(pg, "traffic_live")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SEED_READY_AND_JOBS, {"n": n, "priority": priority})
        conn.execute("VACUUM (ANALYZE) archive_files")
    live: list[int] = []
    with daemon(dsn, work, workers), psycopg.connect(dsn, autocommit=True) as conn:
        time.sleep(2.0)  # the backfill is under way
        started = time.monotonic()
        while time.monotonic() - started < LIVE_SECONDS:
            row = conn.execute(LIVE, {"tenant": None}).fetchone()
            assert row is not None
            live.append(int(row[0]))
            time.sleep(1 / LIVE_RATE)
        _until_done(dsn, live)
        waits, before, censored = _waits(dsn, live)
    return {
        "priority": priority,
        "live": len(live),
        "p50_s": percentile(waits, 50),
        "p99_s": percentile(waits, 99),
        "claims_before_p50": percentile(before, 50),
        "jobs_per_s": _rate(dsn),
        "censored": censored,
    }


def small_tenant(
    pg: EmbeddedCluster, work: Path, n: int, workers: int, shared: bool
) -> dict[str, Any]:
    dsn = fresh_db(pg, "traffic_tenant")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SEED_TENANT, {"n": n, "tenant": "big" if shared else None})
        conn.execute("VACUUM (ANALYZE) archive_files")
    with daemon(dsn, work, workers), psycopg.connect(dsn, autocommit=True) as conn:
        time.sleep(2.0)  # the big tenant's queue is under way
        small = [
            int(conn.execute(LIVE, {"tenant": "small" if shared else None}).fetchone()[0])  # type: ignore[index]
            for _ in range(SMALL)
        ]
        _until_done(dsn, small)
        waits, before, censored = _waits(dsn, small)
    return {
        "shared": shared,
        "p50_s": percentile(waits, 50),
        "max_s": max(waits),
        "claims_before_last": max(before),
        "jobs_per_s": _rate(dsn),
        "censored": censored,
    }


# -- 3: the claim at scale ------------------------------------------------------------------


def _claims(dsn: str, claims: int, statement: str) -> list[float]:
    """ms per claim (one client, prepared), each claimed row committed right after."""
    times: list[float] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(claims):
            t0 = time.perf_counter()
            rows = conn.execute(statement, prepare=True).fetchall()  # type: ignore[arg-type]
            times.append((time.perf_counter() - t0) * 1000)
            jobs = json.dumps([{"id": r[0], "token": str(r[1]), "attempt": r[2]} for r in rows])
            conn.execute("SELECT * FROM derivd_commit(%s::jsonb)", (jobs,), prepare=True)
    return times


# The claims of the data sets below are interleaved in blocks of this many: on a shared
# machine the load moves within a minute, and a p99 measured for one build after the
# other compares two loads, not two builds (the first runs of this table: 12.7 ms with
# tenants vs 1.36 ms for the baseline, measured minutes apart; interleaved, the three
# p99s are within noise of each other). bench/RESULTS.md, "Priorities, tenants and
# backfill", says more.
BLOCK = 100


# The product's `claim` statement (sql/queries.sql): no WAL flush wait for a claim alone.
CLAIM = {
    label: "SELECT c.* FROM set_config('synchronous_commit', 'off', true) AS no_flush_wait,"
    f" derivd_claim(1, 120, 3, 'b'{args}) AS c"
    for label, args in (("baseline", ""), (0, ", 0, NULL"), (10, ", 10, NULL"))
}


def _seeded(dsn: str, seed: str, params: dict[str, int]) -> float:
    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(seed, params)  # type: ignore[arg-type]
        conn.execute("VACUUM (ANALYZE) archive_files")
        conn.execute("CHECKPOINT")  # the seed's writes are not flushed during the claims
    return time.perf_counter() - started


def claim_at_scale(
    pg: EmbeddedCluster, baseline: str, n: int, tenants: int, claims: int
) -> list[dict[str, Any]]:
    """Claim p50/p99 at `n` queued rows: this build over `tenants` tenants (without and
    with a tenant cap), this build without tenants, and the baseline (it has none),
    interleaved in blocks of BLOCK claims."""
    tenanted = fresh_db(pg, "traffic_scale")
    plain = fresh_db(pg, "traffic_scale_plain")
    base = baseline_db(pg, "traffic_scale_base", baseline)
    runs = [
        (0, tenanted, CLAIM[0], _seeded(tenanted, SEED_MANY_TENANTS, {"n": n, "tenants": tenants})),
        (10, tenanted, CLAIM[10], 0.0),
        ("no tenant", plain, CLAIM[0], _seeded(plain, SEED_QUEUED, {"n": n})),
        ("baseline", base, CLAIM["baseline"], _seeded(base, SEED_QUEUED, {"n": n})),
    ]
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(claims // BLOCK):
        for (_, dsn, statement, _), measured in zip(runs, times, strict=True):
            measured += _claims(dsn, BLOCK, statement)
    return [
        {
            "cap": cap,
            "p50_ms": percentile(measured, 50),
            "p99_ms": percentile(measured, 99),
            "seed_s": seeded,
        }
        for (cap, _, _, seeded), measured in zip(runs, times, strict=True)
    ]


def enqueue_cost(pg: EmbeddedCluster, baseline: str, n: int) -> dict[str, float]:
    """Server CPU per single-row enqueue (client_enqueue), this build vs the baseline,
    onto 100,000 queued rows of 1,000 tenants (the rank trigger's two descents)."""
    out = {}
    for label, dsn in (
        ("this build", fresh_db(pg, "traffic_enq")),
        ("baseline", baseline_db(pg, "traffic_enq_base", baseline)),
    ):
        with psycopg.connect(dsn, autocommit=True) as conn:
            tenant_col = label == "this build"
            seed = (
                SEED_MANY_TENANTS
                if tenant_col
                else (
                    "INSERT INTO archive_files (status, original_key, original_version)"
                    " SELECT 'queued', 'originals/bench', 'v1' FROM generate_series(1, %(n)s)"
                )
            )
            conn.execute(seed, {"n": 100_000, "tenants": 1000})
            conn.execute("VACUUM (ANALYZE) archive_files")
            stmt = (
                "INSERT INTO archive_files (status, original_key, original_version, tenant)"
                " VALUES ('queued', 'k', 'v', %(t)s)"
                if tenant_col
                else "INSERT INTO archive_files (status, original_key, original_version)"
                " VALUES ('queued', 'k', 'v')"
            )
            for i in range(200):
                conn.execute(stmt, {"t": f"t{i % 1000}"}, prepare=True)  # type: ignore[arg-type]
            cpu = server_cpu_s(pg)
            for i in range(n):
                conn.execute(stmt, {"t": f"t{i % 1000}"}, prepare=True)  # type: ignore[arg-type]
            out[label] = (server_cpu_s(pg) - cpu) * 1000 / n
    return out


# -- 4: server CPU per job, this build vs the baseline --------------------------------------


def baseline_db(pg: EmbeddedCluster, name: str, ref: str) -> str:
    """A database built from `ref`'s migrations and functions.sql (read from git)."""
    dsn = fresh_db(pg, name, derivd_schema=False)
    names = sorted(git("ls-tree", "--name-only", ref, "sql/migrations/").split())
    with psycopg.connect(dsn) as conn:
        for path in names:
            if path.endswith(".sql"):
                conn.execute(git("show", f"{ref}:{path}"))  # type: ignore[arg-type]
        # Before functions.sql the migrations held every body.
        if "sql/functions.sql" in git("ls-tree", "--name-only", ref, "sql/").split():
            conn.execute(git("show", f"{ref}:sql/functions.sql"))  # type: ignore[arg-type]
    return dsn


# Each as its worker sends it: this build's statement composes the commit and the claim
# itself (sql/queries.sql); the baseline's called its one function.
COMMIT_AND_CLAIM = {
    "this build": query("commit_and_claim"),
    "baseline": "SELECT * FROM derivd_commit_and_claim(%(jobs)s::jsonb, 1, 120, 3, 'b')",
}
CLAIM_PARAMS = {"limit": 1, "lease_s": 120.0, "max_attempts": 3, "host": "b", "tenant_cap": 0,
                "prefix_format": None}  # fmt: skip
SEED_QUEUED = """
INSERT INTO archive_files (status, original_key, original_version)
SELECT 'queued', 'originals/bench', 'v1' FROM generate_series(1, %(n)s)
"""


def cpu_per_job(pg: EmbeddedCluster, label: str, baseline: str, jobs: int) -> tuple[float, float]:
    """(server CPU ms, backend CPU ms) per job: one client, commit + next claim, prepared."""
    dsn = (
        fresh_db(pg, "traffic_cpu")
        if label == "this build"
        else baseline_db(pg, "traffic_cpu_base", baseline)
    )
    statement = COMMIT_AND_CLAIM[label]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SEED_QUEUED, {"n": jobs + 400})
        conn.execute("VACUUM (ANALYZE) archive_files")
        conn.execute("CHECKPOINT")
        held: list[tuple[Any, ...]] = []

        def one() -> None:
            jobs_json = json.dumps(
                [{"id": r[1], "token": str(r[2]), "attempt": r[3], "variants": []} for r in held]
            )
            params = {**CLAIM_PARAMS, "jobs": jobs_json}
            rows = conn.execute(statement, params, prepare=True).fetchall()  # type: ignore[arg-type]
            held[:] = [r for r in rows if r[0] == "claimed"]

        for _ in range(200):
            one()
        pid = conn.info.backend_pid
        server, (user, system, _, _) = server_cpu_s(pg), _times(pid)
        for _ in range(jobs):
            one()
        user2, system2, _, _ = _times(pid)
        server2 = server_cpu_s(pg)
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    return (server2 - server) * 1000 / jobs, (user2 - user + system2 - system) * tick_ms / jobs


# -- 5: the drain, whole daemons: server CPU per job -------------------------------------

DRAIN_SEED = """
INSERT INTO archive_files (status, original_key, original_version)
SELECT 'queued', 'originals/bench', 'v1' FROM generate_series(1, %(n)s)
"""
# One row per INSERT would be slow; the rank trigger runs per row either way.
DRAIN_SEED_TENANTS = """
INSERT INTO archive_files (status, original_key, original_version, tenant)
SELECT 'queued', 'originals/bench', 'v1', 't' || (g %% %(tenants)s)
  FROM generate_series(1, %(n)s) AS g
"""


class CpuSampler:
    """The server's CPU seconds (every PostgreSQL process) sampled every 20 ms with the
    wall clock, from /proc: no query, so sampling costs the server nothing."""

    def __init__(self, pg: EmbeddedCluster) -> None:
        self.pg = pg
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), server_cpu_s(self.pg)))
            self._stop.wait(0.02)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, when: float) -> float:
        """CPU seconds at `when` (linear between the samples around it)."""
        for (t0, c0), (t1, c1) in zip(self.samples, self.samples[1:], strict=False):
            if t0 <= when <= t1:
                return c0 + (c1 - c0) * (when - t0) / max(t1 - t0, 1e-9)
        raise ValueError("outside the sampled window")


def drain_once(
    pg: EmbeddedCluster,
    work: Path,
    derivd: Path,
    jobs: int,
    workers: int,
    tenants: int,
    cap: int,
    pipeline: int | None = None,
) -> dict[str, float]:
    """One `derivd run --burst` over `jobs` queued noop rows on a fresh database that
    `derivd` migrated itself (`pipeline`: that [supervisor] pipeline, else the build's
    default; a build before it refuses the key)."""
    dsn = fresh_db(pg, "traffic_drain", derivd_schema=False)
    ini = work / "drain.ini"
    ini.write_text(
        f"[database]\ndsn = {dsn}\n[storage]\nbackend = fs\nroot = {work / 'objects'}\n"
        f"[supervisor]\nworkers = {workers}\nstate_dir = {work / 'state'}\n"
        + (f"pipeline = {pipeline}\n" if pipeline else "")
        + "[derive]\nbackend = noop\n[logging]\nlevel = warning\n"
        + (f"[queue]\nmax_in_flight_per_tenant = {cap}\n" if cap else ""),
        encoding="utf-8",
    )
    log = (work / "drain.log").open("a")
    subprocess.run([str(derivd), "-c", str(ini), "migrate"], check=True, stdout=log, stderr=log)
    with psycopg.connect(dsn, autocommit=True) as conn:
        if tenants:
            conn.execute(DRAIN_SEED_TENANTS, {"n": jobs, "tenants": tenants})
        else:
            conn.execute(DRAIN_SEED, {"n": jobs})
        conn.execute("VACUUM (ANALYZE) archive_files")
        conn.execute("CHECKPOINT")
    lsn = wal_lsn(dsn)
    with CpuSampler(pg) as cpu:
        subprocess.run([str(derivd), "-c", str(ini), "run", "--burst"], check=True,
                       stdin=subprocess.DEVNULL, stdout=log, stderr=log)  # fmt: skip
    wal = wal_lsn(dsn) - lsn
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'ready'),"
            " extract(epoch FROM min(claimed_at))::float8,"
            " extract(epoch FROM max(finished_at))::float8 FROM archive_files"
        ).fetchone()
    assert row is not None
    ready, first, last = int(row[0]), float(row[1]), float(row[2])
    if ready != jobs:
        raise SystemExit(f"{derivd}: {jobs - ready} of {jobs} rows not ready")
    return {
        "server_ms": (cpu.at(last) - cpu.at(first)) * 1000 / jobs,
        "jobs_per_s": jobs / (last - first),
        "wal_b": wal / jobs,
    }


def drain(args: argparse.Namespace) -> None:
    """Scenario 5 alone: its table, and bench/out/traffic-drain.json."""
    builds: list[tuple[str, Path, int, int, int | None]] = [
        (f"{ref} ({git('rev-parse', '--short', ref).strip()})", built(ref), 0, 0, None)
        for ref in args.drain_refs
    ]
    builds += [
        ("this build, no tenants, no cap", DERIVD, 0, 0, None),
        (f"this build, {args.drain_tenants} tenants, cap {args.drain_cap}", DERIVD,
         args.drain_tenants, args.drain_cap, None),
    ]  # fmt: skip
    builds += [
        (f"this build, pipeline {depth}, no tenants", DERIVD, 0, 0, depth)
        for depth in args.drain_pipelines
    ]
    load = [load_average()]
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, *_ in builds}
    with cluster() as pg, tempfile.TemporaryDirectory(prefix="derivd-drain-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        for n in range(args.repeat):
            # Each round in another order: no build always runs right after another.
            for label, derivd, tenants, cap, depth in (
                builds[n % len(builds) :] + builds[: n % len(builds)]
            ):
                _step(f"drain, {label}, run {n + 1}")
                runs[label].append(
                    drain_once(pg, work, derivd, args.drain_jobs, args.workers, tenants, cap, depth)
                )
        lines = machine(pg.dsn())
    load.append(load_average())
    result = {
        label: {key: statistics.median(r[key] for r in measured) for key in measured[0]}
        | {"server_ms_runs": [r["server_ms"] for r in measured]}
        for label, measured in runs.items()
    }
    base = result[builds[0][0]]["server_ms"]
    print("## traffic: the drain (bench/traffic.py --only drain)")
    print("\n".join(lines))
    print(f"load average before / after: {load[0]} / {load[1]}")
    print(
        f"{args.drain_jobs:,} noop jobs queued, then `derivd run --burst`, {args.workers} "
        f"workers, claim_batch 1, defaults otherwise; CPU of every PostgreSQL process "
        f"from the first claim to the last commit; median of {args.repeat} interleaved rounds"
    )
    print(
        table(
            [
                "build",
                "server CPU ms/job",
                f"vs {builds[0][0]}",
                "runs (ms/job)",
                "jobs/s",
                "WAL B/job",
            ],
            [
                [
                    label,
                    r["server_ms"],
                    f"{(r['server_ms'] / base - 1) * 100:+.1f} %",
                    " ".join(f"{x:.3f}" for x in r["server_ms_runs"]),
                    r["jobs_per_s"],
                    r["wal_b"],
                ]
                for label, r in result.items()
            ],
        )
    )
    save_results("traffic-drain", {"machine": lines, "load": load, "drain": result})


# -- 6: the capped claim with a tenant at its cap ahead --------------------------------------

CAPPED_AHEAD = (
    "INSERT INTO archive_files (status, original_key, original_version, priority, tenant)"
    " SELECT 'queued', 'k', 'v', %(priority)s, %(tenant)s || CASE WHEN %(tenant)s = 'A'"
    " THEN '' ELSE g::text END FROM generate_series(1, %(n)s) AS g"
)


def capped_ahead(args: argparse.Namespace) -> None:
    """Scenario 6 alone: tenant A holds 1 in flight at cap 1 with N more rows queued at
    priority 10, 400 one-row tenants wait at priority 0; each claim must pass A's rows."""
    from derivd.queue.db import Finished, QueueDB

    rows = []
    with cluster() as pg:
        for n in (0, 1000, 10_000, 100_000):
            dsn = fresh_db(pg, f"traffic_capped_{n}")
            with QueueDB.open(dsn) as queue, psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(CAPPED_AHEAD, {"priority": 10, "tenant": "A", "n": 1})
                queue.claim_many(limit=1, lease_s=600, max_attempts=3, tenant_cap=1)
                conn.execute(CAPPED_AHEAD, {"priority": 10, "tenant": "A", "n": n})
                conn.execute(CAPPED_AHEAD, {"priority": 0, "tenant": "B", "n": 400})
                conn.execute("VACUUM (ANALYZE) archive_files")
                ms = []
                for _ in range(300):
                    t0 = time.perf_counter()
                    [job] = queue.claim_many(limit=1, lease_s=600, max_attempts=3, tenant_cap=1)
                    ms.append((time.perf_counter() - t0) * 1000)
                    queue.commit_many([Finished(job, [])])
            rows.append([n, percentile(ms, 50), percentile(ms, 90)])
        lines = machine(pg.dsn())
    print("## traffic: the capped claim with a tenant at its cap ahead (--only capped)")
    print("\n".join(lines))
    print(f"load average: {load_average()}; 300 claims per row, each committed")
    print(table(["A's rows ahead", "claim p50 ms", "claim p90 ms"], rows))


# -- the run ----------------------------------------------------------------------------------


def _step(what: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {what} ...", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backfill", type=int, default=100_000)
    parser.add_argument("--queued", type=int, default=1_000_000)
    parser.add_argument("--tenants", type=int, default=10_000)
    parser.add_argument("--claims", type=int, default=5000)
    parser.add_argument("--jobs", type=int, default=3000, help="per CPU run")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--baseline", default="7f664ba^2", help="git ref of the build before priorities and tenants"
    )
    parser.add_argument("--only", choices=["drain", "capped"], help="run this scenario alone")
    parser.add_argument("--drain-jobs", type=int, default=5000)
    parser.add_argument("--drain-refs", nargs="*", default=["48206ad^"])
    parser.add_argument("--drain-tenants", type=int, default=10)
    parser.add_argument("--drain-cap", type=int, default=2)
    parser.add_argument(
        "--drain-pipelines",
        type=int,
        nargs="*",
        default=[],
        help="also this build at these [supervisor] pipeline depths (no tenants)",
    )
    args = parser.parse_args()
    if args.only == "drain":
        drain(args)
        return
    if args.only == "capped":
        capped_ahead(args)
        return
    uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    load = [load_average()]
    result: dict[str, Any] = {}
    with cluster() as pg, tempfile.TemporaryDirectory(prefix="derivd-traffic-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        cpu: dict[str, list[tuple[float, float]]] = {"this build": [], "baseline": []}
        for n in range(args.repeat):
            for label in cpu:
                _step(f"cpu per job, {label}, run {n + 1}")
                cpu[label].append(cpu_per_job(pg, label, args.baseline, args.jobs))
        result["cpu"] = {label: median_run(runs, key=lambda r: r[0]) for label, runs in cpu.items()}
        _step("enqueue cost")
        result["enqueue_ms"] = enqueue_cost(pg, args.baseline, 2000)
        _step(f"claim at {args.queued:,} queued over {args.tenants:,} tenants")
        result["scale"] = claim_at_scale(pg, args.baseline, args.queued, args.tenants, args.claims)
        result["live"] = []
        for priority in (-10, 0):
            _step(f"live uploads during a backfill at priority {priority}")
            result["live"].append(
                live_during_backfill(pg, work, args.backfill, args.workers, priority)
            )
        result["tenant"] = []
        for shared in (True, False):
            _step(f"small tenant, shared = {shared}")
            result["tenant"].append(small_tenant(pg, work, args.backfill, args.workers, shared))
        lines = machine(pg.dsn())
    uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    load.append(load_average())
    report(args, lines, uptime, result)
    save_results(
        "traffic",
        {
            "machine": lines,
            "uptime": uptime,
            "load": load,
            **{
                "cpu": {
                    k: {"server_ms": v[0][0], "backend_ms": v[0][1], "stdev": v[1]}
                    for k, v in result["cpu"].items()
                },
                "enqueue_ms": result["enqueue_ms"],
                "scale": result["scale"],
                "live": result["live"],
                "tenant": result["tenant"],
            },
        },
    )


def report(
    args: argparse.Namespace, lines: list[str], uptime: list[str], result: dict[str, Any]
) -> None:
    print("## traffic (bench/traffic.py)")
    print("\n".join(lines))
    print(f"uptime before: {uptime[0]}\nuptime after:  {uptime[1]}")
    print(
        f"\n### 1. live uploads ({LIVE_RATE}/s for {LIVE_SECONDS:g} s) during a backfill "
        f"of {args.backfill:,}, {args.workers} workers"
    )
    print(
        table(
            [
                "backfill priority",
                "live uploads",
                "wait p50 s",
                "wait p99 s",
                "claims before (p50)",
                "jobs/s",
                f"still waiting at {CAP_S:g} s",
            ],
            [
                [
                    ("-10 (below live)" if r["priority"] < 0 else "0 (no priorities)"),
                    r["live"],
                    r["p50_s"],
                    r["p99_s"],
                    r["claims_before_p50"],
                    r["jobs_per_s"],
                    r["censored"],
                ]
                for r in result["live"]
            ],
        )
    )
    print(f"\n### 2. a small tenant ({SMALL} files) while another holds {args.backfill:,}")
    print(
        table(
            [
                "claims",
                "wait p50 s",
                "wait max s",
                "claims before its last",
                "jobs/s",
                f"still waiting at {CAP_S:g} s",
            ],
            [
                [
                    ("shared (tenants)" if r["shared"] else "one FIFO (no tenant)"),
                    r["p50_s"],
                    r["max_s"],
                    r["claims_before_last"],
                    r["jobs_per_s"],
                    r["censored"],
                ]
                for r in result["tenant"]
            ],
        )
    )
    print(
        f"\n### 3. claim at {args.queued:,} queued rows over {args.tenants:,} tenants "
        f"({args.claims:,} claims + commits, one client)"
    )
    print(
        table(
            ["data set / max_in_flight_per_tenant", "claim p50 ms", "claim p99 ms", "seed s"],
            [[r["cap"], r["p50_ms"], r["p99_ms"], r["seed_s"]] for r in result["scale"]],
        )
    )
    print(
        "\n### 4. server CPU per job at defaults (commit + next claim, one client, prepared), "
        f"median of {args.repeat}"
    )
    base = result["cpu"]["baseline"][0][0]
    print(
        table(
            ["build", "server CPU ms/job", "backend CPU ms/job", "vs baseline", "stdev"],
            [
                [k, v[0][0], v[0][1], f"{(v[0][0] / base - 1) * 100:+.1f} %", v[1]]
                for k, v in result["cpu"].items()
            ],
        )
    )
    enq = result["enqueue_ms"]
    print(
        f"\nserver CPU per single-row enqueue: this build {enq['this build']:.3f} ms, "
        f"baseline {enq['baseline']:.3f} ms"
    )


if __name__ == "__main__":
    main()
