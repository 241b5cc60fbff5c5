"""Failure semantics on real services: storage outages, dying workers, crashes between
PUT and commit, deletion during processing, and what may reach rows, events and logs.

Faults are injected with the fault proxy in front of moto, with storage wrappers and
handlers that raise or kill their own process (in forked children). Where a test needs
time to pass (a retry delay, a guard), it moves the row's timestamps instead of sleeping.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import os
import random
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
import pytest
from botocore.config import Config as BotoConfig
from configs import make_config
from fixtures.faultproxy import FaultProxy
from fixtures.readonly import read_only_dir
from fixtures.s3 import TEST_REGION, TEST_SECRET_KEY
from fixtures.stores import StorageWrapper
from fixtures.work import make_worker, run_job, run_one
from helpers import sql, wait_for
from PIL import Image

from derivd.config import Config
from derivd.errors import CorruptContent
from derivd.handlers.base import DerivedVariant, DeriveSpec, Handler
from derivd.handlers.registry import create_handler
from derivd.logs import JsonFormatter, TextFormatter
from derivd.ops.sweep import Sweeper
from derivd.processes.duties import ExhaustedRejection
from derivd.queue.db import QueueDB
from derivd.queue.retry import retry_delay
from derivd.storage.base import ObjectMissing, Storage, StorageUnavailable, derived_prefix
from derivd.storage.fs import FsStorage
from derivd.storage.s3 import S3Storage
from derivd.worker import IdleWait, Worker
from derivd.worker_loop import run

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

MARKER = "derivd-failure-marker-7f3a"
VARIANTS = "preview:64, thumb:32"


# --------------------------------------------------------------------------- helpers


def jpeg(width: int = 96, height: int = 72) -> bytes:
    buffer = io.BytesIO()
    Image.linear_gradient("L").resize((width, height)).convert("RGB").save(buffer, "JPEG")
    return buffer.getvalue()


def row(dsn: str, file_id: int) -> dict[str, Any]:
    (found,) = sql(dsn, "SELECT * FROM archive_files WHERE id = %s", (file_id,))
    return found


def events(dsn: str, file_id: int) -> list[tuple[str, int | None, str | None]]:
    rows = sql(
        dsn,
        "SELECT kind, attempt, error_code FROM archive_events WHERE file_id = %s ORDER BY id",
        (file_id,),
    )
    return [(r["kind"], r["attempt"], r["error_code"]) for r in rows]


def retry_delay_of(dsn: str, file_id: int) -> float:
    # The fail statement sets updated_at = now() and available_at = now() + delay.
    (found,) = sql(
        dsn,
        "SELECT extract(epoch FROM available_at - updated_at)::float8 AS d "
        "FROM archive_files WHERE id = %s",
        (file_id,),
    )
    return float(found["d"])


def make_due(dsn: str, file_id: int) -> None:
    """Let the retry delay pass (the test controls time instead of sleeping through it)."""
    sql(dsn, "UPDATE archive_files SET available_at = now() WHERE id = %s", (file_id,))


def lease_expired_or_final(dsn: str, file_id: int) -> bool:
    (found,) = sql(
        dsn,
        "SELECT status <> 'processing' OR lease_until < now() AS claimable "
        "FROM archive_files WHERE id = %s",
        (file_id,),
    )
    return bool(found["claimable"])


def run_in_child(target: Callable[[], None]) -> int | None:
    """Run `target` in a forked process (it builds its own connections there); its exit
    code, negative for a signal."""
    process = multiprocessing.get_context("fork").Process(target=target)
    process.start()
    process.join(120)
    assert not process.is_alive(), "child did not finish"
    return process.exitcode


def s3_versions(client: S3Client, bucket: str, prefix: str) -> list[tuple[str, str]]:
    """Every version and delete marker under prefix (what 'no object remains' means)."""
    found: list[tuple[str, str]] = []
    for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Versions", []) + page.get("DeleteMarkers", []):
            found.append((item["Key"], item["VersionId"]))
    return found


def s3_storage(endpoint_url: str, bucket: str) -> S3Storage:
    storage = S3Storage(bucket=bucket, endpoint_url=endpoint_url, region=TEST_REGION)
    # One HTTP try per call: the worker's retry policy is under test here, not boto3's.
    storage._client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=TEST_REGION,
        config=BotoConfig(retries={"max_attempts": 1}, connect_timeout=5, read_timeout=10),
    )
    return storage


def s3_config(dsn: str, endpoint_url: str, bucket: str, **sections: dict[str, Any]) -> Config:
    s3 = {"bucket": bucket, "endpoint_url": endpoint_url, "region": TEST_REGION}
    return make_config(dsn, s3=s3, derive={"backend": "pillow", "variants": VARIANTS}, **sections)


def fs_config(dsn: str, root: Path, **sections: dict[str, Any]) -> Config:
    return make_config(
        dsn, fs_root=root, derive={"backend": "pillow", "variants": VARIANTS}, **sections
    )


def pillow(config: Config) -> Handler:
    return create_handler("pillow", config.derive.spec())


def enqueue_original(dsn: str, storage: Storage, data: bytes | None = None) -> tuple[int, str]:
    key = f"originals/{os.urandom(8).hex()}"
    version = storage.put(key, data or jpeg(), "image/jpeg")
    with QueueDB.open(dsn) as queue:
        (file_id,) = queue.enqueue([(key, version)])
    return file_id, key


@pytest.fixture
def worker_cleanup() -> Iterator[list[Worker]]:
    workers: list[Worker] = []
    yield workers
    for worker in workers:
        worker.close()


# --------------------------------------------------------------------------- fault kit


class DiesAfterFirstPut(StorageWrapper):
    """The process dies right after its first PUT succeeded, before any commit. A job's
    PUTs go out concurrently: the others wait for the first one, which never lets go."""

    first = threading.Lock()

    def put(self, key: str, data: bytes, content_type: str, *, sha256: str | None = None) -> str:
        self.first.acquire()
        self.inner.put(key, data, content_type, sha256=sha256)
        os._exit(70)


class ScriptedGetFailures(StorageWrapper):
    """get() raises the next scripted exception; None in the script means a real call."""

    def __init__(self, inner: Storage, script: list[BaseException | None]) -> None:
        super().__init__(inner)
        self.script = script

    def get(self, key: str, version: str, *, max_bytes: int | None = None) -> bytes:
        fault = self.script.pop(0) if self.script else None
        if fault is not None:
            raise fault
        return self.inner.get(key, version, max_bytes=max_bytes)


class KillsItself:
    """A handler whose every run SIGKILLs its own process, after noting the run."""

    name = "kills-itself"

    def __init__(self, runs: Path) -> None:
        self.runs = runs

    def derive(self, original: bytes, spec: DeriveSpec) -> list[DerivedVariant]:
        with self.runs.open("a") as handle:
            handle.write(f"{os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


class Raises:
    """A handler that raises what it is given, every time."""

    name = "raises"

    def __init__(self, error: Exception) -> None:
        self.error = error

    def derive(self, original: bytes, spec: DeriveSpec) -> list[DerivedVariant]:
        raise self.error


class Hook:
    """Runs `before` once, on the first job, then derives with the real handler."""

    def __init__(self, inner: Handler, before: Callable[[], None]) -> None:
        self.inner = inner
        self.name = inner.name
        self.before: Callable[[], None] | None = before

    def derive(self, original: bytes, spec: DeriveSpec) -> list[DerivedVariant]:
        if self.before is not None:
            before, self.before = self.before, None
            before()
        return self.inner.derive(original, spec)


# --------------------------------------------------------------------------- backoff


def test_retry_delay_doubles_to_the_cap_with_full_jitter() -> None:
    rng = random.Random(5)
    caps = [retry_delay(n, base=2.0, cap=10.0, jitter=False) for n in range(1, 6)]
    assert caps == [2.0, 4.0, 8.0, 10.0, 10.0]
    for attempt, cap in enumerate(caps, start=1):
        draws = [retry_delay(attempt, base=2.0, cap=10.0, rng=rng) for _ in range(300)]
        assert all(0.0 <= d <= cap for d in draws)
        # Full jitter uses the whole range, not just the top of it.
        assert min(draws) < cap / 4 and max(draws) > 3 * cap / 4
    # base == cap with jitter off: a fixed delay, whatever the attempt.
    assert {retry_delay(n, base=7.0, cap=7.0, jitter=False) for n in range(1, 50)} == {7.0}
    assert retry_delay(10_000, base=1.0, cap=60.0, jitter=False) == 60.0  # no overflow


# --------------------------------------------------------------------------- outages


@pytest.mark.parametrize("fault", ["503", "reset"])
def test_storage_outage_requeues_with_growing_jittered_delay_then_succeeds(
    dsn: str,
    s3_bucket: str,
    s3_client: S3Client,
    faulty_s3: tuple[str, FaultProxy],
    worker_cleanup: list[Worker],
    fault: str,
) -> None:
    url, proxy = faulty_s3
    config = s3_config(
        dsn, url, s3_bucket, queue={"retry_base": 10.0, "retry_max": 1000.0, "max_attempts": 5}
    )
    storage = s3_storage(url, s3_bucket)
    file_id, _ = enqueue_original(dsn, storage)
    worker = make_worker(config, dsn, storage, pillow(config), rng=random.Random(42))
    worker_cleanup.append(worker)
    expected = random.Random(42)  # the same draws the worker will make

    if fault == "503":
        proxy.fail(p=1.0, code="ServiceUnavailable")
    else:
        proxy.reset_connections(p=1.0)
    delays = []
    for attempt, cap in ((1, 10.0), (2, 20.0)):
        result = run_one(worker)
        assert result is not None and result.outcome == "retry" and result.job.attempt == attempt
        current = row(dsn, file_id)
        assert current["status"] == "queued" and current["lease_token"] is None
        assert current["error_code"] is None
        delay = retry_delay_of(dsn, file_id)
        assert 0.0 <= delay <= cap
        assert delay == pytest.approx(expected.uniform(0.0, cap), abs=1e-3)
        delays.append(delay)
        make_due(dsn, file_id)
    counts = proxy.snapshot()
    assert counts.get("errors" if fault == "503" else "resets", 0) >= 2

    proxy.pass_through()
    result = run_one(worker)
    assert result is not None and result.outcome == "ready"
    done = row(dsn, file_id)
    assert done["status"] == "ready" and done["attempts"] == 3
    assert (
        s3_client.get_object(
            Bucket=s3_bucket, Key=done["derived_key"], VersionId=done["derived_version"]
        )["Body"].read()[:4]
        == b"RIFF"
    )
    assert events(dsn, file_id) == [
        ("retry", 1, "processing_failed"),
        ("retry", 2, "processing_failed"),
        ("ready", 3, None),
    ]


def test_fixed_retry_delay_without_jitter(
    dsn: str, s3_bucket: str, faulty_s3: tuple[str, FaultProxy], worker_cleanup: list[Worker]
) -> None:
    url, proxy = faulty_s3
    config = s3_config(
        dsn,
        url,
        s3_bucket,
        queue={"retry_base": 7.0, "retry_max": 7.0, "retry_jitter": False, "max_attempts": 3},
    )
    storage = s3_storage(url, s3_bucket)
    file_id, _ = enqueue_original(dsn, storage)
    worker = make_worker(config, dsn, storage, pillow(config))
    worker_cleanup.append(worker)
    proxy.fail(p=1.0)
    for _ in range(2):
        result = run_one(worker)
        assert result is not None and result.outcome == "retry"
        assert retry_delay_of(dsn, file_id) == pytest.approx(7.0, abs=1e-6)
        make_due(dsn, file_id)
    # The last allowed attempt fails too: rejected, with the transient's code.
    result = run_one(worker)
    assert result is not None and result.outcome == "rejected"
    final = row(dsn, file_id)
    assert (final["status"], final["error_code"], final["attempts"]) == (
        "rejected",
        "processing_failed",
        3,
    )


def test_unknown_exception_retries_and_ends_processing_failed(
    dsn: str, fs_root: Path, worker_cleanup: list[Worker]
) -> None:
    config = fs_config(dsn, fs_root, queue={"max_attempts": 3, "retry_base": 1.0})
    storage = FsStorage(fs_root)
    file_id, _ = enqueue_original(dsn, storage)
    worker = make_worker(config, dsn, storage, Raises(KeyError("boom")))
    worker_cleanup.append(worker)
    outcomes = []
    for _ in range(3):
        result = run_one(worker)
        assert result is not None
        outcomes.append(result.outcome)
        make_due(dsn, file_id)
    assert outcomes == ["retry", "retry", "rejected"]
    assert run_one(worker) is None
    assert row(dsn, file_id)["error_code"] == "processing_failed"
    assert [e[0] for e in events(dsn, file_id)] == ["retry", "retry", "rejected"]


def test_permanent_error_rejects_at_once(
    dsn: str, fs_root: Path, worker_cleanup: list[Worker]
) -> None:
    config = fs_config(dsn, fs_root, queue={"max_attempts": 3})
    storage = FsStorage(fs_root)
    file_id, _ = enqueue_original(dsn, storage)
    worker = make_worker(config, dsn, storage, Raises(CorruptContent("truncated")))
    worker_cleanup.append(worker)
    result = run_one(worker)
    assert result is not None and (result.outcome, result.code) == ("rejected", "corrupt_content")
    assert (row(dsn, file_id)["attempts"], events(dsn, file_id)) == (
        1,
        [("rejected", 1, "corrupt_content")],
    )


# Keys derivd's stores refuse (derivd.client.enqueue refuses them too; an upload API in
# another language may still insert them): none names an object derivd could ever read.
REFUSED_KEYS = ["../../etc/passwd", "/abs.jpg", "originals/My Photo.jpg"]


def insert_queued(dsn: str, key: str, version: str) -> int:
    """The enqueue any language may run (docs/integrating.md), bypassing derivd.client's checks."""
    (found,) = sql(
        dsn,
        "INSERT INTO archive_files (status, original_key, original_version) "
        "VALUES ('queued', %s, %s) RETURNING id",
        (key, version),
    )
    return int(found["id"])


@pytest.mark.parametrize("store", ["fs", "s3"])
def test_an_original_missing_for_good_is_rejected_at_once_as_missing_original(
    request: pytest.FixtureRequest, dsn: str, store: str, worker_cleanup: list[Worker]
) -> None:
    """No such key, no such version, a key the store refuses: rejected on the first
    attempt with `missing_original`, never retried as an outage."""
    if store == "fs":
        root = request.getfixturevalue("fs_root")
        config, storage = fs_config(dsn, root), FsStorage(root)
    else:
        url = request.getfixturevalue("s3_server").endpoint_url
        bucket = request.getfixturevalue("s3_bucket")
        config, storage = s3_config(dsn, url, bucket), s3_storage(url, bucket)
    _, stored = enqueue_original(dsn, storage)
    other_version = storage.put("originals/other", jpeg(), "image/jpeg")
    ids = [insert_queued(dsn, key, other_version) for key in REFUSED_KEYS]
    ids.append(insert_queued(dsn, "originals/never-stored", other_version))  # no such key
    ids.append(insert_queued(dsn, stored, other_version))  # the key's, not this version
    worker = make_worker(config, dsn, storage)
    worker_cleanup.append(worker)
    outcomes = {}
    for _ in range(len(ids) + 1):  # the good original too
        result = run_one(worker)
        assert result is not None
        outcomes[result.job.id] = (result.outcome, result.code)
    assert run_one(worker) is None
    for file_id in ids:
        assert outcomes[file_id] == ("rejected", "missing_original"), file_id
        assert row(dsn, file_id)["attempts"] == 1
        assert events(dsn, file_id) == [("rejected", 1, "missing_original")]


def test_database_connection_killed_mid_job_retries(
    dsn: str, fs_root: Path, worker_cleanup: list[Worker]
) -> None:
    """The server drops the worker's connection while it derives: the commit fails with a
    transient error, the worker reconnects, records the retry, and the next attempt wins."""
    config = fs_config(dsn, fs_root, queue={"retry_base": 1.0})
    storage = FsStorage(fs_root)
    file_id, _ = enqueue_original(dsn, storage)
    queue = QueueDB.open(dsn, role="derivd-victim")

    def kill_connection() -> None:
        killed = sql(
            dsn,
            "SELECT pg_terminate_backend(pid) AS ok FROM pg_stat_activity "
            "WHERE application_name = %s",
            (queue.application_name,),
        )
        assert [r["ok"] for r in killed] == [True]

    handler = Hook(pillow(config), kill_connection)
    worker = Worker(config, queue=queue, storage=storage, handler=handler)
    worker_cleanup.append(worker)
    first = run_one(worker)
    assert first is not None and first.outcome == "retry"
    make_due(dsn, file_id)
    second = run_one(worker)
    assert second is not None and second.outcome == "ready"
    assert [e[0] for e in events(dsn, file_id)] == ["retry", "ready"]


# --------------------------------------------------------------------------- crashes


def test_worker_that_dies_every_time_is_rejected_after_exactly_max_attempts(
    dsn: str, fs_root: Path, tmp_path: Path
) -> None:
    config = fs_config(dsn, fs_root, queue={"lease": 1.0, "max_attempts": 3, "listen": False})
    file_id, _ = enqueue_original(dsn, FsStorage(fs_root))
    runs = tmp_path / "runs"
    runs.touch()

    def child() -> None:
        # Everything is created after the fork, as in a real worker.
        worker = make_worker(config, dsn, FsStorage(fs_root), KillsItself(runs))
        run(worker, lambda: False, idle=IdleWait(), burst=True)
        worker.close()

    exit_codes: list[int] = []
    for _ in range(10):  # bounded: a loop that never ends is the bug under test
        if exit_codes[-1:] == [0]:  # drained: the row is claimable no more
            break
        wait_for(lambda: lease_expired_or_final(dsn, file_id), "the dead worker's lease")
        exit_codes.append(run_in_child(child))
    # The supervisor's duty (here one round by hand) ends the row a claim never takes.
    with QueueDB.open(dsn) as queue:
        assert ExhaustedRejection(lambda: config).run_once(queue) == [file_id]

    assert exit_codes == [-signal.SIGKILL] * 3 + [0]
    assert len(runs.read_text().splitlines()) == 3
    final = row(dsn, file_id)
    assert (final["status"], final["error_code"], final["attempts"]) == (
        "rejected",
        "attempts_exhausted",
        3,
    )
    assert events(dsn, file_id) == [("exhausted", 3, "attempts_exhausted")]


def test_crash_after_put_leaves_an_orphan_the_sweep_removes_after_the_guard(
    dsn: str, s3_server: Any, s3_bucket: str, s3_client: S3Client, worker_cleanup: list[Worker]
) -> None:
    endpoint = s3_server.endpoint_url
    config = s3_config(dsn, endpoint, s3_bucket, queue={"lease": 1.0, "max_attempts": 2})
    file_id, _ = enqueue_original(dsn, s3_storage(endpoint, s3_bucket))

    def child() -> None:
        storage = DiesAfterFirstPut(s3_storage(endpoint, s3_bucket))
        run_one(make_worker(config, dsn, storage, pillow(config)))

    assert run_in_child(child) == 70
    crashed = row(dsn, file_id)
    assert crashed["status"] == "processing"
    orphan_keys = [
        r["key"]
        for r in sql(
            dsn,
            "SELECT key FROM pending_objects WHERE lease_token = %s",
            (crashed["lease_token"],),
        )
    ]
    assert len(orphan_keys) == 2  # both registered before the first PUT
    written = {k for k, _ in s3_versions(s3_client, s3_bucket, derived_prefix(file_id))}
    assert len(written) == 1 and written < set(orphan_keys)

    # Another worker takes the expired lease over and commits its own objects.
    wait_for(lambda: lease_expired_or_final(dsn, file_id), "the crashed attempt's lease")
    worker = make_worker(config, dsn, s3_storage(endpoint, s3_bucket), pillow(config))
    worker_cleanup.append(worker)
    result = run_one(worker)
    assert result is not None and result.outcome == "ready" and result.job.attempt == 2
    committed = {v.key: v.version for v in worker.queue.file_variants(file_id)}
    assert not set(committed) & set(orphan_keys)

    sweeper = Sweeper(worker.queue, worker.storage, orphan_guard=30.0, delete_guard=300.0)
    before = sweeper.run_once()
    assert before.error is None and before.orphans_deleted == []
    assert written <= {k for k, _ in s3_versions(s3_client, s3_bucket, derived_prefix(file_id))}

    # Let the guard pass (the entries age; nothing else changes).
    sql(dsn, "UPDATE pending_objects SET created_at = created_at - interval '31 seconds'")
    after = sweeper.run_once()
    assert after.error is None and sorted(after.orphans_deleted) == sorted(orphan_keys)
    left = {k for k, _ in s3_versions(s3_client, s3_bucket, derived_prefix(file_id))}
    assert left == set(committed)  # the orphan is gone, the committed objects stay
    for key, version in committed.items():
        s3_client.head_object(Bucket=s3_bucket, Key=key, VersionId=version)
    assert sql(dsn, "SELECT key FROM pending_objects") == []


def test_delete_while_processing_late_commit_changes_nothing_and_sweep_removes_all(
    dsn: str, s3_server: Any, s3_bucket: str, s3_client: S3Client, worker_cleanup: list[Worker]
) -> None:
    endpoint = s3_server.endpoint_url
    config = s3_config(dsn, endpoint, s3_bucket)
    storage = s3_storage(endpoint, s3_bucket)
    file_id, original_key = enqueue_original(dsn, storage)
    storage.put(original_key, jpeg(), "image/jpeg")  # a second version of the original

    def delete_now() -> None:
        with QueueDB.open(dsn) as operator:
            assert operator.request_delete([file_id], actor="test:operator") == [file_id]

    worker = make_worker(config, dsn, storage, Hook(pillow(config), delete_now))
    worker_cleanup.append(worker)
    job = worker.claim_many(1)[0]
    assert job is not None
    real_commit = worker.queue.commit_many
    commits: list[bool] = []

    def recording_commit(results: Any) -> set[int]:
        committed = real_commit(results)
        commits.extend(f.job.id in committed for f in results)
        return committed

    worker.queue.commit_many = recording_commit  # type: ignore[method-assign]
    assert run_job(worker, job).outcome == "lease_lost"
    assert commits == [False]
    deleting = row(dsn, file_id)
    assert deleting["status"] == "deleting"
    assert deleting["derived_key"] is None and worker.queue.file_variants(file_id) == []
    assert [e[0] for e in events(dsn, file_id)] == ["delete_requested", "lease_lost"]
    written = s3_versions(s3_client, s3_bucket, derived_prefix(file_id))
    assert len(written) == 2  # the losing attempt's PUTs happened

    sweeper = Sweeper(worker.queue, storage, orphan_guard=3600.0, delete_guard=30.0)
    before = sweeper.run_once()
    assert before.deletions_completed == [] and row(dsn, file_id)["status"] == "deleting"
    assert len(s3_versions(s3_client, s3_bucket, original_key)) == 2

    sql(dsn, "UPDATE archive_files SET updated_at = updated_at - interval '31 seconds'")
    after = sweeper.run_once()
    assert after.error is None and after.deletions_completed == [file_id]
    assert row(dsn, file_id)["status"] == "deleted"
    assert s3_versions(s3_client, s3_bucket, original_key) == []
    assert s3_versions(s3_client, s3_bucket, derived_prefix(file_id)) == []
    assert [e[0] for e in events(dsn, file_id)][-1] == "deleted"

    # The attempt's write-ahead entries outlive the deletion (a late PUT would be caught);
    # the orphan sweep forgets them once their guard passes, with nothing left to delete.
    sql(dsn, "UPDATE pending_objects SET created_at = created_at - interval '3601 seconds'")
    last = sweeper.run_once()
    assert len(last.orphans_deleted) == 2 and last.objects_deleted == 0
    assert sql(dsn, "SELECT key FROM pending_objects") == []


# --------------------------------------------------------------------------- secrecy


@pytest.fixture
def captured_logs() -> Iterator[dict[str, io.StringIO]]:
    """Everything logged, formatted both ways, at INFO and above (what operators see) and
    at DEBUG (to prove the marker really went through the code under test)."""
    streams = {"info_text": io.StringIO(), "info_json": io.StringIO(), "debug": io.StringIO()}
    handlers = []
    for name, stream in streams.items():
        handler = logging.StreamHandler(stream)
        handler.setLevel(logging.DEBUG if name == "debug" else logging.INFO)
        handler.setFormatter(JsonFormatter() if name == "info_json" else TextFormatter())
        handlers.append(handler)
    root = logging.getLogger()
    old_level = root.level
    root.setLevel(logging.DEBUG)
    for handler in handlers:
        root.addHandler(handler)
    yield streams
    for handler in handlers:
        root.removeHandler(handler)
    root.setLevel(old_level)


def test_no_row_event_or_log_line_holds_exception_text_or_credentials(
    dsn: str,
    s3_bucket: str,
    faulty_s3: tuple[str, FaultProxy],
    worker_cleanup: list[Worker],
    captured_logs: dict[str, io.StringIO],
) -> None:
    url, proxy = faulty_s3
    secret_text = f"{MARKER} aws_secret_access_key={TEST_SECRET_KEY}"
    config = s3_config(dsn, url, s3_bucket, queue={"max_attempts": 3, "retry_base": 1.0})
    real = s3_storage(url, s3_bucket)
    retried_id, _ = enqueue_original(dsn, real)

    # File 1: a storage outage whose message holds the marker and the secret, then an
    # unknown exception holding them, then a real 503 from the proxy: rejected in the end.
    flaky = ScriptedGetFailures(
        real, [StorageUnavailable(secret_text), ConnectionError(secret_text), None]
    )
    worker = make_worker(config, dsn, flaky, pillow(config))
    worker_cleanup.append(worker)
    proxy.fail(p=1.0, code="ServiceUnavailable")
    for _ in range(3):
        result = run_one(worker)
        assert result is not None and result.job.id == retried_id
        make_due(dsn, retried_id)
    proxy.pass_through()
    # File 2: a permanent storage error with the same text.
    missing_id, _ = enqueue_original(dsn, real)
    flaky.script = [ObjectMissing(secret_text)]
    result = run_one(worker)
    assert result is not None and (result.job.id, result.outcome) == (missing_id, "rejected")

    assert row(dsn, retried_id)["error_code"] == "processing_failed"
    assert row(dsn, missing_id)["error_code"] == "missing_original"
    stored = "\n".join(
        json.dumps(r, default=str)
        for table in ("archive_files", "archive_events", "archive_variants", "pending_objects")
        for r in sql(dsn, f"SELECT * FROM {table}")
    )
    assert '"kind": "retry"' in stored  # the rows and events really are in there
    info = captured_logs["info_text"].getvalue() + captured_logs["info_json"].getvalue()
    assert "StorageUnavailable" in info and "ConnectionError" in info  # failures are logged
    for text in (stored, info):
        assert MARKER not in text
        assert TEST_SECRET_KEY not in text
    # The detail exists for whoever turns DEBUG on: the marker did flow through the code.
    assert MARKER in captured_logs["debug"].getvalue()


# --------------------------------------------------------------------------- a read-only store


def test_a_read_only_store_logs_the_path_and_the_reason(
    dsn: str,
    tmp_path: Path,
    worker_cleanup: list[Worker],
    captured_logs: dict[str, io.StringIO],
) -> None:
    """A worker whose store refused the PUT logged `failed: OSError`: neither which
    directory nor why. Now one line names both (derivd's own words, safe to show), and
    the attempt retries: an operator can fix the store."""
    root = tmp_path / "store"
    storage = FsStorage(root)
    file_id, _ = enqueue_original(dsn, storage)
    config = fs_config(dsn, root)
    with read_only_dir(root / "derived"):
        worker = make_worker(config, dsn, storage, pillow(config))
        worker_cleanup.append(worker)
        result = run_one(worker)
    assert result is not None and (result.job.id, result.outcome) == (file_id, "retry")
    lines = [
        line
        for line in captured_logs["info_text"].getvalue().splitlines()
        if "failed transiently" in line
    ]
    assert len(lines) == 1, captured_logs["info_text"].getvalue()
    assert f"fs store: cannot write {root / 'derived'}/" in lines[0]
    assert ("Read-only file system" in lines[0]) or ("Permission denied" in lines[0])
    assert "Traceback" not in captured_logs["info_text"].getvalue()
