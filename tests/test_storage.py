"""Both stores: version semantics, key rules, and S3 on moto's server over HTTP."""

from __future__ import annotations

import base64
import hashlib
import io
import uuid
from pathlib import Path

import pytest
from PIL import Image

from derivd.errors import ResourceLimit
from derivd.storage.base import (
    InvalidKey,
    ObjectMissing,
    StorageConfigError,
    StorageUnavailable,
    derived_key,
    derived_prefix,
    new_original_key,
    validate_key,
)
from derivd.storage.fs import FsStorage, fsync_dir, make_dirs
from derivd.storage.s3 import S3Storage

ESCAPES = [
    "../etc/passwd",
    "originals/../../x",
    "/etc/passwd",
    "originals/\x00evil",
    "originals//x",
    "originals/.hidden",
    "originals\\..\\x",
    "",
    "a" * 600,
    "originals/x.versions/y",
]


@pytest.mark.parametrize("key", [*ESCAPES, "My Photo.jpg", "originals/a b"])
def test_keys_that_could_escape_are_refused(key: str, fs_root: Path) -> None:
    store = FsStorage(fs_root)
    with pytest.raises(InvalidKey):
        validate_key(key)
    with pytest.raises(InvalidKey):
        store.put(key, b"x", "image/webp")
    # Read, such a key names no object the store could ever hold: missing for good.
    with pytest.raises(ObjectMissing) as missing:
        store.get(key, "1")
    assert missing.value.code == "missing_original"
    assert not any(p.is_file() for p in fs_root.parent.rglob("*") if fs_root not in p.parents)


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


def test_symlinked_folder_cannot_lead_outside(fs_root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (fs_root / "originals").symlink_to(outside)
    with pytest.raises(InvalidKey):
        FsStorage(fs_root).put("originals/abc", b"x", "image/webp")
    assert list(outside.iterdir()) == []


def test_generated_keys_are_valid_and_unique_per_attempt() -> None:
    token_a, token_b = uuid.uuid4(), uuid.uuid4()
    assert validate_key(new_original_key()) != validate_key(new_original_key())
    key_a = derived_key(7, token_a, "thumb")
    assert key_a.startswith(derived_prefix(7)) and key_a.endswith("/thumb.webp")
    assert key_a != derived_key(7, token_b, "thumb")


def test_fs_keeps_every_version(fs_root: Path) -> None:
    store = FsStorage(fs_root)
    v1 = store.put("originals/abc", b"one", "x")
    v2 = store.put("originals/abc", b"two", "x")
    assert v1 != v2
    assert store.get("originals/abc", v1) == b"one"
    assert store.get("originals/abc", v2) == b"two"
    with pytest.raises(ObjectMissing):
        store.get("originals/abc", "0" * 28)
    with pytest.raises(ResourceLimit):
        store.get("originals/abc", v1, max_bytes=2)
    assert list(store.list_keys()) == ["originals/abc"]
    assert store.delete_all_versions("originals/abc") == 2
    assert list(store.list_keys()) == []


def test_fs_objects_keep_their_key_extension_on_disk(fs_root: Path) -> None:
    # A person browsing the store must find .webp files that open as WebP.
    store = FsStorage(fs_root)
    key = derived_key(3, uuid.uuid4(), "preview")
    image = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(image, "WEBP")
    versions = [store.put(key, image.getvalue(), "image/webp") for _ in range(2)]
    on_disk = sorted(fs_root.rglob("*.webp"))
    assert on_disk == sorted(store.path_of(key, v) for v in versions)
    for path in on_disk:
        assert path.is_relative_to(fs_root) and path.is_file()
        with Image.open(path) as im:
            assert im.format == "WEBP"
    assert [store.get(key, v) for v in versions] == [image.getvalue()] * 2
    with pytest.raises(ObjectMissing):
        store.get(key, versions[0] + ".webp")  # a version id, not a file name
    assert list(store.list_keys("derived/")) == [key]


def test_fs_reads_versions_stored_before_they_kept_the_extension(fs_root: Path) -> None:
    store = FsStorage(fs_root)
    key = derived_key(4, uuid.uuid4(), "preview")
    folder = fs_root / (key + ".versions")
    folder.mkdir(parents=True)
    (folder / "0001abc").write_bytes(b"old layout")
    assert store.get(key, "0001abc") == b"old layout"


def test_fs_prefix_delete_removes_all_attempts(fs_root: Path) -> None:
    store = FsStorage(fs_root)
    for token in (uuid.uuid4(), uuid.uuid4()):
        store.put(derived_key(9, token, "thumb"), b"w", "image/webp")
    store.put(derived_key(10, uuid.uuid4(), "thumb"), b"w", "image/webp")
    assert store.delete_all_versions(derived_prefix(9)) == 2
    assert [k.split("/")[1] for k in store.list_keys("derived/")] == ["10"]


class SyncLog:
    """FsStorage's directory fsync, observed: each directory it syncs (the real fsync
    still runs) and what that directory held at that moment."""

    def __init__(self) -> None:
        self.synced: list[Path] = []
        self.entries: list[set[str]] = []

    def __call__(self, path: Path) -> None:
        self.entries.append({p.name for p in path.iterdir()})
        self.synced.append(path)
        fsync_dir(path)


def test_fs_put_syncs_the_rename_and_every_new_directory(fs_root: Path) -> None:
    """A PUT's version id is recorded by the commit: the object's directory entries must
    be durable when put returns. Without these fsyncs a power loss can
    leave a `ready` row naming a file that never reached the disk."""
    log = SyncLog()
    store = FsStorage(fs_root, sync_dir=log)
    key = "derived/7/tok/preview.webp"
    folder = fs_root / (key + ".versions")
    version = store.put(key, b"one", "image/webp")
    # Every directory the PUT made is in its parent's entries: each parent is synced,
    # then the versions folder, after the rename (the final name is there, no temp).
    assert log.synced == [fs_root, fs_root / "derived", fs_root / "derived/7",
                          fs_root / "derived/7/tok", folder]  # fmt: skip
    assert log.entries[-1] == {version + ".webp"}
    assert log.entries[0] == {"derived"}

    log.synced.clear()
    second = store.put(key, b"two", "image/webp")
    assert log.synced == [folder]  # nothing new above it: one fsync
    assert version + ".webp" in log.entries[-1] and second + ".webp" in log.entries[-1]

    log.synced.clear()
    store.put("derived/7/tok/thumb.webp", b"three", "image/webp")
    assert log.synced == [fs_root / "derived/7/tok", fs_root / "derived/7/tok/thumb.webp.versions"]


def test_fs_make_dirs_reports_the_parents_it_changed(fs_root: Path) -> None:
    made = make_dirs(fs_root / "a" / "b")
    assert made == [fs_root, fs_root / "a"]
    assert (fs_root / "a" / "b").is_dir()
    assert make_dirs(fs_root / "a" / "b") == []


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
