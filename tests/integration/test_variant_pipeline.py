"""Variants through the whole worker: one object per variant and format, with its
Content-Type and an immutable Cache-Control, recorded with its format (primary first)."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest
from configs import make_config
from fixtures.work import enqueue_bytes, make_worker, run_one
from imagegen import jpeg
from PIL import Image

from derivd.config import Config, VariantSettings
from derivd.storage.configured import open_storage

SECTIONS = {
    "card": VariantSettings(size="300x200", fit="cover", format="avif, webp, jpeg"),
    "sq": VariantSettings(size="64x64", fit="cover", gravity="entropy", format="png"),
}
EXPECTED = [  # (name, format, extension, content type, width, height), in listed order
    ("card", "avif", "avif", "image/avif", 300, 200),
    ("card", "webp", "webp", "image/webp", 300, 200),
    ("card", "jpeg", "jpg", "image/jpeg", 300, 200),
    ("thumb", "webp", "webp", "image/webp", 160, 120),
    ("sq", "png", "png", "image/png", 64, 64),
]
PIL_FORMAT = {"avif": "AVIF", "webp": "WEBP", "jpeg": "JPEG", "png": "PNG"}


def with_sections(config: Config) -> Config:
    config = config.replace("derive", variants="card, thumb:160, sq")
    return dataclasses.replace(config, variant_sections=SECTIONS)


@pytest.mark.parametrize("backend", ["vips", "pillow"])
def test_every_variant_and_format_is_stored_and_recorded(  # type: ignore[no-untyped-def]
    backend: str, dsn: str, s3_server, s3_bucket: str, s3_client, tmp_path: Path
) -> None:
    config = with_sections(make_config(
        dsn, s3={"bucket": s3_bucket, "endpoint_url": s3_server.endpoint_url,
                 "region": "us-east-1", "prefix": "t/"},
        derive={"backend": backend}))  # fmt: skip
    worker = make_worker(config, dsn)
    (file_id,) = enqueue_bytes(tmp_path, worker.storage, dsn, {"a.jpg": jpeg(640, 480)})
    result = run_one(worker)
    assert result is not None and result.outcome == "ready"
    job_token = result.job.token
    stored = {(v.name, v.format): v for v in worker.queue.file_variants(file_id)}
    assert sorted(stored) == sorted((name, fmt) for name, fmt, *_ in EXPECTED)
    for name, fmt, ext, content_type, width, height in EXPECTED:
        v = stored[(name, fmt)]
        # the store's real key, its prefix included: a plain GET of it opens the object
        assert v.key == f"t/derived/{file_id}/{job_token}/{name}.{ext}"
        assert (v.content_type, v.width, v.height) == (content_type, width, height)
        head = s3_client.head_object(Bucket=s3_bucket, Key=v.key, VersionId=v.version)
        assert head["ContentType"] == content_type
        assert head["CacheControl"] == "public, max-age=31536000, immutable"
        data = worker.storage.get(v.key, v.version)
        assert v.bytes == len(data)  # the stored object's size, recorded at commit
        with Image.open(io.BytesIO(data)) as im:
            assert (im.format, im.size) == (PIL_FORMAT[fmt], (width, height))
    row = worker.queue.file_row(file_id)
    assert row is not None and row["derived_key"] == stored[("card", "avif")].key  # primary
    worker.close()


def test_originals_get_no_immutable_cache_control(  # type: ignore[no-untyped-def]
    dsn: str, s3_server, s3_bucket: str, s3_client, tmp_path: Path
) -> None:
    config = make_config(dsn, s3={"bucket": s3_bucket, "endpoint_url": s3_server.endpoint_url,
                                  "region": "us-east-1"})  # fmt: skip
    storage = open_storage(config)
    enqueue_bytes(tmp_path, storage, dsn, {"a.jpg": jpeg(64, 48)})
    (key,) = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert "CacheControl" not in s3_client.head_object(Bucket=s3_bucket, Key=key)
