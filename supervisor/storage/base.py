"""Object storage: the protocol both stores honour, key rules, and the factory.

Keys are the store's real keys: what a row, a result or a webhook names opens with a
plain GET of the bucket and that key. `[storage] prefix` (s3) is where derivd puts what
it writes (its variants, the originals `derivd enqueue` uploads): part of the keys it
generates here, never added inside a store. An app's original is read under the key the
app PUT. Keys are validated by both stores and at enqueue (`validate_key`, the one
rule): a key a store refuses names no object it can ever read, so it never enters the
queue through derivd, and a worker that meets one (a row inserted by other means)
rejects it at once as `missing_original`.
Every PUT returns the version id it created; reads are always by key and version, so an
original can never change under a job and attempts never overwrite each other's bytes.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from derivd.errors import Permanent, ResourceLimit, Transient

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_KEY_LENGTH = 512
RESERVED_SUFFIX = ".versions"  # the fs store's version directories


class InvalidKey(ValueError):
    """A key that could escape the store or is not one derivd generates."""


class StorageConfigError(Exception):
    """The store cannot be used as configured (e.g. versioning off): refuse to start."""


class StorageUnavailable(Transient):
    """Network, throttling or a 5xx: the request may succeed later."""


class StoreUnwritable(StorageUnavailable):
    """A store that refuses a write (a read-only file system, no permission, a full
    disk), until an operator fixes it. Its message is derivd's own: the path and the
    system's reason, shown whole in the log and on the command line."""

    own_words = True


class ObjectMissing(Permanent):
    """No object under this key and version, or a key the store refuses: retrying cannot
    bring it back, so the row is rejected at once as `missing_original`."""

    def __init__(self, message: str = "") -> None:
        super().__init__("missing_original", message)


@contextmanager
def refused_is_missing() -> Iterator[None]:
    """Around a read: a key the store refuses names no object it holds (ObjectMissing),
    not a fault to retry."""
    try:
        yield
    except InvalidKey as error:
        raise ObjectMissing(f"key refused: {error}") from None


def refuse_oversize(size: int, max_bytes: int | None) -> None:
    if max_bytes is not None and size > max_bytes:
        raise ResourceLimit(f"original is {size} bytes, over the {max_bytes}-byte limit")


def validate_key(key: str) -> str:
    """Accept only relative keys of plain segments: no '..', no absolute path, no NUL.
    The rule of both stores (fs and s3, under its prefix) and of every enqueue."""
    if not key or len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(f"key is empty or longer than {MAX_KEY_LENGTH} characters")
    if "\x00" in key or key.startswith("/") or "\\" in key:
        raise InvalidKey("key holds NUL, a backslash or starts with '/'")
    for segment in key.split("/"):
        if not _SEGMENT.match(segment) or segment.endswith(RESERVED_SUFFIX):
            raise InvalidKey(
                f"key segment {segment[:40]!r} is not allowed (segments are 1-128 of "
                f"A-Z a-z 0-9 . _ -, start with a letter or digit, do not end with "
                f"{RESERVED_SUFFIX!r})"
            )
    return key


def prefix_problem(prefix: str) -> str | None:
    """Why `prefix` cannot start keys (None: it can): empty, or segments a key may hold."""
    try:
        validate_key(prefix + "x")
    except InvalidKey as error:
        return str(error)
    return None


def new_original_key(prefix: str = "") -> str:
    return f"{prefix}originals/{uuid.uuid4().hex}"


def derived_prefix(file_id: int, prefix: str = "") -> str:
    return f"{prefix}derived/{file_id}/"


# Every object of one attempt lies under this prefix (file id, lease token) after the
# store's `prefix`; the claim registers it write-ahead in SQL (`claim` in
# sql/queries.sql fills it with format()), so the orphan sweep can delete what a crashed
# attempt wrote. (A prefix holds no `%`: validate_key.)
ATTEMPT_PREFIX_FORMAT = "derived/%s/%s/"


def attempt_prefix_format(prefix: str = "") -> str:
    return prefix + ATTEMPT_PREFIX_FORMAT


def attempt_prefix(file_id: int, token: uuid.UUID, prefix: str = "") -> str:
    return attempt_prefix_format(prefix) % (file_id, token)


def derived_key(
    file_id: int, token: uuid.UUID, variant: str, extension: str = "webp", prefix: str = ""
) -> str:
    """Unique per attempt: the lease token is part of the key; one key per variant and
    format (`thumb.avif`, `thumb.webp`)."""
    return validate_key(f"{attempt_prefix(file_id, token, prefix)}{variant}.{extension}")


# Derived keys are never written twice (the lease token is in the key), so caches and
# browsers may keep them forever.
IMMUTABLE = "public, max-age=31536000, immutable"


def cache_control(key: str, prefix: str = "") -> str | None:
    """The Cache-Control a store sends with `key` (under its `prefix`): immutable for
    derivatives only."""
    return IMMUTABLE if key.startswith(prefix + "derived/") else None


@dataclass(frozen=True)
class StoreName:
    """Where derivd's objects live, as an app and a webhook receiver name them: the
    backend, the bucket (s3; None for fs) and the prefix of the keys derivd writes."""

    backend: str
    bucket: str | None
    prefix: str


class Storage(Protocol):
    name: str
    prefix: str  # what the keys derivd generates for this store start with

    def check(self) -> None:
        """Raise StorageConfigError when the store cannot keep versions (start-up)."""

    def put(self, key: str, data: bytes, content_type: str, *, sha256: str | None = None) -> str:
        """Store bytes under key; return the new version id. `sha256`, the hex digest of
        `data` when the caller has it already, lets a store that checks integrity use it
        instead of hashing the bytes again."""

    def get(self, key: str, version: str, *, max_bytes: int | None = None) -> bytes:
        """The bytes of exactly this version. ObjectMissing when there is none, for good
        (no such key or version, or a key the store refuses); StorageUnavailable when
        the store cannot answer now.

        Larger than max_bytes: ResourceLimit, raised before the body is read.
        """

    def delete_all_versions(self, key: str) -> int:
        """Remove every version of key (and of keys under it when it ends with '/')."""

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        """Keys that have at least one version, under prefix."""
