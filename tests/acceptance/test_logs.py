"""Logs: one line per job outcome, JSON when asked, and never a credential.

The end-to-end test runs the real `derivd enqueue` and `derivd run --burst` against moto's
S3 with the test secret in the environment and a database DSN that carries a password,
at DEBUG (everything that can be logged is), then greps every byte they printed.
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from fixtures.s3 import TEST_REGION, TEST_SECRET_KEY, MotoServer
from helpers import role_dsn
from PIL import Image

from derivd import logs, redact

RunCli = Callable[..., subprocess.CompletedProcess[str]]

DB_PASSWORD = "derivd-db-password-do-not-log"
LOG_ROLE = "derivd_log_test"
# Inside the bad file's bytes: no log line may echo user content.
CONTENT_MARKER = "user-content-marker-9f3c"


def record(message: str, level: int = logging.INFO, **fields: object) -> logging.LogRecord:
    rec = logging.LogRecord("derivd.test", level, __file__, 1, message, (), None)
    rec.fields = fields  # type: ignore[attr-defined]
    return rec


def test_json_lines_carry_the_fields() -> None:
    line = logs.JsonFormatter().format(
        record("job finished", file_id=7, attempt=2, outcome="ready", code="-", duration_s=0.25)
    )
    data = json.loads(line)
    assert data["msg"] == "job finished" and data["level"] == "info"
    assert (data["file_id"], data["attempt"], data["outcome"], data["duration_s"]) == (
        7,
        2,
        "ready",
        0.25,
    )


def test_formatters_redact_secrets_passwords_and_signed_urls() -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    redact.register_secret(secret)
    signed = (
        "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=AKIAEXAMPLE%2F20240101&X-Amz-Signature=0123abcdef&x=1"
    )
    message = (
        f"boom {secret} dsn=host=db password=hunter22 user=u "
        f"url=postgresql://u:pw-in-url@db/x {signed}"
    )
    for formatter in (logs.TextFormatter(), logs.JsonFormatter()):
        line = formatter.format(record(message, detail={"nested": secret}))
        for leaked in (secret, "hunter22", "pw-in-url", "0123abcdef", "AKIAEXAMPLE"):
            assert leaked not in line, (type(formatter).__name__, line)
        assert "X-Amz-Algorithm=AWS4-HMAC-SHA256" in line and "x=1" in line  # the rest stays


def test_setup_logging_registers_the_environment_credentials() -> None:
    token = f"token-{uuid.uuid4().hex}"
    logs.setup_logging("info", "text", env={"AWS_SESSION_TOKEN": token})
    assert token not in logs.TextFormatter().format(record(f"token {token}"))
    assert redact.dsn_password(f"host=x password={DB_PASSWORD}") == DB_PASSWORD
    assert redact.dsn_password("postgresql://u:pw@h/db") == "pw"
    assert redact.dsn_password("host=x") is None


def test_exception_text_only_at_debug() -> None:
    try:
        raise ValueError(CONTENT_MARKER)
    except ValueError:
        import sys

        exc_info = sys.exc_info()
    for level, shown in ((logging.INFO, False), (logging.DEBUG, True)):
        rec = record("job failed", level)
        rec.exc_info = exc_info
        for formatter in (logs.TextFormatter(), logs.JsonFormatter()):
            assert (CONTENT_MARKER in formatter.format(rec)) is shown


@pytest.fixture
def password_dsn(dsn: str) -> str:
    return role_dsn(dsn, LOG_ROLE, DB_PASSWORD)


def _png(path: Path, size: tuple[int, int]) -> Path:
    buffer = io.BytesIO()
    Image.new("RGB", size, (20, 120, 200)).save(buffer, "PNG")
    path.write_bytes(buffer.getvalue())
    return path


def test_a_run_logs_each_outcome_and_no_credential(
    run_cli: RunCli, password_dsn: str, s3_server: MotoServer, s3_bucket: str, tmp_path: Path
) -> None:
    with psycopg.connect(password_dsn) as conn:  # the role really is the one connecting
        assert conn.execute("SELECT current_user").fetchone() == (LOG_ROLE,)
    originals = tmp_path / "in"
    originals.mkdir()
    _png(originals / "a.png", (640, 480))
    _png(originals / "b.png", (90, 300))
    (originals / "c.jpg").write_text(f"<html>{CONTENT_MARKER}</html>")
    env = {
        "DERIVD_DATABASE_DSN": password_dsn,
        "DERIVD_STORAGE_BACKEND": "s3",
        "DERIVD_STORAGE_BUCKET": s3_bucket,
        "DERIVD_STORAGE_ENDPOINT_URL": s3_server.endpoint_url,
        "DERIVD_STORAGE_REGION": TEST_REGION,
        "DERIVD_DERIVE_BACKEND": "pillow",
        "DERIVD_SUPERVISOR_WORKERS": "1",
        "DERIVD_LOGGING_FORMAT": "json",
    }

    queued = run_cli("--log-level", "debug", "enqueue", str(originals), env=env)
    assert queued.returncode == 0, queued.stderr
    ids = [int(line.split("\t")[0]) for line in queued.stdout.splitlines()]
    assert len(ids) == 3
    assert "uploading" in queued.stderr  # the progress bar: on stderr, for several files
    debug = run_cli("--log-level", "debug", "run", "--burst", env=env, timeout=120)
    assert debug.returncode == 0, debug.stderr

    single = run_cli("enqueue", str(originals / "a.png"), env=env)
    assert single.returncode == 0 and "uploading" not in single.stderr
    assert len(single.stdout.splitlines()) == 1
    info = run_cli("run", "--burst", env={**env, "DERIVD_LOGGING_FORMAT": "text"}, timeout=120)
    assert info.returncode == 0, info.stderr

    everything = "".join(r.stdout + r.stderr for r in (queued, single, debug, info))
    assert TEST_SECRET_KEY not in everything
    assert DB_PASSWORD not in everything
    assert "X-Amz-Signature" not in everything
    assert CONTENT_MARKER not in info.stdout + info.stderr  # user content: DEBUG at most
    assert "Traceback" not in info.stderr

    lines = [json.loads(line) for line in debug.stderr.splitlines() if line.strip()]
    finished = {r["file_id"]: r for r in lines if r["msg"] == "job finished"}
    assert sorted(finished) == ids
    for entry in finished.values():
        assert {"file_id", "attempt", "duration_s", "outcome", "code"} <= entry.keys()
        assert entry["attempt"] == 1 and entry["duration_s"] >= 0
    outcomes = sorted((r["outcome"], r["code"]) for r in finished.values())
    assert outcomes == [("ready", "-"), ("ready", "-"), ("rejected", "unsupported_content")]
    # The text run did the single file queued afterwards: one line for its outcome.
    text_lines = [line for line in info.stderr.splitlines() if "job finished" in line]
    assert len(text_lines) == 1
    assert "outcome=ready" in text_lines[0] and "attempt=1" in text_lines[0]
