"""The sweeper on a real PostgreSQL and real stores: guards, idempotence, one sweeper at a
time, outages. Guards are crossed by ageing the rows' timestamps, never by sleeping."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import boto3
import pytest
from botocore.config import Config as BotoConfig
from configs import make_config
from fixtures.faultproxy import FaultProxy
from fixtures.pgbouncer import DIRECT_FOR
from fixtures.s3 import TEST_REGION, TEST_SECRET_KEY
from fixtures.work import claim_one, commit_one
from helpers import sql, wait_for

from derivd.ops.sweep import Sweeper, SweepLeaseLost, SweepReport, sweep_once
from derivd.queue.db import Job, QueueDB, StoredVariant
from derivd.storage.base import Storage, derived_key, derived_prefix
from derivd.storage.fs import FsStorage
from derivd.storage.s3 import S3Storage

# Each test on `dsn` runs direct and through PgBouncer (transaction mode).
pytestmark = pytest.mark.pooler

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

LEASE = 60.0


def age_orphans(dsn: str, seconds: int) -> None:
    sql(dsn, f"UPDATE pending_objects SET created_at = created_at - interval '{seconds} s'")


def age_deletions(dsn: str, seconds: int) -> None:
    sql(
        dsn,
        f"UPDATE archive_files SET updated_at = updated_at - interval '{seconds} s' "
        "WHERE status = 'deleting'",
    )


def sweeper(queue: QueueDB, storage: Storage, **guards: float) -> Sweeper:
    return Sweeper(
        queue,
        storage,
        orphan_guard=guards.get("orphan_guard", 30.0),
        delete_guard=guards.get("delete_guard", 30.0),
    )


def stored_original(queue: QueueDB, storage: Storage, versions: int = 1) -> tuple[int, str]:
    key = f"originals/{uuid.uuid4().hex}"
    version = ""
    for n in range(versions):
        version = storage.put(key, f"original {n}".encode(), "image/jpeg")
    (file_id,) = queue.enqueue([(key, version)])
    return file_id, key


def attempt_with_objects(queue: QueueDB, storage: Storage, names: tuple[str, ...]) -> Job:
    """Claim, register and PUT like a worker, and stop there (the attempt is live)."""
    job = claim_one(queue, lease_s=LEASE, max_attempts=3)
    assert job is not None
    keys = [derived_key(job.id, job.token, name) for name in names]
    queue.register_pending(job, keys)
    for key in keys:
        storage.put(key, b"webp bytes", "image/webp")
    return job


def orphan(queue: QueueDB, storage: Storage) -> tuple[int, list[str]]:
    """An attempt that PUT two objects and then failed (its token is dead; the row is
    rejected so that it stays out of the next claims)."""
    file_id, _ = stored_original(queue, storage)
    job = attempt_with_objects(queue, storage, ("preview", "thumb"))
    assert queue.fail(job, retry=False, code="corrupt_content", max_attempts=3) == "rejected"
    return file_id, [derived_key(job.id, job.token, n) for n in ("preview", "thumb")]


def ready_file(queue: QueueDB, storage: Storage) -> tuple[int, str]:
    file_id, key = stored_original(queue, storage, versions=2)
    job = attempt_with_objects(queue, storage, ("preview",))
    assert job.id == file_id
    dkey = derived_key(job.id, job.token, "preview")
    version = storage.put(dkey, b"second version", "image/webp")
    assert commit_one(queue, job, [StoredVariant("preview", dkey, version, "ab" * 32, 4, 3)])
    return file_id, key


def test_the_rows_of_waiters_that_died_are_forgotten(queue: QueueDB, fs_root: Path) -> None:
    """A client that died while waiting leaves its derivd_waiters row: the sweep removes
    it a minute past its deadline, and leaves a live waiter's row alone."""
    (file_id,) = queue.enqueue([("originals/a", "1")])
    queue.conn.execute(
        "INSERT INTO derivd_waiters (file_id, waiter, until) VALUES"
        " (%s, gen_random_uuid(), now() - interval '2 minutes'),"
        " (%s, gen_random_uuid(), now() + interval '1 minute')",
        (file_id, file_id),
    )
    report = sweeper(queue, FsStorage(fs_root)).run_once()
    assert report.waiters_forgotten == 1 and report.error is None
    assert queue.conn.execute("SELECT count(*) FROM derivd_waiters").fetchone() == (1,)


def test_a_pass_over_a_clean_queue_does_nothing(queue: QueueDB, fs_root: Path) -> None:
    report = sweeper(queue, FsStorage(fs_root)).run_once()
    assert report == SweepReport()


def test_objects_of_a_live_attempt_are_never_orphans(queue: QueueDB, fs_root: Path) -> None:
    storage = FsStorage(fs_root)
    stored_original(queue, storage)
    job = attempt_with_objects(queue, storage, ("thumb",))
    key = derived_key(job.id, job.token, "thumb")
    age_orphans(queue.dsn or "", 3600)
    # Older than any guard, but the attempt may still commit: untouched.
    assert sweeper(queue, storage).run_once().orphans_deleted == []
    assert list(storage.list_keys("derived/")) == [key]
    # Once the attempt ends without committing them, they are orphans.
    assert queue.fail(job, retry=True, code="processing_failed", max_attempts=3) == "queued"
    assert sweeper(queue, storage).run_once().orphans_deleted == [key]
    assert list(storage.list_keys("derived/")) == []


def test_orphans_go_after_their_guard_and_not_before(queue: QueueDB, fs_root: Path) -> None:
    storage = FsStorage(fs_root)
    _, keys = orphan(queue, storage)
    assert sweeper(queue, storage, orphan_guard=30.0).run_once().orphans_deleted == []
    assert sorted(storage.list_keys("derived/")) == sorted(keys)
    age_orphans(queue.dsn or "", 31)
    report = sweeper(queue, storage, orphan_guard=30.0).run_once()
    assert sorted(report.orphans_deleted) == sorted(keys) and report.objects_deleted == 2
    assert list(storage.list_keys("derived/")) == []
    assert sql(queue.dsn or "", "SELECT * FROM pending_objects") == []


def test_a_crash_between_delete_and_forget_is_repeated_harmlessly(
    queue: QueueDB, fs_root: Path
) -> None:
    storage = FsStorage(fs_root)
    _, keys = orphan(queue, storage)
    for key in keys:  # the first pass deleted the objects, then died
        storage.delete_all_versions(key)
    age_orphans(queue.dsn or "", 31)
    report = sweeper(queue, storage).run_once()
    assert report.error is None and sorted(report.orphans_deleted) == sorted(keys)
    assert report.objects_deleted == 0
    assert sql(queue.dsn or "", "SELECT * FROM pending_objects") == []


def test_deletion_removes_every_version_and_every_derived_object_once(
    queue: QueueDB, fs_root: Path
) -> None:
    storage = FsStorage(fs_root)
    # Ten files, so that file 1's prefix `derived/1/` sits next to `derived/10/`.
    files = [ready_file(queue, storage) for _ in range(10)]
    (first_id, first_key), (tenth_id, tenth_key) = files[0], files[9]
    assert (first_id, tenth_id) == (1, 10)
    assert queue.request_delete([first_id], actor="test") == [first_id]

    assert sweeper(queue, storage, delete_guard=30.0).run_once().deletions_completed == []
    assert first_key in set(storage.list_keys("originals/"))
    age_deletions(queue.dsn or "", 31)
    report = sweeper(queue, storage, delete_guard=30.0).run_once()
    assert report.deletions_completed == [first_id]
    assert report.objects_deleted == 2 + 2  # two original versions, two derived versions
    assert first_key not in set(storage.list_keys("originals/"))
    assert list(storage.list_keys(derived_prefix(first_id))) == []
    assert queue.file_variants(first_id) == []
    row = queue.file_row(first_id)
    assert row is not None and row["status"] == "deleted"
    # Its neighbours are untouched.
    assert tenth_key in set(storage.list_keys("originals/"))
    assert len(list(storage.list_keys(derived_prefix(tenth_id)))) == 1
    assert len(queue.file_variants(tenth_id)) == 1
    # A second pass finds nothing left to do.
    assert sweeper(queue, storage, delete_guard=0.0).run_once() == SweepReport()


def test_a_second_sweeper_skips_while_one_is_working(
    queue: QueueDB, dsn: str, fs_root: Path
) -> None:
    storage = FsStorage(fs_root)
    _, keys = orphan(queue, storage)
    age_orphans(dsn, 31)
    holder = uuid.uuid4()
    with QueueDB.open(dsn) as other:
        assert other.take_lease("sweep", holder, ttl_s=LEASE)  # another host's sweep runs
        skipped = sweeper(queue, storage).run_once()
        assert skipped.skipped and skipped.orphans_deleted == []
        assert sorted(storage.list_keys("derived/")) == sorted(keys)
    # Its host died without giving the lease back: the lease holds until it expires
    # (aged here, not waited for), then the next pass takes over.
    assert sweeper(queue, storage).run_once().skipped
    sql(dsn, "UPDATE derivd_leases SET until = now() - interval '1 s'")
    report = sweeper(queue, storage).run_once()
    assert not report.skipped
    assert sorted(report.orphans_deleted) == sorted(keys)
    assert sql(dsn, "SELECT * FROM derivd_leases") == []  # given back after the pass


def test_a_sweeper_whose_lease_was_taken_over_stops(
    queue: QueueDB, dsn: str, fs_root: Path
) -> None:
    storage = FsStorage(fs_root)
    first = sweeper(queue, storage)
    assert queue.take_lease("sweep", first.holder, ttl_s=LEASE)
    sql(dsn, "UPDATE derivd_leases SET until = now() - interval '1 s'")  # it stalled
    with QueueDB.open(dsn) as other:
        assert other.take_lease("sweep", uuid.uuid4(), ttl_s=LEASE)
    with pytest.raises(SweepLeaseLost):
        first._renew()


class SlowStore(FsStorage):
    """A store whose every delete takes a minute (of the sweeper's clock): at the second
    one another host's sweep takes the lease over, as it would once ours expired."""

    def __init__(self, root: Path, clock: list[float], steal: Callable[[], None]) -> None:
        super().__init__(root)
        self.clock, self.steal, self.deletes = clock, steal, 0

    def delete_all_versions(self, key: str) -> int:
        self.deletes += 1
        self.clock[0] += 60.0
        if self.deletes == 2:
            self.steal()
        return super().delete_all_versions(key)


def test_the_lease_is_renewed_within_a_batch_and_the_pass_stops_when_it_cannot(
    queue: QueueDB, dsn: str, fs_root: Path
) -> None:
    keys = [k for _ in range(3) for k in orphan(queue, FsStorage(fs_root))[1]]
    age_orphans(dsn, 3600)
    clock = [0.0]

    def steal() -> None:
        sql(dsn, "UPDATE derivd_leases SET holder = gen_random_uuid() WHERE name = 'sweep'")

    store = SlowStore(fs_root, clock, steal)
    pass_ = Sweeper(queue, store, orphan_guard=30.0, delete_guard=30.0, clock=lambda: clock[0])
    report = pass_.run_once()
    # Two deletes (two minutes of a 120 s lease) went through with renewals; the third
    # found the lease gone and stopped the pass, though its batch was not finished.
    assert report.error is not None and "lease" in report.error
    assert store.deletes == 2 and len(report.orphans_deleted) == 2
    assert sorted(storage_keys(fs_root)) == sorted(set(keys) - set(report.orphans_deleted))


def storage_keys(fs_root: Path) -> list[str]:
    return list(FsStorage(fs_root).list_keys("derived/"))


def test_concurrent_sweepers_remove_each_thing_exactly_once(dsn: str, fs_root: Path) -> None:
    with QueueDB.open(dsn) as setup:
        storage = FsStorage(fs_root)
        orphan_keys = [k for _ in range(6) for k in orphan(setup, storage)[1]]
        deleted = [ready_file(setup, storage)[0] for _ in range(4)]
        setup.request_delete(deleted, actor="test")
    age_orphans(dsn, 31)
    age_deletions(dsn, 31)

    reports: list[SweepReport] = []
    start = threading.Barrier(3)

    def sweep_repeatedly() -> None:
        with QueueDB.open(dsn) as queue:
            mine = sweeper(queue, FsStorage(fs_root))
            start.wait()
            for _ in range(5):
                reports.append(mine.run_once())

    threads = [threading.Thread(target=sweep_repeatedly) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads)

    assert [r.error for r in reports if r.error] == []
    removed = [k for r in reports for k in r.orphans_deleted]
    completed = [i for r in reports for i in r.deletions_completed]
    assert sorted(removed) == sorted(orphan_keys)
    assert sorted(completed) == sorted(deleted)
    assert list(storage.list_keys("derived/")) == []
    statuses = {
        r["status"]
        for r in sql(dsn, "SELECT status FROM archive_files WHERE id = ANY(%s)", (deleted,))
    }
    assert statuses == {"deleted"}


def _s3_storage(endpoint_url: str, bucket: str) -> S3Storage:
    storage = S3Storage(bucket=bucket, endpoint_url=endpoint_url, region=TEST_REGION)
    storage._client = boto3.session.Session().client(  # one HTTP try per call
        "s3",
        endpoint_url=endpoint_url,
        region_name=TEST_REGION,
        config=BotoConfig(retries={"max_attempts": 1}, connect_timeout=5, read_timeout=10),
    )
    return storage


def test_storage_outage_stops_the_pass_and_the_next_one_finishes(
    queue: QueueDB,
    s3_bucket: str,
    s3_client: S3Client,
    faulty_s3: tuple[str, FaultProxy],
) -> None:
    url, proxy = faulty_s3
    storage = _s3_storage(url, s3_bucket)
    _, keys = orphan(queue, storage)
    age_orphans(queue.dsn or "", 31)

    proxy.fail(p=1.0, code="ServiceUnavailable")
    failed = sweeper(queue, storage).run_once()
    assert failed.error is not None and "\n" not in failed.error
    assert TEST_SECRET_KEY not in failed.error
    assert failed.orphans_deleted == []
    assert len(sql(queue.dsn or "", "SELECT * FROM pending_objects")) == 2  # not forgotten

    proxy.pass_through()
    report = sweeper(queue, storage).run_once()
    assert report.error is None and sorted(report.orphans_deleted) == sorted(keys)
    versions = s3_client.list_object_versions(Bucket=s3_bucket, Prefix="derived/")
    assert "Versions" not in versions and "DeleteMarkers" not in versions


def test_sweep_once_uses_its_own_connection_and_closes_it(dsn: str, fs_root: Path) -> None:
    if dsn in DIRECT_FOR:
        pytest.skip("a pooler keeps its server connections: pg_stat_activity cannot tell")
    config = make_config(dsn, fs_root=fs_root, sweep={"orphan_guard": 30.0})
    with QueueDB.open(dsn) as queue:
        _, keys = orphan(queue, FsStorage(fs_root))
    age_orphans(dsn, 31)
    report = sweep_once(config, dsn)
    assert sorted(report.orphans_deleted) == sorted(keys)

    def sweep_sessions() -> int:
        return len(
            sql(
                dsn,
                "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'derivd-sweep@%%' "
                "AND datname = current_database()",
            )
        )

    # A backend leaves pg_stat_activity shortly after its client hangs up.
    wait_for(lambda: sweep_sessions() == 0, "the sweep's session to end", 30)


def test_sweep_once_reports_an_unreachable_database(fs_root: Path) -> None:
    config = make_config("host=127.0.0.1 port=1 dbname=nowhere", fs_root=fs_root)
    report = sweep_once(config, config.database.dsn)
    assert report.error is not None and "database unavailable" in report.error
    assert not report.did_something
