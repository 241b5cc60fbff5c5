"""The sweeper: the cleanup duties that keep storage and the queue honest.

One pass (`Sweeper.run_once`) does these things, each safe to repeat:

1. Rejects rows whose lease expired on their last allowed attempt (`attempts_exhausted`).
   A running supervisor does it on its maintenance timer (every poll_interval), and
   `run --burst` workers before they call the queue drained; the pass does it too, so
   that `derivd sweep` ends such rows where no supervisor runs.
2. Deletes orphans: objects written by attempts that never committed (a crash after
   PUT, a lost lease), once their write-ahead entry is older than `orphan_guard` and
   their attempt's token can no longer commit. Objects go first, the entries after:
   a crash in between repeats the deletes instead of leaking the objects.
3. Completes deletions older than `delete_guard`: every version of the original and
   everything under `derived/<id>/`, then the row becomes `deleted`.
4. Keeps the event log bounded: creates the daily archive_events partitions a week
   ahead, drops whole the days past `events_retention_days`, and removes `deleted` rows
   older than `purge_deleted_days` (when set).

Every step is idempotent (deleting what is gone is a no-op; the final UPDATEs are fenced
on the state they leave). On top of that one cluster-wide lease (a row in
derivd_leases, not a session lock: it must hold through a transaction-mode pooler) lets
only one sweeper work at a time, so two hosts never race on the same objects; the other
one skips its pass. The sweeper renews the lease before each batch and stops if it lost
it; one that dies frees it after LEASE_TTL_S.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from derivd.config import Config
from derivd.ops.logs import event
from derivd.queue.db import DatabaseUnavailable, QueueDB
from derivd.storage.base import Storage, StorageUnavailable, derived_prefix, open_storage

log = logging.getLogger("derivd.sweep")

LEASE_NAME = "sweep"
# Long enough for one batch of storage deletes; the lease is renewed before each batch.
# (A pass the supervisor kills has its lease given back at once: see processes.sweep_child.)
LEASE_TTL_S = 120.0
PARTITIONS_AHEAD_DAYS = 8


class SweepLeaseLost(DatabaseUnavailable):
    """Another sweeper took the lease over (ours expired mid-pass): stop this pass."""


@dataclass
class SweepReport:
    """What one pass did. `error` is a safe one-line reason when the pass stopped early
    (what was done before it is still listed); `skipped` means another sweeper held the
    lock and this pass did nothing."""

    exhausted: list[int] = field(default_factory=list)
    orphans_deleted: list[str] = field(default_factory=list)
    deletions_completed: list[int] = field(default_factory=list)
    objects_deleted: int = 0
    partitions_dropped: list[str] = field(default_factory=list)
    purged: list[int] = field(default_factory=list)
    waiters_forgotten: int = 0  # rows of client waiters that died (derivd_waiters)
    skipped: bool = False
    error: str | None = None

    @property
    def did_something(self) -> bool:
        return bool(
            self.exhausted
            or self.orphans_deleted
            or self.deletions_completed
            or self.partitions_dropped
            or self.purged
            or self.waiters_forgotten
        )


class Sweeper:
    def __init__(
        self,
        queue: QueueDB,
        storage: Storage,
        *,
        orphan_guard: float,
        delete_guard: float,
        max_attempts: int,
        events_retention_days: int = 0,
        purge_deleted_days: int = 0,
        batch: int = 500,
        holder: uuid.UUID | None = None,
    ) -> None:
        self.queue = queue
        self.storage = storage
        self.orphan_guard = orphan_guard
        self.delete_guard = delete_guard
        self.max_attempts = max_attempts
        self.events_retention_days = events_retention_days
        self.purge_deleted_days = purge_deleted_days
        self.batch = batch
        self.holder = holder or uuid.uuid4()  # this sweeper's fence on the shared lease

    @classmethod
    def from_config(
        cls,
        config: Config,
        queue: QueueDB,
        storage: Storage,
        *,
        orphan_guard: float | None = None,
        delete_guard: float | None = None,
        holder: uuid.UUID | None = None,
    ) -> Sweeper:
        return cls(
            queue,
            storage,
            orphan_guard=config.sweep.orphan_guard if orphan_guard is None else orphan_guard,
            delete_guard=config.sweep.delete_guard if delete_guard is None else delete_guard,
            max_attempts=config.queue.max_attempts,
            events_retention_days=config.sweep.events_retention_days,
            purge_deleted_days=config.sweep.purge_deleted_days,
            holder=holder,
        )

    def run_once(self) -> SweepReport:
        """One pass. Never raises for an unavailable database or store: the report says
        so, and the next pass picks up where this one stopped."""
        report = SweepReport()
        try:
            if not self.queue.take_lease(LEASE_NAME, self.holder, ttl_s=LEASE_TTL_S):
                report.skipped = True
                log.debug("another sweeper holds the lease; pass skipped")
                return report
            try:
                self._reject_exhausted(report)
                self._delete_orphans(report)
                self._complete_deletions(report)
                self._bound_tables(report)
            finally:
                with contextlib.suppress(DatabaseUnavailable):
                    self.queue.drop_lease(LEASE_NAME, self.holder)
        except (StorageUnavailable, DatabaseUnavailable) as error:
            # Both messages are built by derivd from error codes: safe to show.
            report.error = str(error)
        except Exception as error:  # a bug or an fs error: keep the supervisor alive
            report.error = f"sweep failed: {type(error).__name__}"
            log.debug("sweep failure detail", exc_info=True)
        self._log(report)
        return report

    # -- the duties --------------------------------------------------------------------

    def _renew(self) -> None:
        """Before each batch: still ours? A sweeper whose lease was taken over stops,
        so at most one works on the same objects at a time."""
        if not self.queue.take_lease(LEASE_NAME, self.holder, ttl_s=LEASE_TTL_S):
            raise SweepLeaseLost("sweep lease lost to another sweeper")

    def _reject_exhausted(self, report: SweepReport) -> None:
        while True:
            self._renew()
            ids = self.queue.reject_exhausted(max_attempts=self.max_attempts, limit=self.batch)
            report.exhausted += ids
            if len(ids) < self.batch:
                return

    def _delete_orphans(self, report: SweepReport) -> None:
        while True:
            self._renew()
            keys = self.queue.orphans_due(guard_s=self.orphan_guard, limit=self.batch)
            for key in keys:
                report.objects_deleted += self.storage.delete_all_versions(key)
            # Only now: an entry forgotten before its object is gone would leak it.
            self.queue.forget_orphans(keys)
            report.orphans_deleted += keys
            if len(keys) < self.batch:
                return

    def _complete_deletions(self, report: SweepReport) -> None:
        while True:
            self._renew()
            due = self.queue.deletions_due(guard_s=self.delete_guard, limit=self.batch)
            for file_id, original_key in due:
                report.objects_deleted += self.storage.delete_all_versions(original_key)
                report.objects_deleted += self.storage.delete_all_versions(derived_prefix(file_id))
                # Fenced on `deleting`: False means another pass finished it first.
                if self.queue.mark_deleted(file_id):
                    report.deletions_completed.append(file_id)
            if len(due) < self.batch:
                return

    def _bound_tables(self, report: SweepReport) -> None:
        self._renew()
        self.queue.create_event_partitions(PARTITIONS_AHEAD_DAYS)
        report.waiters_forgotten = self.queue.forget_stale_waiters()
        if self.events_retention_days:
            report.partitions_dropped += self.queue.drop_event_partitions(
                older_than_days=self.events_retention_days
            )
        while self.purge_deleted_days:
            self._renew()
            ids = self.queue.purge_deleted(
                older_than_days=self.purge_deleted_days, limit=self.batch
            )
            report.purged += ids
            if len(ids) < self.batch:
                return

    def _log(self, report: SweepReport) -> None:
        fields = {
            "exhausted": len(report.exhausted),
            "orphans": len(report.orphans_deleted),
            "deletions": len(report.deletions_completed),
            "objects": report.objects_deleted,
            "event_partitions_dropped": len(report.partitions_dropped),
            "purged": len(report.purged),
            "waiters_forgotten": report.waiters_forgotten,
        }
        if report.error:
            event(log, "sweep stopped early", logging.WARNING, reason=report.error, **fields)
        elif report.did_something:
            event(log, "sweep", **fields)


@contextmanager
def open_sweeper(
    config: Config,
    dsn: str,
    *,
    orphan_guard: float | None = None,
    delete_guard: float | None = None,
    holder: uuid.UUID | None = None,
) -> Iterator[Sweeper]:
    """A sweeper with its own connection and store, closed on exit, so a caller (the
    supervisor) holds neither between passes."""
    storage = open_storage(config)
    with QueueDB.open(dsn, role="derivd-sweep") as queue:
        yield Sweeper.from_config(
            config,
            queue,
            storage,
            orphan_guard=orphan_guard,
            delete_guard=delete_guard,
            holder=holder,
        )


def sweep_once(config: Config, dsn: str, *, holder: uuid.UUID | None = None) -> SweepReport:
    """One pass with fresh connections (what the supervisor calls every [sweep] interval).

    Never raises for an unreachable database or store: `report.error` says what stopped it.
    """
    try:
        with open_sweeper(config, dsn, holder=holder) as sweeper:
            return sweeper.run_once()
    except DatabaseUnavailable as error:  # could not even connect
        report = SweepReport(error=str(error))
        event(log, "sweep skipped", logging.WARNING, reason=report.error)
        return report
