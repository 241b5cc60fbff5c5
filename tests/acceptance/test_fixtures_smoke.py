"""The fixtures themselves: fresh databases, versioned buckets, the fault proxy."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import boto3
import psycopg
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from fixtures.faketime import find_libfaketime
from fixtures.faultproxy import FaultProxy
from fixtures.pgbouncer import NO_PGBOUNCER
from fixtures.s3 import MotoServer
from helpers import failed_checks

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

TESTS = Path(__file__).resolve().parents[1]


def _user_tables(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchall()
    return {r[0] for r in rows}


@pytest.mark.parametrize("attempt", [1, 2])
def test_each_test_gets_a_fresh_database(dsn: str, attempt: int) -> None:
    # Whichever of the two runs second must not see the first one's table.
    assert "smoke_marker" not in _user_tables(dsn)
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE smoke_marker (attempt int)")
        conn.execute("INSERT INTO smoke_marker VALUES (%s)", (attempt,))


def test_fresh_database_is_migrated(dsn: str) -> None:
    assert "archive_files" in _user_tables(dsn)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM archive_files").fetchone() == (0,)


def test_s3_bucket_is_versioned(s3_client: S3Client, s3_bucket: str) -> None:
    assert s3_client.get_bucket_versioning(Bucket=s3_bucket)["Status"] == "Enabled"
    put = s3_client.put_object(Bucket=s3_bucket, Key="k", Body=b"one")
    assert put["VersionId"]


def test_unversioned_bucket(s3_client: S3Client, s3_bucket_unversioned: str) -> None:
    assert "Status" not in s3_client.get_bucket_versioning(Bucket=s3_bucket_unversioned)


def _get(url: str, path: str = "/") -> http.client.HTTPResponse:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", path)
    return conn.getresponse()


def test_fault_proxy_fails_everything_at_p1(faulty_s3: tuple[str, FaultProxy]) -> None:
    url, proxy = faulty_s3
    proxy.fail(p=1.0, code="ServiceUnavailable")
    response = _get(url)
    body = response.read()
    assert response.status == 503
    assert b"<Code>ServiceUnavailable</Code>" in body
    assert proxy.snapshot()["errors"] == 1


def test_fault_proxy_passes_at_p0(faulty_s3: tuple[str, FaultProxy], s3_bucket: str) -> None:
    url, proxy = faulty_s3
    proxy.fail(p=0.0)
    client = boto3.client("s3", endpoint_url=url, config=Config(retries={"max_attempts": 1}))
    put = client.put_object(Bucket=s3_bucket, Key="through-proxy", Body=b"x" * 100_000)
    got = client.get_object(Bucket=s3_bucket, Key="through-proxy", VersionId=put["VersionId"])
    assert got["Body"].read() == b"x" * 100_000
    counts = proxy.snapshot()
    assert counts["passed"] == counts["requests"] == 2
    assert counts.get("errors", 0) == 0


def test_fault_proxy_503_reaches_boto3_as_slowdown(
    faulty_s3: tuple[str, FaultProxy], s3_bucket: str
) -> None:
    url, proxy = faulty_s3
    proxy.fail(p=1.0, code="SlowDown")
    client = boto3.client(
        "s3", endpoint_url=url, config=Config(retries={"max_attempts": 1, "mode": "standard"})
    )
    with pytest.raises(ClientError) as err:
        client.head_bucket(Bucket=s3_bucket)
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    with pytest.raises(ClientError) as err2:
        client.get_object(Bucket=s3_bucket, Key="missing")
    assert err2.value.response["Error"]["Code"] == "SlowDown"


def test_fault_proxy_resets_and_slows(faulty_s3: tuple[str, FaultProxy]) -> None:
    url, proxy = faulty_s3
    proxy.reset_connections(p=1.0)
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        _get(url).read()
    proxy.slow(delay=0.3)
    response = _get(url, "/moto-api/")
    response.read()
    counts = proxy.snapshot()
    assert counts["resets"] == 1 and counts["delayed"] == 1


def test_fault_proxy_is_reproducible(s3_server: MotoServer) -> None:
    outcomes = []
    for _ in range(2):
        with FaultProxy(("127.0.0.1", s3_server.port), seed=7) as proxy:
            proxy.fail(p=0.5)
            outcomes.append([_get(proxy.url, "/moto-api/").status for _ in range(12)])
    assert outcomes[0] == outcomes[1]
    assert set(outcomes[0]) == {200, 503}


def test_s3_outage_and_recovery(
    s3_server: MotoServer, faulty_s3: tuple[str, FaultProxy], s3_client: S3Client
) -> None:
    url, proxy = faulty_s3
    port = s3_server.port
    s3_server.stop()
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        _get(url, "/moto-api/").read()
    assert proxy.snapshot()["upstream_errors"] == 1
    s3_server.start()
    assert s3_server.port == port
    assert _get(url, "/moto-api/").status == 200
    # moto keeps no state across a restart.
    assert s3_client.list_buckets()["Buckets"] == []


def test_run_cli_runs_the_console_script(
    run_cli: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    pytest.importorskip("derivd.cli")
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout


def test_libfaketime_is_found_on_any_architecture(tmp_path: Path) -> None:
    """It was looked for at the x86_64 path only: skipped on arm64 with faketime installed."""
    lib = tmp_path / "usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    pattern = str(tmp_path / "usr/lib/*/faketime/{}")
    assert find_libfaketime(listed=[], globs=[pattern]) == lib
    assert find_libfaketime(listed=[str(lib)], globs=[]) == lib  # dpkg -L libfaketime
    assert find_libfaketime(listed=["/usr/share/doc/libfaketime"], globs=[]) is None


def _pytest(*args: str, **env: str) -> str:
    """A nested pytest run on this suite (no xdist); its output."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
        cwd=TESTS.parent,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return run.stdout + run.stderr


@pytest.mark.acceptance  # a nested pytest that starts PostgreSQL
def test_a_missing_pgbouncer_skips_the_pooled_cases_in_one_line() -> None:
    """They errored (RuntimeError in the fixture) where PgBouncer was not installed:
    now each skips with one line naming the package, the direct cases run."""
    out = _pytest(
        "-rs",
        "tests/acceptance/test_pooler.py::test_migrations_run_through_the_pooler",
        "tests/integration/test_queue.py::test_migrate_is_idempotent",
        PYTEST_DERIVD_PGBOUNCER="",
    )
    assert "1 passed, 2 skipped" in out and "error" not in out.lower(), out
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 2 and all(line.endswith(f": {NO_PGBOUNCER}") for line in skipped)


def test_the_chaos_run_is_not_a_unit_test() -> None:
    """It starts PostgreSQL, moto and daemons, yet `pytest -m unit` ran it."""
    unit = _pytest("--collect-only", "-m", "unit", "tests/acceptance/test_chaos.py")
    assert "test_short_chaos_run_keeps_every_invariant" not in unit, unit
    acceptance = _pytest("--collect-only", "-m", "acceptance", "tests/acceptance/test_chaos.py")
    assert "test_short_chaos_run_keeps_every_invariant[direct-pipeline2]" in acceptance, acceptance


def test_a_chaos_runs_failing_checks_are_read_from_its_table() -> None:
    """What chaos_run names when a run fails: the FAIL rows' names only."""
    table = (
        "| invariant | result | detail |\n|---|---|---|\n"
        "| sweep ran (orphan guard 0) | PASS | sweep: 0 exhausted |\n"
        "| history: a crash or timeout charges only a started attempt | FAIL | 3 charges |\n"
        "| webhooks: every signature verifies | FAIL | unverified: [7] |\n"
        "note: | not a row | FAIL |\n"
    )
    assert failed_checks(table) == [
        "history: a crash or timeout charges only a started attempt",
        "webhooks: every signature verifies",
    ]
