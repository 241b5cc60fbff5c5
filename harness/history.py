"""What a run left behind, read once: every row, variant, event, registry entry and
stored object, as plain records for `harness.invariants` to check.

Nothing here interprets the history; it only reads it. Events are kept in id order:
the identity is drawn when an event is inserted, after its statement took the locks it
needed (the row's, a tenant's), so for events under one lock the id order is the order
they happened in, which the events' `at` (the transaction's start) is not.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.rows import dict_row

LIVE = ("pending", "queued", "processing", "deleting")
FINAL = ("ready", "rejected", "deleted")


@dataclass(frozen=True)
class Row:
    """One row of archive_files (a file), or a re-derivation's job (`rederive_of`: the
    file whose variant set it makes)."""

    id: int
    status: str
    attempts: int
    tenant: str | None
    error_code: str | None
    lease_token: str | None
    original_key: str
    original_version: str | None
    derived_key: str | None
    derived_version: str | None
    sha256: str | None
    rederive_of: int | None


@dataclass(frozen=True)
class Variant:
    file_id: int
    name: str
    format: str
    key: str
    version: str
    sha256: str
    lease_token: str
    fingerprint: str | None

    @property
    def slot(self) -> str:
        return f"{self.name}.{self.format}"


@dataclass(frozen=True)
class Event:
    id: int
    file_id: int
    kind: str
    attempt: int | None
    lease_token: str | None
    error_code: str | None
    actor: str | None
    tenant: str | None  # the claimed row's tenant, on `claimed` events


@dataclass(frozen=True)
class StoredObject:
    key: str
    version: str


@dataclass
class History:
    rows: dict[int, Row] = field(default_factory=dict)
    variants: list[Variant] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)  # in id order
    # The write-ahead registry and the replaced sets awaiting deletion: keys, or key
    # prefixes (ending in "/": every key under it).
    pending_keys: set[str] = field(default_factory=set)
    retired_keys: set[str] = field(default_factory=set)
    objects: list[StoredObject] = field(default_factory=list)  # the store's listing

    def events_of(self) -> dict[int, list[Event]]:
        """file id -> its events, in id order."""
        out: dict[int, list[Event]] = {}
        for event in self.events:
            out.setdefault(event.file_id, []).append(event)
        return out

    def variants_of(self) -> dict[int, list[Variant]]:
        out: dict[int, list[Variant]] = {}
        for variant in self.variants:
            out.setdefault(variant.file_id, []).append(variant)
        return out


_VARIANTS = """
SELECT file_id, name, format, key, version, sha256, lease_token::text AS lease_token,
       fingerprint
  FROM archive_variants ORDER BY file_id, name, format
"""


def _columns(conn: psycopg.Connection[Any], table: str) -> set[str]:
    """The columns `table` has (none when it does not exist): the loader reads schemas
    from before and after a release that adds one."""
    rows = conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s)"
        " AND attnum > 0 AND NOT attisdropped",
        (table,),
    ).fetchall()
    return {r["attname"] for r in rows}


def _or_null(columns: set[str], name: str, cast: str = "") -> str:
    return f"{name}{cast} AS {name}" if name in columns else f"NULL{cast or '::text'} AS {name}"


def _rows(conn: psycopg.Connection[Any]) -> dict[int, Row]:
    """archive_files, and the re-derivation jobs wherever they live: rows of
    archive_files with `rederive_of`, or a table of their own (derivd_rederivations)."""
    rederive_of = _or_null(_columns(conn, "archive_files"), "rederive_of", "::bigint")
    query = f"""
        SELECT id, status, attempts, tenant, error_code, lease_token::text AS lease_token,
               original_key, original_version, derived_key, derived_version, sha256,
               {rederive_of}
          FROM archive_files"""
    if _columns(conn, "derivd_rederivations"):
        query += """
        UNION ALL
        SELECT id, status, attempts, tenant, error_code, lease_token::text, original_key,
               original_version, NULL, NULL, NULL, file_id
          FROM derivd_rederivations"""
    return {r["id"]: Row(**r) for r in conn.execute(query + " ORDER BY id")}


def _events(conn: psycopg.Connection[Any]) -> list[Event]:
    """Every event in id order; the claim's tenant where claims record it."""
    tenant = _or_null(_columns(conn, "archive_events"), "tenant")
    query = (
        "SELECT id, file_id, kind, attempt, lease_token::text AS lease_token, error_code,"
        f" actor, {tenant} FROM archive_events ORDER BY id"
    )
    return [Event(**e) for e in conn.execute(query)]


def load(dsn: str, objects: Iterable[tuple[str, str]]) -> History:
    """Read the tables of `dsn` (directly: not through a pooler, one snapshot) and take
    the store's listing `objects`, (key, version) pairs (harness.listing)."""
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        rows = _rows(conn)
        variants = [Variant(**v) for v in conn.execute(_VARIANTS)]
        events = _events(conn)
        pending = {r["key"] for r in conn.execute("SELECT key FROM pending_objects")}
        retired = {r["key"] for r in conn.execute("SELECT key FROM derivd_retired_objects")}
    return History(
        rows=rows,
        variants=variants,
        events=events,
        pending_keys=pending,
        retired_keys=retired,
        objects=[StoredObject(k, v) for k, v in objects],
    )
