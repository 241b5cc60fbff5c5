"""Around the handler: a job's PUTs go out together, in one round trip each, and the
write-ahead record needs no round trip of its own in the steady state, while every PUT
still finds its record in the database first (real PostgreSQL, moto's S3 server, the
fault proxy)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from configs import make_config
from fixtures.faultproxy import FaultProxy
from fixtures.s3 import TEST_REGION
from fixtures.stores import BeforePut, PutsMeet
from fixtures.work import claim_one, make_worker, run_one
from helpers import sql
from PIL import Image

from derivd.handlers.base import Derivation, DeriveSpec, Handler
from derivd.handlers.registry import create_handler
from derivd.ops.enqueue import upload_and_queue
from derivd.ops.sweep import Sweeper
from derivd.queue.db import QueueDB
from derivd.storage import s3 as s3_module
from derivd.storage.base import attempt_prefix, derived_key
from derivd.storage.fs import FsStorage
from derivd.storage.s3 import S3Storage
from derivd.worker_loop import run

pytestmark = pytest.mark.pooler


def jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.linear_gradient("L").resize((320, 240)).convert("RGB").save(buffer, "JPEG")
    return buffer.getvalue()


def enqueue(tmp_path: Path, storage: FsStorage, dsn: str, count: int) -> list[int]:
    paths = []
    for n in range(count):
        path = tmp_path / f"in-{n}.jpg"
        path.write_bytes(jpeg())
        paths.append(path)
    with QueueDB.open(dsn) as queue:
        return upload_and_queue(paths, storage, queue)


def test_a_jobs_puts_are_in_flight_together(dsn: str, fs_root: Path, tmp_path: Path) -> None:
    config = make_config(dsn, fs_root=fs_root, derive={"backend": "pillow"})
    variants = len(config.derive_spec().variants)
    assert variants > 1
    storage = PutsMeet(FsStorage(fs_root), parties=variants)
    enqueue(tmp_path, FsStorage(fs_root), dsn, 1)
    worker = make_worker(config, dsn, storage)
    try:
        result = run_one(worker)  # one after another, the first PUT would wait forever
        assert result is not None and result.outcome == "ready"
        assert not storage.barrier.broken
    finally:
        worker.close()


def test_every_put_finds_its_record_and_the_steady_state_registers_nothing_more(
    dsn: str, fs_root: Path, tmp_path: Path
) -> None:
    """The first job (a claim alone, not flushed) registers its keys as before; the next
    one, claimed by the first one's durable commit, PUTs under its claim's prefix."""
    config = make_config(
        dsn,
        fs_root=fs_root,
        derive={"backend": "pillow"},
        supervisor={"pipeline": 1},  # the second job claimed by the first one's commit
    )
    seen: dict[str, list[str]] = {}

    def look(key: str) -> None:
        token = key.split("/")[2]
        rows = sql(dsn, "SELECT key FROM pending_objects WHERE lease_token = %s", (token,))
        seen.setdefault(token, sorted(r["key"] for r in rows))

    first_id, second_id = enqueue(tmp_path, FsStorage(fs_root), dsn, 2)
    worker = make_worker(config, dsn, BeforePut(FsStorage(fs_root), look))
    try:
        assert run(worker, lambda: False, burst=True) == "drained"
    finally:
        worker.close()
    rows = sql(dsn, "SELECT status FROM archive_files ORDER BY id")
    assert [r["status"] for r in rows] == ["ready", "ready"]
    # The committed attempts' records are gone; before each PUT they were there.
    assert sql(dsn, "SELECT * FROM pending_objects") == []
    first, second = seen  # in PUT order
    assert all(k.startswith(f"derived/{first_id}/{first}/") for k in seen[first])
    assert len(seen[first]) > 1 and not any(k.endswith("/") for k in seen[first])
    assert seen[second] == [f"derived/{second_id}/{second}/"]


def test_an_attempt_that_wrote_under_its_prefix_is_swept_after_the_guard(
    queue: QueueDB, fs_root: Path, tmp_path: Path
) -> None:
    storage = FsStorage(fs_root)
    (file_id,) = enqueue(tmp_path, storage, queue.dsn or "", 1)
    job = claim_one(queue, lease_s=60.0, max_attempts=3)
    assert job is not None
    keys = [derived_key(file_id, job.token, name) for name in ("thumb", "preview")]
    for key in keys:  # the worker died after these PUTs, before registering anything
        storage.put(key, b"x", "image/webp")
    assert queue.fail(job, retry=True, code="processing_failed", max_attempts=3) == "queued"
    dsn = queue.dsn or ""
    sql(dsn, "UPDATE pending_objects SET created_at = created_at - interval '31 s'")
    report = Sweeper(queue, storage, orphan_guard=30.0, delete_guard=30.0).run_once()
    assert report.error is None
    assert report.orphans_deleted == [attempt_prefix(file_id, job.token)]
    assert report.objects_deleted == 2 and list(storage.list_keys("derived/")) == []
    assert sql(dsn, "SELECT * FROM pending_objects") == []


def test_small_puts_take_one_round_trip_and_large_ones_wait_for_continue(
    faulty_s3: tuple[str, FaultProxy], s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, proxy = faulty_s3
    monkeypatch.setattr(s3_module, "NO_CONTINUE_MAX_BYTES", 1000)
    storage = S3Storage(bucket=s3_bucket, endpoint_url=url, region=TEST_REGION)
    storage.put("derived/1/t/small.webp", b"s" * 1000, "image/webp")
    assert proxy.snapshot().get("expect_continue", 0) == 0
    storage.put("derived/1/t/large.webp", b"l" * 1001, "image/webp")
    assert proxy.snapshot()["expect_continue"] == 1


@pytest.mark.parametrize(("backend", "registers"), [("pillow", True), ("noop", False)])
def test_a_claim_registers_the_attempt_prefix_only_for_a_backend_that_stores_objects(
    dsn: str, fs_root: Path, tmp_path: Path, backend: str, registers: bool
) -> None:
    """noop stores nothing: its claims add no registry row (a row and its deletion per
    job for nothing, ~560 B of WAL)."""
    config = make_config(dsn, fs_root=fs_root, derive={"backend": backend})
    (file_id,) = enqueue(tmp_path, FsStorage(fs_root), dsn, 1)
    worker = make_worker(config, dsn)
    try:
        [job] = worker.claim_many(1)
    finally:
        worker.close()
    rows = sql(dsn, "SELECT key FROM pending_objects WHERE lease_token = %s", (job.token,))
    expected = [attempt_prefix(file_id, job.token)] if registers else []
    assert [r["key"] for r in rows] == expected


@pytest.mark.parametrize("write_ahead", [True, False])
def test_a_rederivations_claim_registers_its_prefix_under_the_file_it_derives_for(
    queue: QueueDB, write_ahead: bool
) -> None:
    """A re-derivation's variants go under its file's prefix (the job's own id is not a
    file's): its claim registers that prefix, for the job's row, and nothing for a
    backend that stores nothing."""
    dsn = queue.dsn or ""
    [file] = sql(
        dsn,
        "INSERT INTO archive_files (status, original_key, original_version)"
        " VALUES ('ready', 'originals/r', 'v') RETURNING id",
    )
    [row] = sql(
        dsn,
        "INSERT INTO derivd_rederivations (file_id, original_key, original_version)"
        " VALUES (%s, 'originals/r', 'v') RETURNING id",
        (file["id"],),
    )
    [job] = queue.claim_many(limit=1, lease_s=60.0, max_attempts=3, write_ahead=write_ahead)
    assert (job.id, job.file_id) == (row["id"], file["id"])
    registered = sql(dsn, "SELECT key, file_id, lease_token FROM pending_objects")
    expected = [{"key": attempt_prefix(file["id"], job.token), "file_id": job.id,
                 "lease_token": job.token}]  # fmt: skip
    assert registered == (expected if write_ahead else [])


def test_a_rederivation_rejected_at_its_claim_registers_nothing(queue: QueueDB) -> None:
    """A queued re-derivation whose attempts are used up (max_attempts lowered) is
    rejected by the claim, not leased: no prefix of an attempt that never ran goes to the
    registry, and the claim goes on to the next job."""
    dsn = queue.dsn or ""
    [file] = sql(
        dsn,
        "INSERT INTO archive_files (status, original_key, original_version)"
        " VALUES ('ready', 'originals/r', 'v') RETURNING id",
    )
    [tired, fresh] = sql(
        dsn,
        "INSERT INTO derivd_rederivations (file_id, original_key, original_version, attempts)"
        " VALUES (%s, 'originals/r', 'v', 3), (%s, 'originals/s', 'v', 0) RETURNING id",
        (file["id"], file["id"] + 1000),
    )
    jobs = queue.claim_many(limit=2, lease_s=60.0, max_attempts=3)
    assert [j.id for j in jobs] == [fresh["id"]]
    registered = sql(dsn, "SELECT file_id FROM pending_objects")
    assert registered == [{"file_id": fresh["id"]}]
    [row] = sql(dsn, "SELECT status FROM derivd_rederivations WHERE id = %s", (tired["id"],))
    assert row["status"] == "rejected"


class _StoresUndeclared:
    """A handler that says it stores nothing (as noop does) and returns variants anyway."""

    stores_objects = False

    def __init__(self, inner: Handler) -> None:
        self.inner = inner
        self.name = inner.name

    def derive(self, original: bytes, spec: DeriveSpec) -> Derivation:
        return Derivation.of(self.inner.derive(original, spec))


def test_variants_of_a_handler_that_declared_none_are_registered_before_their_puts(
    dsn: str, fs_root: Path, tmp_path: Path
) -> None:
    config = make_config(
        dsn,
        fs_root=fs_root,
        derive={"backend": "pillow"},
        supervisor={"pipeline": 1},  # the second job claimed by the first one's commit
    )
    pending: dict[str, list[str]] = {}

    def look(key: str) -> None:
        token = key.split("/")[2]
        rows = sql(dsn, "SELECT key FROM pending_objects WHERE lease_token = %s", (token,))
        pending.setdefault(key, [r["key"] for r in rows])

    enqueue(tmp_path, FsStorage(fs_root), dsn, 2)
    handler = _StoresUndeclared(create_handler("pillow", config.derive_spec()))
    worker = make_worker(config, dsn, BeforePut(FsStorage(fs_root), look), handler)
    try:
        assert run(worker, lambda: False, burst=True) == "drained"
    finally:
        worker.close()
    rows = sql(dsn, "SELECT status FROM archive_files ORDER BY id")
    assert [r["status"] for r in rows] == ["ready", "ready"]
    assert len({key.split("/")[2] for key in pending}) == 2  # both jobs PUT
    for key, registered in pending.items():
        assert key in registered  # its own key, durable before its PUT
