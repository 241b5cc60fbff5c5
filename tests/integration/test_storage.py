"""S3 on moto's server over HTTP: version semantics, missing objects and buckets, outages.
The key rules and the fs store: tests/unit/test_fs_store.py."""

from __future__ import annotations

import base64
import hashlib
import uuid

import pytest

from derivd.errors import ResourceLimit
from derivd.storage.base import (
    ObjectMissing,
    StorageConfigError,
    StorageUnavailable,
)
from derivd.storage.s3 import S3Storage


def test_s3_reads_of_what_is_not_there_are_missing_for_good(  # type: ignore[no-untyped-def]
    s3_server, s3_bucket: str
) -> None:
    store = s3_store(s3_server.endpoint_url, s3_bucket, prefix="derivd/")
    version = store.put("originals/abc", b"one", "application/octet-stream")
    other = store.put("originals/other", b"two", "application/octet-stream")
    for key, wanted in [
        ("originals/missing", version),  # no such key
        ("originals/abc", other),  # no such version of this key
        ("../../etc/passwd", version),  # a key the store refuses
        ("/abs.jpg", version),
        ("originals/My Photo.jpg", version),
    ]:
        with pytest.raises(ObjectMissing) as missing:
            store.get(key, wanted)
        assert missing.value.code == "missing_original", key


def test_a_missing_bucket_is_an_outage_not_a_missing_original(  # type: ignore[no-untyped-def]
    s3_server,
) -> None:
    store = s3_store(s3_server.endpoint_url, f"derivd-absent-{uuid.uuid4().hex[:12]}")
    with pytest.raises(StorageUnavailable):
        store.get("originals/abc", "v1")


def s3_store(endpoint: str, bucket: str, prefix: str = "") -> S3Storage:
    return S3Storage(bucket=bucket, endpoint_url=endpoint, region="us-east-1", prefix=prefix)


def test_s3_round_trip_by_version(s3_server, s3_bucket: str) -> None:  # type: ignore[no-untyped-def]
    store = s3_store(s3_server.endpoint_url, s3_bucket, prefix="derivd/")
    store.check()
    v1 = store.put("originals/abc", b"one", "application/octet-stream")
    v2 = store.put("originals/abc", b"two", "application/octet-stream")
    assert v1 != v2
    assert store.get("originals/abc", v1) == b"one"
    assert store.get("originals/abc", v2) == b"two"
    with pytest.raises(ResourceLimit):
        store.get("originals/abc", v2, max_bytes=1)
    with pytest.raises(ObjectMissing):
        store.get("originals/missing", v1)
    assert list(store.list_keys("originals/")) == ["originals/abc"]
    assert store.delete_all_versions("originals/abc") == 2
    assert list(store.list_keys()) == []


def test_s3_put_sends_our_sha256_instead_of_hashing_again(  # type: ignore[no-untyped-def]
    s3_server, s3_bucket: str
) -> None:
    """The digest the worker took at encode time goes with the PUT as S3's SHA-256
    checksum (S3 checks the body against it and keeps it with the object; moto does
    neither, so this holds what derivd sends): botocore adds no checksum of its own."""
    store = s3_store(s3_server.endpoint_url, s3_bucket)
    sent: list[dict[str, str | bytes]] = []
    store.client.meta.events.register(
        "before-send.s3.PutObject",
        lambda request, **_: sent.append({k.lower(): v for k, v in request.headers.items()}),
    )
    data = b"variant bytes"
    digest = hashlib.sha256(data).hexdigest()
    store.put("derived/1/t/thumb.webp", data, "image/webp", sha256=digest)
    store.put("originals/abc", data, "image/jpeg")
    with_digest, without = sent
    assert base64.b64decode(with_digest["x-amz-checksum-sha256"]).hex() == digest
    assert not any(k.startswith("x-amz-checksum-crc") for k in with_digest)
    assert "x-amz-checksum-sha256" not in without  # no digest given: botocore's own


def test_s3_refuses_a_bucket_without_versioning(  # type: ignore[no-untyped-def]
    s3_server, s3_bucket_unversioned: str
) -> None:
    store = s3_store(s3_server.endpoint_url, s3_bucket_unversioned)
    with pytest.raises(StorageConfigError, match="versioning off"):
        store.check()


def test_s3_outage_is_transient(faulty_s3, s3_bucket: str) -> None:  # type: ignore[no-untyped-def]
    url, proxy = faulty_s3
    store = s3_store(url, s3_bucket)
    version = store.put("originals/abc", b"one", "x")
    proxy.fail(p=1.0)
    with pytest.raises(StorageUnavailable):
        store.get("originals/abc", version)
    proxy.reset_connections(p=1.0)
    with pytest.raises(StorageUnavailable):
        store.put("originals/abc", b"two", "x")
    proxy.pass_through()
    assert store.get("originals/abc", version) == b"one"
