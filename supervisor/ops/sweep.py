"""The sweep: the cleanup that keeps storage and the queue honest (`Sweeper`, its logic).

One pass (`Sweeper.run_once`) does these things, each safe to repeat:

1. Deletes orphans: objects written by attempts that never committed (a crash after
   PUT, a lost lease), once their write-ahead entry is older than `orphan_guard` and
   their attempt's token can no longer commit. Objects go first, the entries after:
   a crash in between repeats the deletes instead of leaking the objects.
2. Completes deletions older than `delete_guard`: every version of the original and
   everything under `derived/<id>/`, then the row becomes `deleted`. Removes the
   objects of variant sets a re-derivation (backfill) replaced, retired longer than
   `delete_guard` ago (clients that read the old keys a moment before keep them that
   long).
3. Removes `deleted` rows older than `purge_deleted_days` (when set), the rows of
   client waiters that died, and finished webhook deliveries (delivered, or failed and
   never replayed) of events older than `events_retention_days`, as the events go.

(Rows whose worker died on their last attempt, and the event partitions, are duties of
their own: derivd.processes.duties. The supervisor runs a pass in a forked child every
`[sweep] interval`: derivd.processes.sweep_child.)

Every step is idempotent (deleting what is gone is a no-op; the final UPDATEs are fenced
on the state they leave). On top of that one cluster-wide lease (a row in
derivd_leases, not a session lock: it must hold through a transaction-mode pooler) lets
only one sweeper work at a time, so two hosts never race on the same objects; the other
one skips its pass. The pass renews the lease as it goes, at least every third of
LEASE_TTL_S (within a batch too: a slow store must not outlast it), and stops the moment
it cannot renew; a sweeper that dies frees it after LEASE_TTL_S.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from derivd.config import Config
from derivd.logs import event
from derivd.queue.db import DatabaseUnavailable, QueueDB
from derivd.storage.base import Storage, StorageUnavailable, derived_prefix
from derivd.storage.configured import open_storage

log = logging.getLogger("derivd.sweep")

LEASE_NAME = "sweep"
# The pass renews it every third of this, item by item; a pass that dies frees it after
# this long. (A pass the supervisor kills has its lease given back at once: see
# processes.sweep_child.)
LEASE_TTL_S = 120.0


class SweepLeaseLost(Exception):
    """The pass could not renew its lease (taken over, or the database is away): stop,
    so at most one sweeper works on the same objects at a time."""


@dataclass
class SweepReport:
    """What one pass did. `error` is a safe one-line reason when the pass stopped early
    (what was done before it is still listed); `skipped` means another sweeper held the
    lock and this pass did nothing."""

    orphans_deleted: list[str] = field(default_factory=list)
    deletions_completed: list[int] = field(default_factory=list)
    retired_deleted: list[str] = field(default_factory=list)  # replaced by a backfill
    objects_deleted: int = 0
    purged: list[int] = field(default_factory=list)
    waiters_forgotten: int = 0  # rows of client waiters that died (derivd_waiters)
    deliveries_purged: dict[str, int] = field(default_factory=dict)  # by status
    skipped: bool = False
    error: str | None = None

    @property
    def did_something(self) -> bool:
        return bool(
            self.orphans_deleted
            or self.deletions_completed
            or self.retired_deleted
            or self.purged
            or self.waiters_forgotten
            or self.deliveries_purged
        )


class Sweeper:
    def __init__(
        self,
        queue: QueueDB,
        storage: Storage,
        *,
        orphan_guard: float,
        delete_guard: float,
        purge_deleted_days: int = 0,
        deliveries_retention_days: int = 0,
        batch: int = 500,
        holder: uuid.UUID | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queue = queue
        self.storage = storage
        self.orphan_guard = orphan_guard
        self.delete_guard = delete_guard
        self.purge_deleted_days = purge_deleted_days
        self.deliveries_retention_days = deliveries_retention_days
        self.batch = batch
        self.holder = holder or uuid.uuid4()  # this sweeper's fence on the shared lease
        self.clock = clock
        self.renewed_at = -math.inf  # clock time of the last renewal

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
            purge_deleted_days=config.sweep.purge_deleted_days,
            deliveries_retention_days=config.sweep.events_retention_days,
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
            self.renewed_at = self.clock()
            try:
                self._delete_orphans(report)
                self._complete_deletions(report)
                self._delete_retired(report)
                self._bound_tables(report)
            finally:
                with contextlib.suppress(DatabaseUnavailable):
                    self.queue.drop_lease(LEASE_NAME, self.holder)
        except (StorageUnavailable, DatabaseUnavailable, SweepLeaseLost) as error:
            # Both messages are built by derivd from error codes: safe to show.
            report.error = str(error)
        except Exception as error:  # a bug or an fs error: keep the supervisor alive
            report.error = f"sweep failed: {type(error).__name__}"
            log.debug("sweep failure detail", exc_info=True)
        self._log(report)
        return report

    # -- the duties --------------------------------------------------------------------

    def _renew(self) -> None:
        """Keep the lease: renewed once a third of its TTL has passed since the last
        renewal (called before every batch and every item). A pass that cannot renew
        stops, so at most one works on the same objects at a time."""
        if self.clock() - self.renewed_at < LEASE_TTL_S / 3:
            return
        try:
            renewed = self.queue.take_lease(LEASE_NAME, self.holder, ttl_s=LEASE_TTL_S)
        except DatabaseUnavailable:
            renewed = False
        if not renewed:
            raise SweepLeaseLost("sweep lease lost: could not renew it; pass stopped")
        self.renewed_at = self.clock()

    def _delete_orphans(self, report: SweepReport) -> None:
        self._delete_listed(
            lambda: self.queue.orphans_due(guard_s=self.orphan_guard, limit=self.batch),
            self.queue.forget_orphans,
            report.orphans_deleted,
            report,
        )

    def _delete_listed(
        self,
        due: Callable[[], list[str]],
        forget: Callable[[list[str]], None],
        deleted: list[str],
        report: SweepReport,
    ) -> None:
        """Delete every version of each listed key, batch by batch, and forget the entries
        of those deleted (orphans, or objects a backfill replaced)."""
        while True:
            self._renew()
            keys = due()
            done: list[str] = []
            try:
                for key in keys:
                    self._renew()
                    report.objects_deleted += self.storage.delete_all_versions(key)
                    done.append(key)
            finally:
                # Only now: an entry forgotten before its object is gone would leak it.
                with contextlib.suppress(DatabaseUnavailable):
                    forget(done)
                deleted += done
            if len(keys) < self.batch:
                return

    def _complete_deletions(self, report: SweepReport) -> None:
        while True:
            self._renew()
            due = self.queue.deletions_due(guard_s=self.delete_guard, limit=self.batch)
            for file_id, original_key in due:
                self._renew()
                if original_key is not None:  # None: a re-derivation's row (its file's)
                    report.objects_deleted += self.storage.delete_all_versions(original_key)
                report.objects_deleted += self.storage.delete_all_versions(
                    derived_prefix(file_id, self.storage.prefix)
                )
                # Fenced on `deleting`: False means another pass finished it first.
                if self.queue.mark_deleted(file_id):
                    report.deletions_completed.append(file_id)
            if len(due) < self.batch:
                return

    def _delete_retired(self, report: SweepReport) -> None:
        self._delete_listed(
            lambda: self.queue.retired_due(guard_s=self.delete_guard, limit=self.batch),
            self.queue.forget_retired,
            report.retired_deleted,
            report,
        )

    def _bound_tables(self, report: SweepReport) -> None:
        self._renew()
        report.waiters_forgotten = self.queue.forget_stale_waiters()
        while self.purge_deleted_days:
            self._renew()
            ids = self.queue.purge_deleted(
                older_than_days=self.purge_deleted_days, limit=self.batch
            )
            report.purged += ids
            if len(ids) < self.batch:
                break
        while self.deliveries_retention_days:
            self._renew()
            gone = self.queue.purge_deliveries(
                older_than_days=self.deliveries_retention_days, limit=self.batch
            )
            for status, n in gone.items():
                report.deliveries_purged[status] = report.deliveries_purged.get(status, 0) + n
            if sum(gone.values()) < self.batch:
                return

    def _log(self, report: SweepReport) -> None:
        fields = {
            "orphans": len(report.orphans_deleted),
            "deletions": len(report.deletions_completed),
            "retired": len(report.retired_deleted),
            "objects": report.objects_deleted,
            "purged": len(report.purged),
            "waiters_forgotten": report.waiters_forgotten,
            "deliveries_purged": sum(report.deliveries_purged.values()),
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
