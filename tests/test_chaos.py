"""The short chaos run (bench/chaos.py without --full) as part of the suite.

It starts its own PostgreSQL, moto server, fault proxy and `derivd run`, so it shares
nothing with the other tests. Its checks are invariants (nothing lost, nothing committed
twice, nothing leaked, valid images ready, hostile ones rejected with their code), never
timings; the deadlines inside it only bound a run that would otherwise hang.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from fixtures.faultproxy import FaultProxy
from fixtures.s3 import TEST_REGION

from supervisor.storage import derived_key
from supervisor.storage_s3 import S3Storage

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

CHAOS = Path(__file__).resolve().parent.parent / "bench" / "chaos.py"


@pytest.mark.slow
def test_short_chaos_run_keeps_every_invariant() -> None:
    run = subprocess.run(
        [sys.executable, str(CHAOS), "--seed", "20240611"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "RESULT: all invariants hold" in run.stdout, output
    # The run really did its tricks (a run where nothing happened proves nothing).
    assert "froze worker" in run.stdout, output
    assert "restarting PostgreSQL" in run.stdout, output
    assert "SIGKILL worker" in run.stdout, output


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
