"""The queue protocol: the only module that runs SQL (every query lives in `sql/`).

Claim, fenced commit, fenced failure and fenced release (server-side functions in
sql/functions.sql: one small statement each, whose inner plans the server keeps per
connection, prepared or pooled), plus the queries of the supervisor's background duties,
the sweep and operators. Each method
is one statement in autocommit mode, so a claim is committed before any work starts and
no transaction is ever held across work.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import date
from typing import Any, Final, LiteralString, Self

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from derivd import __version__
from derivd.errors import ErrorCode, Transient
from derivd.handlers.base import Analysis
from derivd.queue.sqlfiles import function_names, functions, migrations, queries
from derivd.redact import one_line
from derivd.storage.base import validate_key
from derivd.traffic import DEFAULT_PRIORITY

# The notification channels, as the triggers in sql/functions.sql spell them
# (archive_files_notify_queued, archive_files_notify_finished): a row entering `queued`
# wakes the supervisors; a finished row wakes whoever waits for it (derivd.client.wait).
QUEUED_CHANNEL: Final = "derivd_queued"
FINISHED_CHANNEL: Final = "derivd_finished"


class DatabaseUnavailable(Transient):
    """The database could not be reached or dropped the connection: retry later."""


class LockBusy(Exception):
    """A DDL statement gave up waiting for its lock (DDL_LOCK_TIMEOUT_S): retry later."""


@dataclass(frozen=True)
class Job:
    id: int
    token: uuid.UUID
    attempt: int
    original_key: str
    original_version: str | None
    wait_s: float
    # The file whose variants this job makes: its own row, or for a re-derivation
    # (backfill) the ready file it re-derives (None: `id`).
    file_id: int | None = None

    @property
    def for_file(self) -> int:
        """The file id under whose prefix this job's objects are stored."""
        return self.id if self.file_id is None else self.file_id


@dataclass(frozen=True)
class StoredVariant:
    name: str
    key: str
    version: str
    sha256: str
    width: int
    height: int
    format: str = "webp"
    content_type: str = "image/webp"
    fingerprint: str | None = None  # of the spec that made it (derivd.fingerprint)


@dataclass(frozen=True)
class Finished:
    """A derived attempt for the fenced commit: its variants as stored (the first is the
    primary) and the analysis of the original (None: the handler analysed nothing)."""

    job: Job
    variants: Sequence[StoredVariant]
    original: Analysis | None = None


def _claim_params(
    limit: int, lease_s: float, max_attempts: int, host: str | None, tenant_cap: int
) -> dict[str, Any]:
    """The claim's named parameters, shared by `claim` and `commit_and_claim`."""
    return {
        "limit": limit,
        "lease_s": lease_s,
        "max_attempts": max_attempts,
        "host": host,
        "tenant_cap": tenant_cap,
    }


def _commit_row(finished: Finished) -> dict[str, Any]:
    job, variants, original = finished.job, finished.variants, finished.original
    primary = variants[0] if variants else None
    return {
        "id": job.id,
        "token": str(job.token),
        "attempt": job.attempt,
        "derived_key": primary.key if primary else None,
        "derived_version": primary.version if primary else None,
        "sha256": primary.sha256 if primary else None,
        "width": primary.width if primary else None,
        "height": primary.height if primary else None,
        "variants": [v.__dict__ for v in variants],
        # Absent keys are NULLs to the commit (derivd_commit_and_claim, sql/functions.sql).
        **({f"original_{k}": v for k, v in asdict(original).items()} if original else {}),
    }


def _jobs(rows: list[dict[str, Any]]) -> list[Job]:
    """Claimed rows as jobs, in claim order (RETURNING has none)."""
    rows.sort(key=lambda r: (r["tier"], r["claimable_since"], r["id"]))
    return [
        Job(
            id=row["id"],
            token=row["lease_token"],
            attempt=row["attempts"],
            original_key=row["original_key"],
            original_version=row["original_version"],
            wait_s=max(0.0, row["wait_s"] or 0.0),
            file_id=row.get("file_id"),
        )
        for row in rows
    ]


@dataclass(frozen=True)
class HostInfo:
    """What a supervisor tells the host registry about itself."""

    host: str
    pid: int
    version: str
    backend: str
    workers: int
    busy: int
    heartbeat_s: float


@dataclass(frozen=True)
class QueueStats:
    counts: dict[str, int]
    oldest_claimable_age_s: float | None
    expired_leases: int
    estimated: tuple[str, ...] = ()  # statuses whose count is a planner estimate

    @property
    def rejected_ratio(self) -> float:
        finished = sum(self.counts.get(s, 0) for s in ("ready", "rejected"))
        return self.counts.get("rejected", 0) / finished if finished else 0.0


@dataclass(frozen=True)
class EventWindow:
    """The recent events: how many of each kind, and the rejections by error code."""

    events: dict[str, int]
    rejected_by_code: dict[str, int]


# Every connection: TCP keepalives, so a server host that vanished (power, network) is
# noticed within about a minute instead of a read that waits forever.
KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 30,
                              "keepalives_interval": 10, "keepalives_count": 3}  # fmt: skip
# The supervisor's own statements (its database thread, LISTEN, the start-up check, the
# dashboard) wait at most this long: server-side on a direct connection
# (statement_timeout, lock_timeout), client-side everywhere (`bounded`: the socket is shut
# down), which is what holds through a pooler whose server froze.
PARENT_STATEMENT_TIMEOUT_S = 10.0
PARENT_LOCK_TIMEOUT_S = 5.0
# Partition DDL takes ACCESS EXCLUSIVE on archive_events: it waits at most this long for
# its lock (every job's commit would queue behind it), then gives up and is retried.
DDL_LOCK_TIMEOUT_S = 2.0


def connect(
    dsn: str, *, application_name: str = "derivd", bound_s: float | None = None
) -> psycopg.Connection[Any]:
    """Open an autocommit connection, or raise DatabaseUnavailable with one line.

    Through a transaction-mode pooler the next statement may run on another server
    connection, where a statement prepared on this one does not exist: there psycopg
    prepares nothing (`prepare_threshold = None`). A direct connection keeps psycopg's
    prepared statements, which spare the server a parse and plan per call.

    `bound_s` (the supervisor's connections): the pooler probe waits at most that long,
    and a direct connection gets it as its statement_timeout (PARENT_LOCK_TIMEOUT_S as
    its lock_timeout).
    """
    return open_connection(dsn, application_name=application_name, bound_s=bound_s)[0]


def open_connection(
    dsn: str, *, application_name: str, bound_s: float | None
) -> tuple[psycopg.Connection[Any], bool]:
    """`connect`, and whether the connection goes through a pooler."""
    try:
        conn = psycopg.connect(
            dsn,
            autocommit=True,
            application_name=application_name,
            connect_timeout=10,
            **KEEPALIVES,
        )
    except psycopg.OperationalError as error:
        raise DatabaseUnavailable(f"database unavailable: {one_line(error)}") from None
    try:
        with bounded(conn, bound_s):
            pooled = is_pooled(conn)
            if pooled:
                conn.prepare_threshold = None
            elif bound_s is not None:
                conn.execute(_q("session_timeouts"), _session_timeouts(bound_s), prepare=False)
    except psycopg.Error as error:
        conn.close()
        raise DatabaseUnavailable(f"database unavailable: {one_line(error)}") from None
    return conn, pooled


def _session_timeouts(bound_s: float) -> dict[str, str]:
    lock_s = min(bound_s, PARENT_LOCK_TIMEOUT_S)
    return {"statement": f"{int(bound_s * 1000)}ms", "lock": f"{int(lock_s * 1000)}ms"}


@contextmanager
def bounded(conn: psycopg.Connection[Any], seconds: float | None) -> Iterator[None]:
    """Run the block's statements on `conn` for at most `seconds` (None: no bound): past
    it the connection's socket is shut down, which fails the waiting read (psycopg raises
    OperationalError, the connection is broken). A client-side bound holds whatever sits
    between us and the server (a pooler waiting for a frozen server, a hung network)."""
    if seconds is None:
        yield
        return
    timer = threading.Timer(seconds, _shut_down, args=(conn,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _shut_down(conn: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(Exception), socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)


def is_pooled(conn: psycopg.Connection[Any]) -> bool:
    """Whether `conn` goes through a connection pooler: the server process that answers
    is not the one the connection was told about at start-up (a pooler such as PgBouncer
    hands out a process id of its own)."""
    row = conn.execute(_q("backend_pid"), prepare=False).fetchone()
    return row is None or int(row[0]) != conn.info.backend_pid


def _q(name: str) -> LiteralString:
    # The queries come from our own package data, never from input: they are literal.
    query: LiteralString = queries()[name]  # type: ignore[assignment]
    return query


def _on_channel(name: str, channel: str) -> sql.Composed:
    """`listen` or `unlisten` on `channel`, composed as an identifier."""
    return sql.SQL(_q(name)).format(channel=sql.Identifier(channel))


def migrate(dsn: str) -> list[str]:
    """Apply pending migrations in order, then sql/functions.sql, in one transaction,
    under an advisory lock. Returns the names of the migrations it applied.

    Safe to run from two hosts at once: the second waits for the lock, then finds no
    migration left and replaces the functions with the same bodies (two sessions
    replacing one function at once would fail: the lock serialises them). One
    transaction: a function body that does not fit the migrated tables rolls the whole
    upgrade back, so the ledger never records migrations whose functions are missing.

    A database that has migrations this version does not know belongs to a newer derivd:
    SchemaMismatch, and nothing changes (this version's functions.sql would put older
    bodies under the newer hosts of a rolling upgrade).
    """
    applied: list[str] = []
    packaged = migrations()
    with connect(dsn, application_name="derivd-migrate") as conn:
        conn.autocommit = False
        with conn.transaction():
            conn.execute(_q("migrations_lock"))
            conn.execute(_q("migrations_table"))
            done = {row[0] for row in conn.execute(_q("migrations_applied"))}
            if newer := newer_schema(done, {m.name for m in packaged}):
                raise SchemaMismatch(newer)
            for migration in packaged:
                if migration.name in done:
                    continue
                conn.execute(migration.sql)  # type: ignore[arg-type]  # package data
                conn.execute(_q("migrations_record"), {"name": migration.name})
                applied.append(migration.name)
            conn.execute(functions())  # type: ignore[arg-type]  # package data
    return applied


NO_SCHEMA = "the database has no derivd schema; run `derivd migrate`"


class SchemaMismatch(Exception):
    """The database's schema is not the one this derivd was built for (one line, which
    says what to do). Commands exit 3 on it, as `derivd status` does."""


def check_schema(dsn: str) -> None:
    """Raise SchemaMismatch unless the database has every packaged migration, no
    migration this version does not know, and every function of sql/functions.sql;
    DatabaseUnavailable when it cannot be asked.

    Every command that uses the schema calls this first, before it touches storage, so
    that a missing or foreign schema is one line instead of a traceback halfway through.
    A release may add a function without a migration: its hosts are refused until
    `derivd migrate` has created it, as they would be for a missing migration.
    """
    bound = PARENT_STATEMENT_TIMEOUT_S  # `derivd run` asks before it forks anything
    with connect(dsn, application_name="derivd-check", bound_s=bound) as conn:
        check_schema_on(conn, bound_s=bound)


def check_schema_on(conn: psycopg.Connection[Any], *, bound_s: float | None = None) -> None:
    """check_schema on a connection the caller holds (a command that opens one only);
    its statements wait at most `bound_s` (`bounded`)."""
    applied: set[str] = set()
    absent: list[str] = []
    try:
        with bounded(conn, bound_s):
            row = conn.execute(_q("migrations_exists")).fetchone()
            if row and row[0]:
                applied = {r[0] for r in conn.execute(_q("migrations_applied"))}
                names = {"names": function_names()}
                absent = [r[0] for r in conn.execute(_q("functions_missing"), names)]
    except psycopg.OperationalError as error:
        raise DatabaseUnavailable(f"database unavailable: {one_line(error)}") from None
    except psycopg.Error as error:
        raise DatabaseUnavailable(f"database error: {one_line(error)}") from None
    problem = schema_problem(applied, {m.name for m in migrations()}, absent)
    if problem:
        raise SchemaMismatch(problem)


def schema_problem(
    applied: set[str], packaged: set[str], absent_functions: Sequence[str] = ()
) -> str | None:
    """What is wrong with a database that has `applied` for this version's `packaged`
    migrations and lacks `absent_functions` of its sql/functions.sql."""
    if not applied:
        return NO_SCHEMA
    newer = newer_schema(applied, packaged)
    if newer:
        return newer
    missing = sorted(packaged - applied) or [f"{name}()" for name in absent_functions]
    if missing:
        return (
            f"the database schema is behind this derivd (missing: {', '.join(missing)}); "
            "run `derivd migrate`"
        )
    return None


def newer_schema(applied: set[str], packaged: set[str]) -> str | None:
    """Why a database that has `applied` belongs to a newer derivd than `packaged`, if it
    does."""
    newer = sorted(applied - packaged)
    if not newer:
        return None
    return (
        f"the database schema is newer than this derivd ({__version__}) knows "
        f"(unknown migrations: {', '.join(newer)}); upgrade derivd on this host"
    )


class QueueListener:
    """One LISTEN connection on QUEUED_CHANNEL (held by the supervisor).

    `connect` (re)opens it and says how that went; `drain` reads whatever has arrived
    without blocking. Any database error closes the connection: the caller polls until a
    later `connect` succeeds, and notifications sent meanwhile are lost (hence the
    caller's wake-everyone after a reconnect, and the workers' poll_interval fallback).
    Every (re)connect checks for a pooler, where LISTEN would hear nothing: such a
    connection is closed again and reported `pooled`.
    """

    def __init__(
        self,
        dsn: str,
        *,
        bound_s: float | None = PARENT_STATEMENT_TIMEOUT_S,
        channel: str = QUEUED_CHANNEL,  # the delivering process listens on another
    ) -> None:
        self.dsn = dsn
        self.bound_s = bound_s
        self.channel = channel
        self.conn: psycopg.Connection[Any] | None = None

    @property
    def connected(self) -> bool:
        return self.conn is not None and not (self.conn.closed or self.conn.broken)

    def connect(self) -> str:
        """Open and LISTEN if not connected: `listening` (a new connection), `connected`
        (it was), `pooled` (through a pooler: closed again) or `unavailable`."""
        if self.connected:
            return "connected"
        self.close()
        try:
            conn, pooled = open_connection(
                self.dsn, application_name="derivd-listen", bound_s=self.bound_s
            )
        except DatabaseUnavailable:
            return "unavailable"
        if pooled:
            conn.close()
            return "pooled"
        try:
            with bounded(conn, self.bound_s):
                conn.execute(_on_channel("listen", self.channel))
        except psycopg.Error:
            conn.close()
            return "unavailable"
        self.conn = conn
        return "listening"

    def fileno(self) -> int | None:
        return self.conn.fileno() if self.connected and self.conn is not None else None

    def drain(self) -> int:
        """How many notifications have arrived (0 when none, or when the connection
        broke: it is closed then)."""
        if self.conn is None:
            return 0
        try:
            # Iterate to the end: leaving the generator early drops the rest of a packet.
            return sum(1 for _ in self.conn.notifies(timeout=0.0))
        except psycopg.Error:
            self.close()
            return 0

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class QueueDB:
    """One worker's (or one command's) handle on the queue tables."""

    def __init__(self, conn: psycopg.Connection[Any], dsn: str | None = None) -> None:
        self.conn = conn
        self.dsn = dsn
        self.application_name = "derivd"
        self.bound_s: float | None = None  # the supervisor's connections: see `connect`
        self._pooled: bool | None = None  # found when this handle opened `conn`

    @classmethod
    def open(cls, dsn: str, *, role: str = "derivd", bound_s: float | None = None) -> Self:
        """`bound_s`: every statement waits at most that long (the supervisor's own
        connections; a worker's statements are bounded by its job's deadline)."""
        name = f"{role}@{socket.gethostname()}"
        conn, pooled = open_connection(dsn, application_name=name, bound_s=bound_s)
        queue = cls(conn, dsn)
        queue.application_name = name
        queue.bound_s = bound_s
        queue._pooled = pooled
        return queue

    def _reconnect_if_broken(self) -> None:
        # After a database restart the old connection is dead; the next call gets a new
        # one (or DatabaseUnavailable, which the caller treats as transient).
        if (self.conn.closed or self.conn.broken) and self.dsn is not None:
            self.conn, self._pooled = open_connection(
                self.dsn, application_name=self.application_name, bound_s=self.bound_s
            )

    def close(self) -> None:
        self.conn.close()

    def pooled(self) -> bool:
        """Whether this connection goes through a connection pooler (`is_pooled`): known
        since it was opened here (no second round trip), else asked once."""
        self._reconnect_if_broken()
        if self._pooled is None:
            try:
                self._pooled = is_pooled(self.conn)
            except psycopg.OperationalError as error:
                raise DatabaseUnavailable(f"database unavailable: {one_line(error)}") from None
        return self._pooled

    def check_schema(self) -> None:
        """SchemaMismatch unless the schema is this version's (module check_schema)."""
        self._reconnect_if_broken()
        check_schema_on(self.conn, bound_s=self.bound_s)

    def __enter__(self) -> QueueDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _cursor(self) -> Iterator[psycopg.Cursor[dict[str, Any]]]:
        self._reconnect_if_broken()
        try:
            with bounded(self.conn, self.bound_s), self.conn.cursor(row_factory=dict_row) as cur:
                yield cur
        except psycopg.errors.LockNotAvailable:
            raise LockBusy("gave up waiting for a lock; retried later") from None
        except psycopg.OperationalError as error:
            raise DatabaseUnavailable(f"database unavailable: {one_line(error)}") from None

    def _all(self, name: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        with self._cursor() as cur:
            cur.execute(_q(name), params or {})
            return cur.fetchall() if cur.description else []

    def _one(self, name: str, params: dict[str, Any] | None = None) -> dict[str, Any] | None:
        rows = self._all(name, params)
        return rows[0] if rows else None

    def _ddl(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        """`name` in a transaction of its own whose lock waits last at most
        DDL_LOCK_TIMEOUT_S (LockBusy past it): partition DDL, never queued for long."""
        with self._cursor() as cur, self.conn.transaction():
            cur.execute(_q("lock_timeout"), {"timeout": f"{int(DDL_LOCK_TIMEOUT_S * 1000)}ms"})
            cur.execute(_q(name), params)
            return cur.fetchall() if cur.description else []

    # -- the lease protocol ------------------------------------------------------------

    def claim_many(
        self,
        *,
        limit: int,
        lease_s: float,
        max_attempts: int,
        host: str | None = None,
        tenant_cap: int = 0,
    ) -> list[Job]:
        """Lease up to `limit` rows in one statement, in claim order; each row gets its
        own token and lease, and records `host` as its holder. `tenant_cap`: at most that
        many rows in flight per tenant (0: no cap)."""
        params = _claim_params(limit, lease_s, max_attempts, host, tenant_cap)
        return _jobs(self._all("claim", params))

    def register_pending(self, job: Job, keys: Sequence[str]) -> None:
        self._all("register_pending", {"id": job.id, "token": job.token, "keys": list(keys)})

    def commit_many(self, results: Sequence[Finished]) -> set[int]:
        """Commit several attempts in one durable statement, each fenced on its own
        token, with its variants and analysis. Returns the ids that committed; every other
        one lost its lease (and got a `lease_lost` event)."""
        if not results:
            return set()
        jobs = json.dumps([_commit_row(f) for f in results])
        return {int(r["id"]) for r in self._all("commit", {"jobs": jobs})}

    def commit_and_claim(
        self,
        results: Sequence[Finished],
        *,
        limit: int,
        lease_s: float,
        max_attempts: int,
        host: str | None = None,
        tenant_cap: int = 0,
    ) -> tuple[set[int], list[Job]]:
        """`commit_many` and `claim_many` in one durable statement (one round trip, one
        transaction): the ids that committed, and the newly claimed jobs in claim order.
        Every fence is the same as in the two separate calls."""
        params = _claim_params(limit, lease_s, max_attempts, host, tenant_cap)
        params["jobs"] = json.dumps([_commit_row(f) for f in results])
        rows = self._all("commit_and_claim", params)
        committed = {int(r["id"]) for r in rows if r["kind"] == "committed"}
        return committed, _jobs([r for r in rows if r["kind"] == "claimed"])

    def fail(
        self,
        job: Job,
        *,
        retry: bool,
        code: ErrorCode,
        max_attempts: int,
        delay_s: float = 0.0,
        extra_event: str | None = None,
    ) -> str | None:
        """Fenced failure. Returns the row's new status, or None when the lease was lost."""
        row = self._one(
            "fail",
            {
                "id": job.id,
                "token": job.token,
                "attempt": job.attempt,
                "retry": retry,
                "code": code,
                "max_attempts": max_attempts,
                "delay_s": delay_s,
                "extra_event": extra_event,
            },
        )
        return None if row is None else str(row["status"])

    def release(self, job: Job) -> bool:
        """Give the job back without burning its attempt. False: the lease was lost."""
        row = self._one("release", {"id": job.id, "token": job.token, "attempt": job.attempt})
        return bool(row and row["released"])

    # -- heartbeat and host registry ---------------------------------------------------

    def heartbeat(
        self, host: HostInfo, jobs: Sequence[Job], *, renew: bool, lease_s: float
    ) -> set[int]:
        """Check (and with `renew`, extend) the leases of `jobs` and refresh the host's
        registry row, in one statement. Returns the ids that are not lost: whose lease
        still holds, or whose attempt has just ended itself (committed, failed or
        released with its own token) before its worker could report it."""
        return self._host_seen(host, jobs, renew=renew, lease_s=lease_s, starting=False)

    def register_host(self, host: HostInfo) -> None:
        """A supervisor starts: its registry row, idle and started now. The heartbeat's
        statement, holding no jobs: the registry's upsert is written once."""
        self._host_seen(replace(host, busy=0), [], renew=False, lease_s=0.0, starting=True)

    def _host_seen(
        self, host: HostInfo, jobs: Sequence[Job], *, renew: bool, lease_s: float, starting: bool
    ) -> set[int]:
        params = {
            **host.__dict__,
            "jobs": json.dumps([{"id": j.id, "token": str(j.token)} for j in jobs]),
            "ids": [j.id for j in jobs],
            "renew": renew,
            "lease_s": lease_s,
            "starting": starting,
        }
        return {int(r["id"]) for r in self._all("heartbeat", params)}

    def deregister_host(self, host: str, pid: int) -> None:
        self._all("deregister_host", {"host": host, "pid": pid})

    def prune_hosts(self, *, guard_s: float) -> list[str]:
        return [str(r["host"]) for r in self._all("prune_hosts", {"guard_s": guard_s})]

    def hosts(self) -> list[dict[str, Any]]:
        """The host registry, with `alive`, `heartbeat_age_s` and `in_flight` per host."""
        return self._all("hosts")

    def record_lease_lost(self, job: Job) -> bool:
        """A `lease_lost` event for an attempt the supervisor killed (none when the lease
        is this attempt's after all)."""
        params = {"id": job.id, "token": job.token, "attempt": job.attempt}
        return bool(self._all("record_lease_lost", params))

    def sync_webhook_endpoints(
        self, subscriptions: Sequence[dict[str, Any]]
    ) -> tuple[list[str], list[str]]:
        """Make the database's webhook endpoints these ({name, events, tenants}): the
        outbox's subscribers. Returns the names removed and those added or changed."""
        row = self._one("webhook_endpoints_sync", {"endpoints": json.dumps(list(subscriptions))})
        return (list(row["removed"]), list(row["changed"])) if row else ([], [])

    # -- the background duties and the sweep --------------------------------------------

    def reject_exhausted(self, *, max_attempts: int, limit: int = 100) -> list[int]:
        """Reject rows whose worker died on their last attempt; their `file.rejected`
        webhooks enter the outbox in the same transaction."""
        with self._cursor() as cur, self.conn.transaction():
            cur.execute(_q("reject_exhausted"), {"max_attempts": max_attempts, "limit": limit})
            ids = [int(r["id"]) for r in cur.fetchall()]
            if ids:
                cur.execute(_q("outbox_many"), {"ids": ids, "event": "file.rejected"})
        return ids

    def orphans_due(self, *, guard_s: float, limit: int = 500) -> list[str]:
        return [r["key"] for r in self._all("orphans_due", {"guard_s": guard_s, "limit": limit})]

    def forget_orphans(self, keys: Sequence[str]) -> None:
        self._all("forget_orphans", {"keys": list(keys)})

    def deletions_due(self, *, guard_s: float, limit: int = 100) -> list[tuple[int, str | None]]:
        """(id, original key) of deletions due; the key is None for a re-derivation's
        row, whose original is its file's."""
        rows = self._all("deletions_due", {"guard_s": guard_s, "limit": limit})
        return [(r["id"], r["original_key"]) for r in rows]

    def mark_deleted(self, file_id: int) -> bool:
        """The last step of a deletion; its `file.deleted` webhooks enter the outbox in
        the same transaction."""
        with self._cursor() as cur, self.conn.transaction():
            cur.execute(_q("mark_deleted"), {"id": file_id})
            row = cur.fetchone()
            deleted = bool(row and row["deleted"])
            if deleted:
                cur.execute(_q("outbox_many"), {"ids": [file_id], "event": "file.deleted"})
        return deleted

    def retired_due(self, *, guard_s: float, limit: int = 500) -> list[str]:
        """Keys of replaced variant sets retired longer than `guard_s` ago."""
        rows = self._all("retired_due", {"guard_s": guard_s, "limit": limit})
        return [str(r["key"]) for r in rows]

    def forget_retired(self, keys: Sequence[str]) -> None:
        self._all("forget_retired", {"keys": list(keys)})

    def take_lease(self, name: str, holder: uuid.UUID, *, ttl_s: float) -> bool:
        """Take or renew the cluster-wide lease `name` for `holder` (one statement, so it
        holds through a pooler); False while another holder's lease is unexpired."""
        params = {"name": name, "holder": holder, "ttl_s": ttl_s}
        return self._one("lease_take", params) is not None

    def drop_lease(self, name: str, holder: uuid.UUID) -> bool:
        """Give the lease back; False when it was not (or no longer) this holder's."""
        return bool(self._all("lease_drop", {"name": name, "holder": holder}))

    def create_event_partitions(self, days: int, *, first: date | None = None) -> list[str]:
        rows = self._ddl("event_partitions", {"first": first, "days": days})
        return [str(r["created"]) for r in rows]

    def rehome_default_events(self, *, older_than_days: int) -> list[str]:
        """Empty the DEFAULT partition into day partitions (rows older than
        `older_than_days` are dropped; 0: none). The partitions that received rows."""
        rows = self._ddl("rehome_default_events", {"days": older_than_days})
        return [str(r["part"]) for r in rows]

    def drop_event_partitions(self, *, older_than_days: int) -> list[str]:
        rows = self._ddl("drop_event_partitions", {"days": older_than_days})
        return [str(r["dropped"]) for r in rows]

    def default_events(self) -> bool:
        """Whether the DEFAULT partition holds events (see `rehome_default_events`)."""
        row = self._one("default_events")
        return bool(row and row["present"])

    def purge_deleted(self, *, older_than_days: int, limit: int = 1000) -> list[int]:
        rows = self._all("purge_deleted", {"days": older_than_days, "limit": limit})
        return [int(r["id"]) for r in rows]

    # -- producers and operators -------------------------------------------------------

    def enqueue(
        self,
        originals: Sequence[tuple[str, str | None]],
        *,
        priority: int = DEFAULT_PRIORITY,
        tenant: str | None = None,
    ) -> list[int]:
        """Queue stored originals given as (key, version id), at one priority and for
        one tenant. Returns the new ids. InvalidKey, and nothing queued, when a key is
        one the stores refuse."""
        if not originals:
            return []
        params = {
            "keys": [validate_key(key) for key, _ in originals],
            "versions": [version for _, version in originals],
            "priority": priority,
            "tenant": tenant,
        }
        return [r["id"] for r in self._all("enqueue", params)]

    def request_delete(self, ids: Sequence[int], *, actor: str) -> list[int]:
        return [r["id"] for r in self._all("request_delete", {"ids": list(ids), "actor": actor})]

    def statuses(self, ids: Sequence[int]) -> dict[int, str]:
        """The status of each id that exists; unknown ids are absent."""
        rows = self._all("file_statuses", {"ids": list(ids)})
        return {int(r["id"]): str(r["status"]) for r in rows}

    def operator_retry(
        self, *, ids: Sequence[int] | None, code: str | None, actor: str
    ) -> list[int]:
        params = {"ids": list(ids) if ids is not None else None, "code": code, "actor": actor}
        return [r["id"] for r in self._all("operator_retry", params)]

    def queue_stats(self, *, max_age_s: float = 0.0) -> QueueStats:
        """Queue health; a result another host computed less than `max_age_s` ago is
        reused (0: compute now)."""
        row = self._one("queue_stats", {"max_age_s": max_age_s}) or {}
        payload: dict[str, Any] = row.get("payload") or {}
        return QueueStats(
            counts={str(k): int(v) for k, v in (payload.get("counts") or {}).items()},
            oldest_claimable_age_s=payload.get("oldest_claimable_age_s"),
            expired_leases=int(payload.get("expired_leases") or 0),
            estimated=tuple(str(s) for s in payload.get("estimated") or ()),
        )

    def event_window(self, *, window_s: float, max_age_s: float = 0.0) -> EventWindow:
        """The last `window_s` seconds of events; a result another host (or probe)
        computed less than `max_age_s` ago is reused (0: compute now)."""
        row = self._one("event_window", {"window_s": window_s, "max_age_s": max_age_s}) or {}
        payload: dict[str, Any] = row.get("payload") or {}
        return EventWindow(
            events={str(k): int(v) for k, v in (payload.get("events") or {}).items()},
            rejected_by_code={
                str(k): int(v) for k, v in (payload.get("rejected_by_code") or {}).items()
            },
        )

    def file_row(self, file_id: int) -> dict[str, Any] | None:
        return self._one("file_row", {"id": file_id})

    def file_variants(self, file_id: int) -> list[StoredVariant]:
        return [StoredVariant(**r) for r in self._all("file_variants", {"id": file_id})]

    def file_events(self, file_id: int) -> list[dict[str, Any]]:
        """The file's events (at, kind, attempt, error_code, actor, lease_token), oldest
        first."""
        return self._all("file_events", {"id": file_id})

    # -- derivd.client: upload APIs, on the caller's own connection --------------------

    def enqueue_one(
        self, key: str, version: str, *, priority: int = DEFAULT_PRIORITY, tenant: str | None = None
    ) -> int:
        """One stored original (derivd.client.enqueue); InvalidKey as `enqueue`."""
        params = {
            "key": validate_key(key),
            "version": version,
            "priority": priority,
            "tenant": tenant,
        }
        row = self._one("client_enqueue", params)
        assert row is not None  # INSERT … RETURNING always returns its row
        return int(row["id"])

    def register_waiter(self, file_id: int, waiter: uuid.UUID, timeout_s: float) -> None:
        self._all("wait_register", {"id": file_id, "waiter": waiter, "timeout_s": timeout_s})

    def unregister_waiter(self, file_id: int, waiter: uuid.UUID) -> None:
        self._all("wait_unregister", {"id": file_id, "waiter": waiter})

    def forget_stale_waiters(self) -> int:
        """Remove the rows of waiters that died past their deadline; how many."""
        return len(self._all("forget_stale_waiters"))

    def listen_finished(self) -> None:
        self._on_channel("listen", FINISHED_CHANNEL)

    def unlisten_finished(self) -> None:
        self._on_channel("unlisten", FINISHED_CHANNEL)

    def _on_channel(self, name: str, channel: str) -> None:
        with self._cursor() as cur:
            cur.execute(_on_channel(name, channel))

    def status_of(self, file_id: int) -> str | None:
        """The row's status, or None when no row has this id."""
        row = self._one("client_status", {"id": file_id})
        return None if row is None else str(row["status"])

    def client_result(self, file_id: int) -> dict[str, Any] | None:
        """Status, error code and (for a ready row) every variant; None: unknown id."""
        return self._one("client_result", {"id": file_id})

    def similar(self, file_id: int, max_distance: int) -> list[int]:
        """Ids of the other ready files within `max_distance` bits of this file's dhash,
        nearest first (none for an unknown id, too)."""
        return [int(r["id"]) for r in self._all("similar", {"id": file_id, "max": max_distance})]

    # -- backfill ----------------------------------------------------------------------

    def backfill_page(
        self, *, after: int, last: int, limit: int
    ) -> list[tuple[int, dict[str, str | None]]]:
        """Ready files with id in (after, last], in id order, with their variant sets."""
        rows = self._all("backfill_page", {"after": after, "last": last, "limit": limit})
        return [(int(r["id"]), dict(r["variants"])) for r in rows]

    def backfill_last_id(self) -> int:
        row = self._one("backfill_last_id")
        return int(row["last_id"]) if row else 0

    def backfill_queue(self, ids: Sequence[int], *, priority: int) -> list[int]:
        """Queue re-derivations of these ready files; the files actually queued."""
        if not ids:
            return []
        rows = self._all("backfill_queue", {"ids": list(ids), "priority": priority})
        return [int(r["id"]) for r in rows]

    def backfill_claimable(self) -> int:
        row = self._one("backfill_claimable")
        return int(row["n"]) if row else 0

    def backfill_run(self, target: str) -> dict[str, Any]:
        """The unfinished run toward `target` (resumed), else a new one."""
        row = self._one("backfill_resume", {"target": target})
        if row is None:
            params = {"target": target, "last_id": self.backfill_last_id()}
            row = self._one("backfill_start", params)
        assert row is not None  # INSERT … RETURNING always returns its row
        return row

    def backfill_advance(
        self, run_id: int, *, cursor: int, scanned: int, queued: int, done: bool
    ) -> None:
        params = {
            "id": run_id,
            "cursor": cursor,
            "scanned": scanned,
            "queued": queued,
            "done": done,
        }
        self._all("backfill_advance", params)

    def backfill_progress(self) -> dict[str, Any] | None:
        """The latest backfill run with `in_queue` (its re-derivations not done yet)."""
        return self._one("backfill_progress")

    # -- the dashboard -----------------------------------------------------------------

    def in_flight(self, *, limit: int) -> list[dict[str, Any]]:
        """Processing rows (id, attempts, claimed_by, age_s, lease_left_s), oldest lease
        first."""
        return self._all("dashboard_in_flight", {"limit": limit})

    def finished_per_minute(self, *, cap: int, sample: int) -> list[dict[str, Any]]:
        """(minutes_ago, finished, median_s) over the last hour: counts from at most `cap`
        events, each minute's median duration from at most `sample` of its latest jobs."""
        return self._all("dashboard_minutes", {"cap": cap, "sample": sample})


class ClusterAdmin:
    """Database-level statements on a maintenance connection (autocommit: CREATE
    DATABASE cannot run in a transaction). Names are composed as identifiers."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def _identifiers(self, query_name: str, **names: str) -> sql.Composed:
        query = sql.SQL(_q(query_name))
        return query.format(**{k: sql.Identifier(v) for k, v in names.items()})

    def database_exists(self, name: str) -> bool:
        return self.conn.execute(_q("database_exists"), {"name": name}).fetchone() is not None

    def create_database(self, name: str, template: str | None = None) -> None:
        if template is None:
            self.conn.execute(self._identifiers("create_database", name=name))
        else:
            query = self._identifiers("create_database_from_template", name=name, template=template)
            self.conn.execute(query)

    def drop_database(self, name: str) -> None:
        self.conn.execute(self._identifiers("drop_database", name=name))
