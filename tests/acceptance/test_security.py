"""Security checks on the database and a running derivd: a closed set of error codes in
the database, and no credential in logs, events, rows, process titles or connection
names. Parameterised SQL only: tests/unit/test_sql_safety.py; no way out of the fs
store: tests/unit/test_fs_store.py."""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from fixtures.cli import derivd_command
from fixtures.s3 import TEST_ACCESS_KEY, TEST_REGION, TEST_SECRET_KEY, MotoServer
from helpers import proc_title, role_dsn, stop_process
from PIL import Image

from derivd.osproc import children_of
from derivd.storage.fs import FsStorage

RunCli = Callable[..., subprocess.CompletedProcess[str]]
ORIGINAL_KEY = r"^originals/[0-9a-f]{32}$"


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 40), (200, 30, 30)).save(buffer, "PNG")
    return buffer.getvalue()


# --------------------------------------------------------------------------- keys


def test_storage_keys_never_come_from_file_names(
    run_cli: RunCli, dsn: str, fs_root: Path, tmp_path: Path
) -> None:
    """`derivd enqueue` (the command line's upload API) with hostile names: a traversal
    and shell/control characters. Keys in the database are generated, and nothing is
    written outside the store."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    passwd = tmp_path / "etc" / "passwd.jpg"
    passwd.write_bytes(_png())
    odd = tmp_path / "odd\n\t'\"$(touch pwned);`id`\\ ü%00..;.jpg"
    odd.write_bytes(b"not an image")
    before = {p for p in tmp_path.rglob("*") if fs_root not in p.parents}
    env = {
        "DERIVD_DATABASE_DSN": dsn,
        "DERIVD_STORAGE_BACKEND": "fs",
        "DERIVD_STORAGE_ROOT": str(fs_root),
    }
    result = run_cli("enqueue", "a/b/../../etc/passwd.jpg", str(odd), "-q", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) == 2

    with psycopg.connect(dsn) as conn:
        keys = [r[0] for r in conn.execute("SELECT original_key FROM archive_files")]
        assert len(keys) == 2
        bad = conn.execute(
            "SELECT original_key FROM archive_files WHERE original_key !~ %s", (ORIGINAL_KEY,)
        ).fetchall()
    assert bad == [], bad
    # Only generated keys exist in the store, and nothing appeared outside it.
    assert sorted(FsStorage(fs_root).list_keys()) == sorted(keys)
    after = {p for p in tmp_path.rglob("*") if fs_root not in p.parents and p != fs_root}
    assert after - before <= {fs_root}, after - before
    assert passwd.read_bytes() == _png()


# --------------------------------------------------------------------------- SQL


def _is_composed(node: ast.expr, own: str = "") -> bool:
    """psycopg.sql composition: sql.SQL("literal").format(sql.Identifier(...), ...);
    `own` is the variable being built, which may be composed further."""
    if isinstance(node, ast.Name):
        return bool(own) and node.id == own
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "format":
            return _is_composed(node.func.value, own) and all(
                _is_identifier(a) or _is_composed(a, own) for a in node.args
            )
        if node.func.attr == "SQL" and isinstance(node.func.value, ast.Name):
            return node.func.value.id == "sql" and isinstance(node.args[0], ast.Constant)
    return False


def _is_identifier(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("Identifier", "Literal")
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "sql"
    )


def _is_plain_literal(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def test_events_table_enforces_closed_kinds_and_error_codes(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO archive_events (file_id, kind, error_code) "
            "VALUES (1, 'rejected', 'corrupt_content')"
        )  # the closed set itself is accepted
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(
                "INSERT INTO archive_events (file_id, kind, error_code) "
                "VALUES (1, 'rejected', 'Traceback: oops')"
            )
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("INSERT INTO archive_events (file_id, kind) VALUES (1, 'whatever')")
        with pytest.raises(psycopg.errors.RaiseException):
            conn.execute("UPDATE archive_events SET error_code = NULL")


# --------------------------------------------------------------------------- credentials

DB_PASSWORD = "derivd-sec-db-password-do-not-show"
UNMASKED_PASSWORD = re.compile(r"password\s*=\s*(?!\*\*\*)[^\s'\"]", re.IGNORECASE)
SEC_ROLE = "derivd_security_test"


@pytest.fixture
def password_dsn(dsn: str) -> str:
    return role_dsn(dsn, SEC_ROLE, DB_PASSWORD)


@pytest.mark.acceptance
def test_credentials_never_reach_logs_events_rows_or_process_titles(
    password_dsn: str, s3_server: MotoServer, s3_bucket: str, tmp_path: Path
) -> None:
    secrets = (DB_PASSWORD, TEST_SECRET_KEY)
    ini = tmp_path / "derivd.ini"
    ini.write_text(  # the DSN with its password in the file, the S3 secret in the env
        f"[database]\ndsn = {password_dsn}\n"
        f"[storage]\nbackend = s3\nbucket = {s3_bucket}\n"
        f"endpoint_url = {s3_server.endpoint_url}\nregion = {TEST_REGION}\n"
        f"[supervisor]\nworkers = 2\nstate_dir = {tmp_path / 'state'}\n"
        "[queue]\npoll_interval = 0.2\n[derive]\nbackend = pillow\n"
    )
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": TEST_SECRET_KEY}
    assert env["AWS_ACCESS_KEY_ID"] == TEST_ACCESS_KEY
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "good.png").write_bytes(_png())
    (inputs / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    base = [*derivd_command(), "-c", str(ini), "--log-level", "debug"]
    queued = subprocess.run(
        [*base, "enqueue", str(inputs)], env=env, capture_output=True, text=True, timeout=60
    )
    assert queued.returncode == 0, queued.stderr

    log = tmp_path / "derivd.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*base, "run"], env=env, stdout=out, stderr=out)
    titles: dict[int, str] = {}
    names: set[str] = set()
    try:
        deadline = time.monotonic() + 120  # bounds a hang; nothing is timed
        while True:
            titles[proc.pid] = proc_title(proc.pid)
            for pid in children_of(proc.pid):
                titles[pid] = proc_title(pid)
            with psycopg.connect(password_dsn) as conn:
                names |= {
                    r[0] or ""
                    for r in conn.execute("SELECT application_name FROM pg_stat_activity")
                }
                done = conn.execute(
                    "SELECT count(*) FROM archive_files WHERE status IN ('ready', 'rejected')"
                ).fetchone()
            workers = [t for t in titles.values() if t.startswith("derivd: worker")]
            if done == (2,) and len(workers) >= 2:
                break
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    finally:
        stop_process(proc)
    assert proc.returncode == 0, log.read_text()
    assert titles[proc.pid].startswith("derivd: supervisor"), titles
    assert any(n.startswith("derivd-worker-") for n in names), names

    with psycopg.connect(password_dsn) as conn:
        events = [str(r) for r in conn.execute("SELECT * FROM archive_events")]
        rows = [str(r) for r in conn.execute("SELECT * FROM archive_files")]
        variants = [str(r) for r in conn.execute("SELECT * FROM archive_variants")]
    assert len(rows) == 2 and events
    places = {
        "log": log.read_text(errors="replace"),
        "enqueue output": queued.stdout + queued.stderr,
        "process titles": "\n".join(titles.values()),
        "connection names": "\n".join(names),
        "events": "\n".join(events),
        "rows": "\n".join(rows + variants),
    }
    for where, text in places.items():
        for secret in secrets:
            assert secret not in text, f"a credential in the {where}"
        assert not UNMASKED_PASSWORD.search(text), f"an unmasked password= in the {where}"
