"""`fs`: a directory store with S3's version semantics, for one host and the demo.

Layout: `<root>/<key>.versions/<version id><the key's extension>`, e.g.
`derived/7/<token>/preview.webp.versions/0001764…a3f1.webp`: every stored object keeps
its key's extension, so a person browsing the store opens it as what it is (a WebP in an
image viewer). A version id sorts by creation time; each PUT writes a temporary file and
renames it into place, so a reader never sees half an object. Keys are validated and
resolved paths are checked to stay inside the root.

The layout is a contract (README, "From any other language"): an app in any language
stores an original by writing `<root>/<key>.versions/.tmp-…`, syncing it, and renaming it
to `<version><the key's extension>` (a version id of letters and digits, new per write),
then INSERTs the key and that version. tests/node/upload.mjs does exactly that.

Durable before it answers: a PUT returns a version id the commit then records, so the
object must survive a power loss from that moment. The file's bytes are fsynced before
the rename, and the rename lives in its directory, which is fsynced after it; so is the
parent of every directory the PUT created (a new directory's entry is its parent's data).
`sync_dir` is that fsync, a seam tests observe.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

from derivd.storage.base import (
    RESERVED_SUFFIX,
    InvalidKey,
    ObjectMissing,
    StorageConfigError,
    StoreUnwritable,
    refuse_oversize,
    refused_is_missing,
    validate_key,
)


def fsync_dir(path: Path) -> None:
    """Make `path`'s entries (a rename into it, a directory made in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(folder: Path) -> list[Path]:
    """`folder` and its missing parents, made one by one; returns the directories whose
    entries changed (the parent of each one made), outermost first. Another writer making
    one of them at the same time is fine: its entry is then that writer's to sync, and
    syncing it here as well costs one fsync."""
    missing: list[Path] = []
    probe = folder
    while not probe.is_dir():
        missing.append(probe)
        probe = probe.parent
    changed = []
    for path in reversed(missing):
        path.mkdir(exist_ok=True)
        changed.append(path.parent)
    return changed


def _reason(error: OSError) -> str:
    return error.strerror or type(error).__name__


@contextlib.contextmanager
def _writing(where: Path) -> Iterator[None]:
    """Around a write: an OSError (a read-only file system, no permission, a full disk)
    becomes one line naming the path and the reason, in derivd's own words, so the log
    and the command line can show it whole. Transient: an operator can fix it."""
    try:
        yield
    except OSError as error:
        raise StoreUnwritable(f"fs store: cannot write {where}: {_reason(error)}") from None


class FsStorage:
    name = "fs"
    prefix = ""  # keys derivd generates start at the root

    def __init__(self, root: Path, *, sync_dir: Callable[[Path], None] = fsync_dir) -> None:
        self.root = root.resolve()
        self.sync_dir = sync_dir

    def check(self) -> None:
        """The root exists and takes a file (written and removed): a read-only or foreign
        directory is refused at start-up, in one line, not at the first PUT."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.root, prefix=".probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as error:
            raise StorageConfigError(
                f"fs store {self.root} is not writable: {_reason(error)} "
                "(set [storage] root to a directory this user can write)"
            ) from None

    def _versions_dir(self, key: str) -> Path:
        path = (self.root / (validate_key(key.rstrip("/")) + RESERVED_SUFFIX)).resolve()
        if not path.is_relative_to(self.root):
            raise InvalidKey("key resolves outside the store")
        return path

    def put(self, key: str, data: bytes, content_type: str, *, sha256: str | None = None) -> str:
        folder = self._versions_dir(key)
        version = f"{time.time_ns():020d}{secrets.token_hex(4)}"
        with _writing(folder):
            made = make_dirs(folder)
            temp = folder / f".tmp-{version}"
            with temp.open("wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, folder / (version + PurePosixPath(key).suffix))
            for changed in (*made, folder):
                self.sync_dir(changed)
        return version

    def get(self, key: str, version: str, *, max_bytes: int | None = None) -> bytes:
        with refused_is_missing():
            path = self.path_of(key, version)
        try:
            refuse_oversize(path.stat().st_size, max_bytes)
            return path.read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            # NotADirectory: a segment of the key is another key's file; IsADirectory:
            # the "version" names a folder. Either way no such object, for good.
            raise ObjectMissing("no such key or version") from None

    def delete_all_versions(self, key: str) -> int:
        if key.endswith("/"):
            folder = (self.root / validate_key(key.rstrip("/"))).resolve()
            if not folder.is_relative_to(self.root) or not folder.is_dir():
                return 0
            return _remove_tree(folder)
        return _remove_tree(self._versions_dir(key))

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        for folder in sorted(self.root.rglob(f"*{RESERVED_SUFFIX}")):
            key = folder.relative_to(self.root).as_posix().removesuffix(RESERVED_SUFFIX)
            if key.startswith(prefix) and any(not p.name.startswith(".") for p in folder.iterdir()):
                yield key

    def path_of(self, key: str, version: str) -> Path:
        """Where a version lives on disk (get, the demo summary, tests)."""
        if not version or not version.isalnum():
            raise ObjectMissing("no such version")
        folder = self._versions_dir(key)
        path = folder / (version + PurePosixPath(key).suffix)
        # Stores written before versions kept the extension name them by id alone.
        legacy = folder / version
        return legacy if not path.exists() and legacy.exists() else path


def _remove_tree(folder: Path) -> int:
    """Delete a folder of versions; idempotent, so two cleaners racing is harmless."""
    if not folder.is_dir():
        return 0
    count = sum(1 for entry in folder.rglob("*") if entry.is_file())
    shutil.rmtree(folder, ignore_errors=True)
    return count
