"""What the queue benchmarks share: one embedded PostgreSQL in a temp dir, fresh migrated
databases, the machine's description and plain-text tables."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import psycopg

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"  # machine-readable results (bench/plots.py draws from them)
DERIVD = Path(sys.executable).parent / "derivd"
BUILDS = ROOT / "bench" / ".builds"  # other commits' trees, each with its own venv
sys.path.insert(0, str(ROOT))

from derivd.embedded.pgcluster import EmbeddedCluster  # noqa: E402
from derivd.queue.db import migrate  # noqa: E402
from harness.tables import table  # noqa: E402, F401  (bench's scripts import it from here)


@contextmanager
def cluster(settings: dict[str, str] | None = None) -> Iterator[EmbeddedCluster]:
    """A private cluster for the whole benchmark (durable settings: fsync on, like
    production; TCP on loopback so the peers' drivers can reach it too)."""
    root = Path(tempfile.mkdtemp(prefix="derivd-bench-"))
    root.chmod(0o711)  # the server may run as `postgres`: it must traverse
    pg = EmbeddedCluster(root / "pgdata", listen_tcp=True, settings=settings)
    try:
        pg.start()
        yield pg
    finally:
        pg.stop("fast")
        shutil.rmtree(root, ignore_errors=True)


def fresh_db(pg: EmbeddedCluster, name: str, *, derivd_schema: bool = True) -> str:
    pg.drop_database(name)
    pg.create_database(name)
    dsn = pg.dsn(name)
    if derivd_schema:
        migrate(dsn)
    return dsn


def pgbench(pg: EmbeddedCluster, dsn: str, *args: str) -> None:
    """Run the cluster's own pgbench against `dsn`'s host, port and user (the database
    name is the caller's last argument); its output is not wanted, its failure is."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    argv = [str(pg.bindir / "pgbench"), "-h", str(info["host"]), "-p", str(pg.port),
            "-U", str(info["user"]), *args]  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True)


def median_run(
    runs: Sequence[tuple[float, ...]], key: Callable[[tuple[float, ...]], float]
) -> tuple[tuple[float, ...], float]:
    """The median of repeated runs by `key`, and the spread (stdev) of that key."""
    median = sorted(runs, key=key)[len(runs) // 2]
    return median, statistics.pstdev([key(r) for r in runs])


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(p / 100.0 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def _pip_version(python: str, package: str) -> str:
    try:
        out = subprocess.run(
            [python, "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError:
        return "-"
    return out.stdout.strip() or "-"


def machine(dsn: str, peers_python: str | None = None) -> list[str]:
    """nproc, memory, OS, Python, PostgreSQL, psycopg (and the peers' versions)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    server = row[0] if row else "?"
    mem_kb = 0
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    lines = [
        f"cpus: {os.cpu_count()}  memory: {mem_kb / 1024 / 1024:.1f} GiB  "
        f"os: {platform.platform()}",
        f"python {platform.python_version()}  postgresql {server}  psycopg {psycopg.__version__}",
    ]
    if peers_python:
        lines.append(
            f"peers: pgqueuer {_pip_version(peers_python, 'pgqueuer')}  "
            f"procrastinate {_pip_version(peers_python, 'procrastinate')}"
        )
    return lines


def machine_brief() -> list[str]:
    """The machine without a database to ask: cores, memory, OS, Python."""
    mem_kb = 0
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    return [
        f"cpus: {os.cpu_count()}  memory: {mem_kb / 1024 / 1024:.1f} GiB  "
        f"os: {platform.platform()}  python {platform.python_version()}"
    ]


def save_results(name: str, data: dict[str, object]) -> Path:
    """Write bench/out/<name>.json: what bench/plots.py draws and bench/results.py puts in
    RESULTS.md, with the command that produced it, the day and the machine. `figures`
    (markdown, optional) is shown as written; without it the lists of rows are tables."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    record: dict[str, object] = {
        "bench": name,
        "command": " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "when": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": machine_brief(),
        **data,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


class Measured(NamedTuple):
    """A command run to its end, as the kernel accounted for it."""

    wall_s: float  # start to exit
    cpu_s: float  # user + system of the process and every child it waited for
    peak_rss_mb: float  # the largest of those processes


# A small launcher between the benchmark and the measured command: a process's peak RSS
# starts at its parent's RSS at fork (the pages it shares until exec), so a command forked
# from this (large) benchmark process would report the benchmark's RSS as its own.
_LAUNCHER = """
import json, os, subprocess, sys, time
started = time.perf_counter()
with open(sys.argv[2], "w") as out:
    proc = subprocess.Popen(sys.argv[3:], stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
wall = time.perf_counter() - started
with open(sys.argv[1], "w") as result:
    json.dump([os.waitstatus_to_exitcode(status), wall, usage.ru_utime + usage.ru_stime,
               usage.ru_maxrss / 1024], result)
"""


def measured(argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> Measured:
    """Run `argv` (output to `log`) to its end; CalledProcessError when it fails."""
    result = log.with_name(log.name + ".usage.json")
    subprocess.run([sys.executable, "-c", _LAUNCHER, str(result), str(log), *argv], env=env,
                   check=True)  # fmt: skip
    code, wall, cpu, rss = json.loads(result.read_text())
    if code != 0:
        raise subprocess.CalledProcessError(code, list(argv))
    return Measured(wall, cpu, rss)


class Burst(NamedTuple):
    """One `derivd run --burst` to its end."""

    ready: int  # rows now `ready`
    drain_s: float  # first claim to last finish, as the database saw it
    wall_s: float  # the process's start to its exit: boot and shutdown included
    cpu_s: float  # user + system of the supervisor and its workers (not PostgreSQL's)
    peak_rss_mb: float  # the largest of those processes


def store_and_queue(dsn: str, store: Path, originals: Sequence[tuple[str, Path]]) -> None:
    """Each (key, file) put in the fs store at `store` and queued, then the table analysed:
    the untimed set-up of a `run --burst` benchmark."""
    from derivd.storage.fs import FsStorage

    storage = FsStorage(store)
    rows = [(key, storage.put(key, path.read_bytes(), "application/octet-stream"))
            for key, path in originals]  # fmt: skip
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO archive_files (status, original_key, original_version)"
                            " VALUES ('queued', %s, %s)", rows)  # fmt: skip
        conn.execute("VACUUM (ANALYZE) archive_files")


def compile_derivd() -> None:
    """Bytecode for derivd's modules, as an installed derivd has (pip compiles a wheel
    at install; `make install` does it for the editable tree): where the environment
    sets PYTHONDONTWRITEBYTECODE, a run would otherwise compile ~40 modules from
    source in the supervisor and again in every worker (~0.08 CPU s a `run --burst`)."""
    import compileall

    for tree in ROOT.joinpath("build").glob("__editable__.derivd-*"):
        compileall.compile_dir(tree, quiet=1)


def burst_drain(
    ini: Path, log: Path, dsn: str, env: dict[str, str] | None = None, derivd: Path = DERIVD
) -> Burst:
    """`derivd -c INI run --burst` to its end (output to `log`), measured as a whole;
    `derivd`: another build's (`built`)."""
    compile_derivd()
    run = measured([str(derivd), "-c", str(ini), "run", "--burst"], log, env)
    ready, first, last = drained(dsn)
    return Burst(ready, last - first, *run)


def drained(dsn: str) -> tuple[int, float, float]:
    """After a burst: (rows `ready`, the first claim, the last finish), the times as Unix
    seconds of the database's clock (0.0 when there was none)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'ready'),"
            "       coalesce(extract(epoch FROM min(claimed_at)), 0)::float8,"
            "       coalesce(extract(epoch FROM max(finished_at)), 0)::float8"
            "  FROM archive_files"
        ).fetchone()
    assert row is not None
    return int(row[0]), float(row[1]), float(row[2])


def git(*args: str) -> str:
    """`git -C ROOT ARGS...`'s output."""
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True
    ).stdout


def built(ref: str) -> Path:
    """The `derivd` of `ref`: its tree from git (bench/.builds/<commit>), with a venv of
    its own, made on first use (a benchmark's side-by-side build)."""
    commit = git("rev-parse", "--verify", f"{ref}^{{commit}}").strip()
    tree = BUILDS / commit[:12]
    derivd = tree / ".venv" / "bin" / "derivd"
    if derivd.exists():
        return derivd
    print(f"-- building {ref} ({commit[:12]}) in {tree}", file=sys.stderr, flush=True)
    tree.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "venv", str(tree / ".venv")], check=True)
    subprocess.run(
        [str(tree / ".venv" / "bin" / "pip"), "install", "-q", str(tree)], check=True, cwd=tree
    )
    return derivd
