"""The short chaos run (harness/chaos.py without --full) as part of the suite, at
pipeline depths 2 (direct) and 3 (through PgBouncer); the backfill chaos run is the
suite's run at depth 1 (tests/test_backfill_chaos.py), `make chaos` runs every depth.

It starts its own PostgreSQL, moto server, fault proxy and `derivd run`, so it shares
nothing with the other tests. Its checks are invariants (nothing lost, nothing committed
twice, nothing leaked, valid images ready, hostile ones rejected with their code, no
attempt charged for another's crash or wait, no derive without its outcome), never
timings; the deadlines inside it only bound a run that would otherwise hang.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
from fixtures.cli import derivd_command
from fixtures.faultproxy import FaultProxy
from fixtures.pgbouncer import NO_PGBOUNCER, find_pgbouncer
from fixtures.s3 import TEST_REGION
from helpers import chaos_run, stop_process

from derivd.queue.db import QueueDB
from derivd.storage.base import derived_key, new_original_key
from derivd.storage.fs import FsStorage
from derivd.storage.s3 import S3Storage

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

NEEDS_PGBOUNCER = pytest.mark.skipif(find_pgbouncer() is None, reason=NO_PGBOUNCER)


# It starts PostgreSQL, moto, a fault proxy and `derivd run` itself (no fixtures tell the
# tier from its arguments): an acceptance test, whatever its fixtures say.
@pytest.mark.acceptance
@pytest.mark.slow
@pytest.mark.parametrize(
    ("pooler", "depth"),
    [
        pytest.param([], 2, id="direct-pipeline2"),
        pytest.param(["--pooler"], 3, id="pgbouncer-pipeline3", marks=NEEDS_PGBOUNCER),
    ],
)
def test_short_chaos_run_keeps_every_invariant(pooler: list[str], depth: int) -> None:
    output = chaos_run(
        "harness.chaos",
        *("--seed", "20240611", "--pipeline", str(depth), *pooler),
        timeout=600,
    )
    # The run really did its tricks (a run where nothing happened proves nothing).
    assert "froze worker" in output, output
    assert "restarting PostgreSQL" in output, output
    assert "SIGKILL worker" in output, output
    assert "in a commit" in output, output  # a worker's connection cut off mid-commit
    assert "wait behind running jobs" in output, output


def test_a_put_retried_after_the_connection_broke_leaves_one_version(
    faulty_s3: tuple[str, FaultProxy], s3_bucket: str, s3_client: S3Client
) -> None:
    """Found by the chaos run: S3 stored a PUT, the connection broke before the answer,
    botocore retried and stored it again. The first version was referenced by nothing and
    never swept (the key itself is committed). The seeded proxy resets the first request
    only, after it reached S3."""
    url, proxy = faulty_s3
    store = S3Storage(bucket=s3_bucket, endpoint_url=url, region=TEST_REGION)
    proxy.reseed(36)  # random() draws 0.33, then 0.98, 0.96, ...: only the first is < 0.5
    proxy.reset_connections(0.5, after_upstream=True)
    key = derived_key(1, uuid.uuid4(), "thumb")
    version = store.put(key, b"webp bytes", "image/webp")
    assert proxy.snapshot().get("resets_after_upstream") == 1  # the ghost was made
    listed = s3_client.list_object_versions(Bucket=s3_bucket, Prefix=key)
    assert [v["VersionId"] for v in listed.get("Versions", [])] == [version]


@pytest.mark.acceptance
def test_the_running_supervisor_sweeps_orphans_and_deletions_on_its_own(
    dsn: str, fs_root: Path, tmp_path: Path
) -> None:
    store = FsStorage(fs_root)
    original = new_original_key()
    with QueueDB.open(dsn, role="test") as queue:
        (file_id,) = queue.enqueue([(original, store.put(original, b"ok", "text/plain"))])
        queue.request_delete([file_id], actor="test")
    orphan = derived_key(999, uuid.uuid4(), "thumb")
    store.put(orphan, b"left by a crashed attempt", "image/webp")
    with psycopg.connect(dsn, autocommit=True) as conn:  # as a crash after PUT leaves it
        conn.execute(
            "INSERT INTO pending_objects (key, file_id, lease_token, created_at) "
            "VALUES (%s, 999, gen_random_uuid(), now() - interval '1 hour')",
            (orphan,),
        )
        conn.execute("UPDATE archive_files SET updated_at = now() - interval '1 hour'")
    ini = tmp_path / "derivd.ini"
    ini.write_text(
        f"[database]\ndsn = {dsn}\n[storage]\nbackend = fs\nroot = {fs_root}\n"
        f"[supervisor]\nworkers = 1\njob_timeout = 3\nkill_grace = 1\n"
        f"state_dir = {tmp_path / 'state'}\n"
        "[queue]\nlease = 6\npoll_interval = 0.2\n[derive]\nbackend = noop\n"
        "[sweep]\norphan_guard = 7\ndelete_guard = 0\ninterval = 0.5\n"
    )
    log = tmp_path / "derivd.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*derivd_command(), "-c", str(ini), "run"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    try:
        deadline = time.monotonic() + 20  # 40 sweep intervals: a bound, not a timing
        while time.monotonic() < deadline:
            with psycopg.connect(dsn) as conn:
                swept = conn.execute(
                    "SELECT (SELECT count(*) FROM pending_objects) = 0 "
                    "AND (SELECT status FROM archive_files WHERE id = %s) = 'deleted'",
                    (file_id,),
                ).fetchone()
            if swept == (True,):
                break
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
    finally:
        stop_process(proc)
    assert swept == (True,), log.read_text()
    assert list(store.list_keys()) == []
