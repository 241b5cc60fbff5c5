"""`derivd.client`: what a Python upload API needs, on connections it owns.

    file_id = enqueue(conn, key, version)     # after the PUT to the versioned bucket
    status = wait(conn, file_id, timeout=30)  # 'ready', 'rejected', ... or None
    done = result(conn, file_id)              # status, error code, variants, original
    ids = similar(conn, file_id)              # ready files that look the same (dhash)
    delete(conn, file_id)                     # as `derivd delete`: 'deleting' or 'deleted'

Keys are the store's real keys: `enqueue` takes the key the app PUT (with any prefix it
PUT under), and every key a result names opens with a plain GET of its bucket and key.

Connections: any psycopg 3 connection, in autocommit mode or not.

- autocommit: each call is its own statement, visible to derivd at once.
- not autocommit: `enqueue` and `result` run inside the caller's transaction (the row is
  claimable, and the wake-up sent, when the caller commits). `wait` needs the connection
  outside a transaction (PostgreSQL delivers notifications only between transactions):
  it raises ConnectionBusy otherwise, and commits the short transactions it opens itself.

`wait` registers the file it waits for (only registered files are announced:
archive_files_notify_finished in sql/functions.sql), LISTENs on CHANNEL
(`derivd_finished`; the payload is the row id only), reads the row, and sleeps on the
connection until the row's id arrives, so a file that finished before `wait` began is
seen by the read. It reads the row again every RECHECK_S seconds: a
finish committed by a transaction that began before the registration was visible is not
announced, and is seen by that read. Through a
transaction-mode pooler (PgBouncer) LISTEN does not work: give `wait` a direct
connection. It UNLISTENs before returning, and expects no notify handler on the
connection (psycopg >= 3.2.4 then keeps notifications that arrive during a query for
`notifies()`; with a handler it hands them to the handler only).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from derivd.priorities import DEFAULT_PRIORITY, priority_problem, tenant_problem
from derivd.queue.db import FINISHED_CHANNEL as CHANNEL
from derivd.queue.db import QueueDB
from derivd.storage.base import InvalidKey

# Longest a finish goes unseen when it raced the registration (see the module docstring).
RECHECK_S = 1.0
# `deleting` counts: a file on its way out will never become ready.
FINAL = frozenset({"ready", "rejected", "deleting", "deleted"})

__all__ = [
    "CHANNEL",
    "FINAL",
    "ClientError",
    "ConnectionBusy",
    "InvalidContext",
    "InvalidKey",
    "InvalidPriority",
    "InvalidTenant",
    "MissingVersion",
    "Original",
    "Result",
    "UnknownFile",
    "Variant",
    "delete",
    "enqueue",
    "result",
    "similar",
    "wait",
]


class ClientError(Exception):
    """Base class of the errors derivd.client raises for wrong use."""


class MissingVersion(ClientError, ValueError):
    """enqueue without the original's version id."""


class InvalidPriority(ClientError, ValueError):
    """A priority outside -100..100 (derivd.priorities), or not a whole number."""


class InvalidTenant(ClientError, ValueError):
    """A tenant longer than 200 characters, empty, or with control characters."""


class InvalidContext(ClientError, ValueError):
    """An external id or metadata outside their bounds (derivd_app_context_problem in
    sql/functions.sql: the message says which), or metadata that is not JSON."""


class UnknownFile(ClientError, LookupError):
    """No row has this id."""


class ConnectionBusy(ClientError):
    """wait() on a connection inside a transaction: no notification could arrive."""


@dataclass(frozen=True)
class Variant:
    name: str
    key: str
    version: str
    format: str
    width: int
    height: int
    sha256: str
    bytes: int | None = None  # the stored object's size; None: not recorded (migration 0019)


@dataclass(frozen=True)
class Original:
    """What derivd learned about the original from its one decode (README, "Analysis of
    the original")."""

    width: int  # as displayed, after orientation
    height: int
    format: str  # the input format: jpeg, png, gif, webp, tiff, avif, heic, ...
    frames: int
    has_alpha: bool
    colour: str  # "#rrggbb", sRGB, lower case: the representative colour
    placeholder: str  # ThumbHash of the image, base64
    dhash: int  # 64-bit difference hash, signed (PostgreSQL bigint)
    # A PDF's {pages, page, page_size} or a video's {duration, frame_rate, codec, audio,
    # frame_time}; None for an image (README, "Previews").
    media: dict[str, Any] | None = None


@dataclass(frozen=True)
class Result:
    id: int
    status: str
    error_code: str | None
    variants: tuple[Variant, ...]
    original: Original | None = None  # None until ready (and from a handler that analyses nothing)
    external_id: str | None = None  # the app's reference, as enqueued
    metadata: dict[str, Any] | None = None  # the app's JSON object, as enqueued
    bucket: str | None = None  # the store's bucket (None: the fs store)
    original_key: str = ""  # the key the app PUT: bucket + key opens it
    original_version: str | None = None


def enqueue(
    conn: psycopg.Connection[Any],
    original_key: str,
    original_version: str | None,
    *,
    priority: int = DEFAULT_PRIORITY,
    tenant: str | None = None,
    external_id: str | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> int:
    """Queue a stored original, read later by key AND version id. Returns the row id.
    A missing version (None: the PUT to an unversioned bucket returned none) raises
    MissingVersion.

    InvalidKey (a ValueError), and nothing queued, for a key derivd's stores refuse
    (`..`, a leading `/`, a space, ...: derivd.storage.base.validate_key), as derivd
    could never read it. A key that is valid but names no object (or no such version)
    is queued, and rejected by the worker at once as `missing_original`.

    `priority`: -100..100, higher runs first (0: live uploads; backfill uses -10).
    `tenant`: whose file it is (None: no tenant); tenants with work at one priority
    share the claims. `external_id` (the app's own reference, 1-200 characters) and
    `metadata` (a JSON object, at most 4 KiB as JSON) come back unchanged in `result`,
    `derivd show` and every webhook; InvalidContext, and nothing queued, outside those
    bounds."""
    if not isinstance(original_key, str) or not original_key.strip():
        raise ValueError("original_key is required: the key the original was stored under")
    if not isinstance(original_version, str) or not original_version.strip():
        raise MissingVersion(
            "original_version is required: store the original in a versioned bucket and "
            "pass the version id its PUT returned (derivd reads originals by version)"
        )
    problem = priority_problem(priority)
    if problem:
        raise InvalidPriority(problem)
    problem = tenant_problem(tenant)
    if problem:
        raise InvalidTenant(problem)
    queue = QueueDB(conn)
    context = app_context(queue, external_id, metadata)
    return queue.enqueue_one(
        original_key, original_version, priority=priority, tenant=tenant, **context
    )


def app_context(
    queue: QueueDB, external_id: str | None, metadata: Mapping[str, Any] | None
) -> dict[str, str | None]:
    """The app's context as the enqueue statements take it (metadata as JSON text), once
    the database's rule (derivd_app_context_problem) has found nothing wrong with it:
    InvalidContext otherwise, before any row is written."""
    if external_id is None and metadata is None:
        return {"external_id": None, "metadata": None}
    try:
        text = None if metadata is None else json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InvalidContext(f"metadata is not JSON: {error}") from None
    problem = queue.app_context_problem(external_id, text)
    if problem:
        raise InvalidContext(problem)
    return {"external_id": external_id, "metadata": text}


def delete(conn: psycopg.Connection[Any], file_id: int, *, actor: str = "app") -> str:
    """Delete a file as `derivd delete` does (derivd_delete_file in sql/functions.sql):
    it moves to `deleting` at once, revoking any lease, so a running attempt can no
    longer commit; after [sweep] delete_guard the sweep removes the original's every
    version and every variant, marks it `deleted` and announces `file.deleted`. Returns
    the file's status now ('deleting', or 'deleted' when it was already); `actor` goes
    to its events. UnknownFile for an id no row has."""
    with _own(conn):
        status = QueueDB(conn).delete_file(file_id, actor)
    if status is None:
        raise UnknownFile(f"no file with id {file_id}")
    return status


def wait(conn: psycopg.Connection[Any], file_id: int, timeout: float) -> str | None:
    """Block until the file reaches a final status (ready, rejected, deleting, deleted)
    and return it; None when `timeout` seconds pass first. UnknownFile at once for an id
    no row has; ConnectionBusy when the connection is inside a transaction."""
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise ConnectionBusy(
            "wait() needs a connection outside any transaction: commit or roll back first "
            "(notifications are only delivered between transactions)"
        )
    timeout = max(0.0, timeout)
    deadline = time.monotonic() + timeout
    queue = QueueDB(conn)
    waiter = uuid.uuid4()
    with _own(conn):
        queue.register_waiter(file_id, waiter, timeout)
        queue.listen_finished()
    try:
        # Registered and listening before reading: a file that finishes after the read
        # notifies us; one that finished before is seen by the read.
        while True:
            with _own(conn):
                status = queue.status_of(file_id)
            if status is None:
                raise UnknownFile(f"no file with id {file_id}")
            if status in FINAL:
                return status
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            _notified(conn, file_id, min(remaining, RECHECK_S))
    finally:
        if not (conn.closed or conn.broken):
            with _own(conn):
                queue.unlisten_finished()
                queue.unregister_waiter(file_id, waiter)


def result(conn: psycopg.Connection[Any], file_id: int) -> Result:
    """The file's status, error code, variants (empty unless ready) and the original's
    analysis (None unless ready). UnknownFile for an id no row has."""
    with _own(conn):
        row = QueueDB(conn).client_result(file_id)
    if row is None:
        raise UnknownFile(f"no file with id {file_id}")
    return Result(
        id=file_id,
        status=str(row["status"]),
        error_code=row["error_code"],
        variants=tuple(Variant(**v) for v in row["variants"]),
        original=Original(**row["original"]) if row["original"] else None,
        external_id=row["external_id"],
        metadata=row["metadata"],
        bucket=row["bucket"],
        original_key=str(row["original_key"]),
        original_version=row["original_version"],
    )


SIMILAR_LIMIT = 100  # what similar returns at most unless asked otherwise
SIMILAR_LIMIT_MAX = 10_000  # the function's own cap (sql/functions.sql, derivd_similar)


def similar(
    conn: psycopg.Connection[Any],
    file_id: int,
    max_distance: int = 6,
    *,
    limit: int = SIMILAR_LIMIT,
) -> list[int]:
    """Ids of the other `ready` files whose dhash is within `max_distance` bits (Hamming
    distance, 0-64) of this file's, nearest first (then by id), at most `limit`
    (1-10,000): re-uploads of the same picture, resized or re-encoded. Empty when this
    file has no dhash (not ready yet, or its handler analyses nothing). UnknownFile for
    an id no row has."""
    if not 0 <= max_distance <= 64:
        raise ValueError(f"max_distance must be within 0-64 bits, not {max_distance}")
    if not 1 <= limit <= SIMILAR_LIMIT_MAX:
        raise ValueError(f"limit must be within 1-{SIMILAR_LIMIT_MAX:,}, not {limit}")
    queue = QueueDB(conn)
    with _own(conn):
        ids = [found for found, _ in queue.similar_distances(file_id, max_distance, limit)]
        if not ids and queue.status_of(file_id) is None:
            raise UnknownFile(f"no file with id {file_id}")
    return ids


def _notified(conn: psycopg.Connection[Any], file_id: int, timeout: float) -> bool:
    """Sleep on the connection until `file_id` is announced (True) or `timeout` (False).
    Each batch is read to its end: leaving psycopg's generator early drops the rest of a
    packet, which may hold the caller's own notifications on other channels."""
    deadline = time.monotonic() + timeout
    wanted = str(file_id)
    while (remaining := deadline - time.monotonic()) > 0:
        seen = list(conn.notifies(timeout=remaining, stop_after=1))
        if any(n.channel == CHANNEL and n.payload == wanted for n in seen):
            return True
    return False


@contextmanager
def _own(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """Around our statements: on a non-autocommit connection that was idle, end the
    transaction they open (commit, or roll back on error), so none is left open behind
    the caller and notifications keep arriving. Inside the caller's transaction, or in
    autocommit, do nothing."""
    owned = not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE
    try:
        yield
    except BaseException:
        if owned and not (conn.closed or conn.broken):
            conn.rollback()
        raise
    if owned:
        conn.commit()
