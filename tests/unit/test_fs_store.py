"""The key rules and the fs store on a local folder: versions, extensions, prefix deletes,
durable renames, no way out of the root. S3 on moto's server: tests/integration/test_storage.py."""

from __future__ import annotations

import io
import uuid
from pathlib import Path

import pytest
from PIL import Image

from derivd.errors import ResourceLimit
from derivd.storage.base import (
    InvalidKey,
    ObjectMissing,
    derived_key,
    derived_prefix,
    new_original_key,
    validate_key,
)
from derivd.storage.fs import FsStorage, fsync_dir, make_dirs

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


def test_fs_version_ids_and_prefix_deletes_cannot_escape(fs_root: Path, tmp_path: Path) -> None:
    """Neither the version id (read from the database) nor the prefix form of
    delete_all_versions leads out of the root."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    store = FsStorage(fs_root)
    key = "originals/" + "ab" * 16
    store.put(key, b"x", "image/png")
    for version in ("../../victim", "..", "/etc/passwd", "a/b", ""):
        with pytest.raises(ObjectMissing):
            store.get(key, version)
    for prefix in ("../", "../../", "/", "originals/../../"):
        with pytest.raises(InvalidKey):
            store.delete_all_versions(prefix)
    assert victim.read_bytes() == b"keep me"
