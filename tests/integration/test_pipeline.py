"""The whole path in one process: claim -> GET -> derive -> PUT -> fenced commit."""

from __future__ import annotations

import hashlib
import io
import logging
from pathlib import Path

import pytest
from configs import make_config
from fixtures.work import enqueue_bytes, make_worker, run_job, run_one
from PIL import Image

from derivd.worker_loop import run


def jpeg(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.linear_gradient("L").resize((width, height)).convert("RGB").save(buffer, "JPEG")
    return buffer.getvalue()


@pytest.mark.parametrize("backend", ["vips", "pillow"])
def test_good_image_becomes_ready_with_every_variant(
    backend: str, dsn: str, fs_root: Path, tmp_path: Path
) -> None:
    config = make_config(dsn, fs_root=fs_root, derive={"backend": backend})
    worker = make_worker(config, dsn)
    (file_id,) = enqueue_bytes(tmp_path, worker.storage, dsn, {"a.jpg": jpeg(2000, 1000)})
    result = run_one(worker)
    assert result is not None and result.outcome == "ready"
    row = worker.queue.file_row(file_id)
    assert row is not None and row["status"] == "ready" and row["error_code"] is None
    variants = worker.queue.file_variants(file_id)
    assert [(v.name, v.width, v.height) for v in variants] == [
        ("preview", 1600, 800),
        ("thumb", 320, 160),
    ]
    assert row["derived_key"] == variants[0].key and row["sha256"] == variants[0].sha256
    for stored in variants:
        data = worker.storage.get(stored.key, stored.version)
        assert hashlib.sha256(data).hexdigest() == stored.sha256
        assert Image.open(io.BytesIO(data)).format == "WEBP"
        assert str(row["lease_token"]) not in stored.key  # lease cleared, key kept its token
    worker.close()


def test_corrupt_image_is_rejected_with_a_safe_code(
    dsn: str, fs_root: Path, tmp_path: Path
) -> None:
    config = make_config(dsn, fs_root=fs_root)
    worker = make_worker(config, dsn)
    good = jpeg(300, 200)
    ids = enqueue_bytes(
        tmp_path,
        worker.storage,
        dsn,
        {"truncated.jpg": good[: len(good) // 2], "page.jpg": b"<html>not an image</html>"},
    )
    outcomes = [run_one(worker) for _ in ids]
    assert [r.outcome for r in outcomes if r] == ["rejected", "rejected"]
    codes = [worker.queue.file_row(i)["error_code"] for i in ids]  # type: ignore[index]
    assert codes == ["corrupt_content", "unsupported_content"]
    assert list(worker.storage.list_keys("derived/")) == []
    worker.close()


def test_late_attempt_loses_and_its_objects_are_never_referenced(
    dsn: str, fs_root: Path, tmp_path: Path
) -> None:
    config = make_config(dsn, fs_root=fs_root, derive={"backend": "pillow"})
    worker_a, worker_b = make_worker(config, dsn), make_worker(config, dsn)
    (file_id,) = enqueue_bytes(tmp_path, worker_a.storage, dsn, {"a.jpg": jpeg(800, 600)})
    job_a = worker_a.claim_many(1)[0]
    assert job_a is not None
    worker_a.queue.conn.execute(
        "UPDATE archive_files SET lease_until = now() - interval '1 s' WHERE id = %s", (file_id,)
    )
    job_b = worker_b.claim_many(1)[0]
    assert job_b is not None and job_b.id == file_id

    assert run_job(worker_a, job_a).outcome == "lease_lost"
    assert run_job(worker_b, job_b).outcome == "ready"

    referenced = {v.key for v in worker_b.queue.file_variants(file_id)}
    assert all(str(job_b.token) in key for key in referenced)
    written_by_a = {k for k in worker_a.storage.list_keys("derived/") if str(job_a.token) in k}
    assert written_by_a and not (written_by_a & referenced)
    pending = worker_a.queue.conn.execute(
        "SELECT key FROM pending_objects WHERE lease_token = %s", (job_a.token,)
    ).fetchall()
    assert {r[0] for r in pending} == written_by_a  # left for the orphan sweep
    kinds = [
        r[0]
        for r in worker_a.queue.conn.execute(
            "SELECT kind FROM archive_events WHERE file_id = %s ORDER BY id", (file_id,)
        )
    ]
    assert kinds == ["lease_lost", "ready"]
    worker_a.close()
    worker_b.close()


def test_s3_pipeline_reads_originals_by_version(
    dsn: str,
    s3_server,
    s3_bucket: str,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    config = make_config(
        dsn,
        s3={
            "bucket": s3_bucket,
            "endpoint_url": s3_server.endpoint_url,
            "region": "us-east-1",
            "prefix": "t/",
        },
        derive={"backend": "vips", "variants": "thumb:64"},
    )
    worker = make_worker(config, dsn)
    (file_id,) = enqueue_bytes(tmp_path, worker.storage, dsn, {"a.jpg": jpeg(640, 480)})
    row = worker.queue.file_row(file_id)
    assert row is not None
    # Overwrite the original: the job must still derive the confirmed version.
    worker.storage.put(row["original_key"], b"garbage", "application/octet-stream")
    result = run_one(worker)
    assert result is not None and result.outcome == "ready"
    (thumb,) = worker.queue.file_variants(file_id)
    assert (thumb.width, thumb.height) == (64, 48)
    assert worker.storage.get(thumb.key, thumb.version)[:4] == b"RIFF"
    worker.close()


def test_noop_commits_ready_without_objects(dsn: str, fs_root: Path, tmp_path: Path) -> None:
    config = make_config(dsn, fs_root=fs_root, derive={"backend": "noop"})
    worker = make_worker(config, dsn)
    (file_id,) = enqueue_bytes(tmp_path, worker.storage, dsn, {"a.bin": b"anything"})
    assert run(worker, lambda: False, burst=True) == "drained"
    row = worker.queue.file_row(file_id)
    assert row is not None and row["status"] == "ready" and row["derived_key"] is None
    worker.close()


@pytest.mark.parametrize(
    ("backend", "pipelined"), [("noop", False), ("faulthandlers:Stamped", True)]
)
def test_a_pipeline_holds_jobs_only_for_a_backend_with_round_trips_to_overlap(
    dsn: str,
    fs_root: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    backend: str,
    pipelined: bool,
) -> None:
    """At `pipeline = 2`, `noop` (no GET, no PUT) runs the loop at depth 1; a backend
    that stores runs it at depth 2. Either logs where its time went as it stops."""
    config = make_config(
        dsn, fs_root=fs_root, derive={"backend": backend}, supervisor={"pipeline": 2}
    )
    worker = make_worker(config, dsn)
    ids = enqueue_bytes(tmp_path, worker.storage, dsn, {f"{n}.txt": b"ok" for n in range(3)})
    with caplog.at_level(logging.INFO, logger="derivd"):
        assert run(worker, lambda: False, burst=True) == "drained"
    assert [worker.queue.file_row(i)["status"] for i in ids] == ["ready"] * 3  # type: ignore[index]
    assert worker.depth == (2 if pipelined else 1)
    assert any("pipeline time" in r.getMessage() for r in caplog.records)
    worker.close()
