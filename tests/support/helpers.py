"""Small helpers the test modules share: one SQL helper, one wait loop, one /proc reader.

Import them (`from helpers import sql, wait_for`) rather than writing another copy.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row

from derivd.osproc import children_of
from derivd.queue.db import QueueDB
from derivd.storage.base import Storage, new_original_key

T = TypeVar("T")


def enqueue_scripts(dsn: str, storage: Storage, scripts: Iterable[str]) -> list[int]:
    """Each fault handler's script (tests/support/faulthandlers.py) stored in `storage` as an
    original and queued in `dsn`, in order: their file ids."""
    originals = []
    for script in scripts:
        key = new_original_key()
        originals.append((key, storage.put(key, script.encode(), "text/plain")))
    with QueueDB.open(dsn, role="test") as queue:
        return queue.enqueue(originals)


def sql(dsn: str, query: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    """Run one statement on its own autocommit connection; its rows as dicts."""
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def wait_for(
    check: Callable[[], T | None],
    what: str,
    timeout: float = 60.0,
    *,
    detail: Callable[[], str] | None = None,
) -> T:
    """Poll `check` until it returns something truthy, and return that. The deadline
    only keeps a broken test from hanging (generous on purpose: the machine is shared);
    it asserts nothing about speed. At the deadline the test fails naming `what`, plus
    `detail()` (e.g. the daemon's log) when given."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            more = f"\n{detail()}" if detail is not None else ""
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}{more}")
        time.sleep(0.02)


def proc_title(pid: int) -> str:
    """The process title (/proc/PID/cmdline, which setproctitle rewrites); "" once gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def workers_waiting(supervisor_pid: int) -> bool:
    """Every worker of this supervisor has claimed, found nothing, and waits (its title
    says "idle" only then): from now on only a wake-up or the poll makes it claim."""
    titles = [proc_title(pid) for pid in children_of(supervisor_pid)]
    workers = [t for t in titles if t.startswith("derivd: worker")]
    return bool(workers) and all(t.endswith(" idle") for t in workers)


def listening(conn: psycopg.Connection[Any], channel: str) -> bool:
    """Some session of this database LISTENs on `channel`."""
    rows = conn.execute(
        "SELECT query FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    ).fetchall()
    return any(listens_on(str(r[0]), channel) for r in rows)


def listens_on(query: str, channel: str) -> bool:
    """Whether `query` (a session's statement in pg_stat_activity) LISTENs on `channel`,
    its name quoted (derivd composes it as an identifier) or not."""
    return f"LISTEN {channel}".upper() in query.replace('"', "").upper()


def stop_process(proc: subprocess.Popen[Any], timeout: float = 60.0) -> int:
    """SIGTERM a `derivd` process a test started (a graceful stop), SIGKILL it if it has
    not exited within `timeout`; its exit status (negative: killed by that signal)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


def chaos_run(module: str, *args: str, timeout: float) -> str:
    """Run one of the chaos runs (`python -m harness.chaos`, ...) to the end, from the
    repository's root; its output, once it has exited 0 and said that every invariant
    held."""
    run = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=Path(__file__).resolve().parents[2],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"failing checks: {failed_checks(run.stdout)}\n{output}"
    assert "RESULT: all invariants hold" in run.stdout, output
    return output


def failed_checks(output: str) -> list[str]:
    """The checks a chaos run's table (`| check | PASS/FAIL | detail |`) says failed."""
    cells = [line.split("|") for line in output.splitlines() if line.startswith("| ")]
    return [c[1].strip() for c in cells if len(c) > 3 and c[2].strip() == "FAIL"]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def role_dsn(dsn: str, role: str, password: str) -> str:
    """`dsn` as `role` (created once, superuser) with `password` in the DSN. The test
    cluster trusts local connections, so the password is not checked; it is in the DSN
    all the same, which is what redaction tests need."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
            conn.execute(
                pgsql.SQL("CREATE ROLE {} LOGIN SUPERUSER PASSWORD {}").format(
                    pgsql.Identifier(role), pgsql.Literal(password)
                )
            )
    params = conninfo_to_dict(dsn)
    params.update(user=role, password=password)
    return make_conninfo(**params)  # type: ignore[arg-type]
