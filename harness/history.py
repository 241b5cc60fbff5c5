"""What a run left behind, read once: every row, variant, event, registry entry, webhook
delivery and stored object, as plain records for `harness.invariants` to check; and what
the run itself recorded beside derivd's tables (the handler's log of derive starts, the
processes it killed, the database outages it caused).

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
    at: float | None = None  # its transaction's start (database time, Unix seconds)


@dataclass(frozen=True)
class DeriveStart:
    """One derive as the run's handler saw it begin (harness.derive_log): the job (a
    file's id, or a re-derivation's), the attempt's token and number, the process, when
    (Unix seconds, the machine's clock: the database's `now()` reads the same)."""

    job: int
    token: str
    attempt: int
    pid: int
    at: float


@dataclass(frozen=True)
class Endpoint:
    """A webhook endpoint as the database knows it (derivd_webhook_endpoints)."""

    name: str
    events: tuple[str, ...]
    tenants: tuple[str, ...] | None
    removed: bool

    def subscribed(self, event: str, tenant: str | None) -> bool:
        return (
            not self.removed
            and event in self.events
            and (self.tenants is None or tenant in self.tenants)
        )


@dataclass(frozen=True)
class Delivery:
    """One outbox row: an event of a file for an endpoint."""

    endpoint: str
    event: str
    file_id: int


@dataclass(frozen=True)
class Disruptions:
    """What the run did to derivd besides its inputs: processes it killed (pid, when)
    and spans the database was away (start, end; Unix seconds). An attempt whose
    process was killed, or whose end fell in an outage, may leave no record of its own."""

    kills: tuple[tuple[int, float], ...] = ()
    outages: tuple[tuple[float, float], ...] = ()


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
    endpoints: list[Endpoint] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    # The handler's log of derive starts; None: the run kept none (nothing to compare).
    derive_starts: list[DeriveStart] | None = None
    disruptions: Disruptions = field(default_factory=Disruptions)

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
        f" actor, {tenant}, extract(epoch FROM at)::float8 AS at FROM archive_events ORDER BY id"
    )
    return [Event(**e) for e in conn.execute(query)]


def _webhooks(conn: psycopg.Connection[Any]) -> tuple[list[Endpoint], list[Delivery]]:
    """The endpoints and the outbox (none before the release that added webhooks)."""
    if not _columns(conn, "derivd_deliveries"):
        return [], []
    removed = (
        "removed_at IS NOT NULL"
        if "removed_at" in _columns(conn, "derivd_webhook_endpoints")
        else "false"
    )
    endpoints = [
        Endpoint(r["name"], tuple(r["events"]), _tuple(r["tenants"]), r["removed"])
        for r in conn.execute(
            f"SELECT name, events, tenants, {removed} AS removed FROM derivd_webhook_endpoints"
        )
    ]
    deliveries = [
        Delivery(**d)
        for d in conn.execute("SELECT endpoint, event, file_id FROM derivd_deliveries ORDER BY id")
    ]
    return endpoints, deliveries


def _tuple(values: list[str] | None) -> tuple[str, ...] | None:
    return None if values is None else tuple(values)


def load(
    dsn: str,
    objects: Iterable[tuple[str, str]],
    derive_starts: Iterable[DeriveStart] | None = None,
    disruptions: Disruptions | None = None,
) -> History:
    """Read the tables of `dsn` (directly: not through a pooler, one snapshot) and take
    the store's listing `objects`, (key, version) pairs (harness.listing), and what the
    run recorded itself: its handler's derive starts (harness.derive_log), what it did
    to derivd."""
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        rows = _rows(conn)
        variants = [Variant(**v) for v in conn.execute(_VARIANTS)]
        events = _events(conn)
        pending = {r["key"] for r in conn.execute("SELECT key FROM pending_objects")}
        retired = {r["key"] for r in conn.execute("SELECT key FROM derivd_retired_objects")}
        endpoints, deliveries = _webhooks(conn)
    return History(
        rows=rows,
        variants=variants,
        events=events,
        pending_keys=pending,
        retired_keys=retired,
        objects=[StoredObject(k, v) for k, v in objects],
        endpoints=endpoints,
        deliveries=deliveries,
        derive_starts=None if derive_starts is None else list(derive_starts),
        disruptions=disruptions or Disruptions(),
    )
