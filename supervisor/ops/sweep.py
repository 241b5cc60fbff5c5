"""The sweeper: the cleanup duties that keep storage and the queue honest.

One pass (`Sweeper.run_once`) does three things, each safe to repeat:

1. Rejects rows whose lease expired on their last allowed attempt (`attempts_exhausted`):
   workers do it when idle, but a queue that is never idle still needs it done.
2. Deletes orphans: objects written by attempts that never committed (a crash after
   PUT, a lost lease), once their write-ahead entry is older than `orphan_guard` and
   their attempt's token can no longer commit. Objects go first, the entries after:
   a crash in between repeats the deletes instead of leaking the objects.
3. Completes deletions older than `delete_guard`: every version of the original and
   everything under `derived/<id>/`, then the row becomes `deleted`.

Every step is idempotent (deleting what is gone is a no-op; the final UPDATEs are fenced
on the state they leave). On top of that one cluster-wide advisory lock lets only one
sweeper work at a time, so two hosts never race on the same objects; the other one skips
its pass. The lock belongs to a session, so a sweeper that dies frees it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from derivd.config import Config
from derivd.ops.logs import event
from derivd.queue.db import DatabaseUnavailable, QueueDB
from derivd.storage.base import Storage, StorageUnavailable, derived_prefix, open_storage

log = logging.getLogger("derivd.sweep")


@dataclass
class SweepReport:
    """What one pass did. `error` is a safe one-line reason when the pass stopped early
    (what was done before it is still listed); `skipped` means another sweeper held the
    lock and this pass did nothing."""

    exhausted: list[int] = field(default_factory=list)
    orphans_deleted: list[str] = field(default_factory=list)
    deletions_completed: list[int] = field(default_factory=list)
    objects_deleted: int = 0
    skipped: bool = False
    error: str | None = None

    @property
    def did_something(self) -> bool:
        return bool(self.exhausted or self.orphans_deleted or self.deletions_completed)


class Sweeper:
    def __init__(
        self,
        queue: QueueDB,
        storage: Storage,
        *,
        orphan_guard: float,
        delete_guard: float,
        max_attempts: int,
        batch: int = 500,
    ) -> None:
        self.queue = queue
        self.storage = storage
        self.orphan_guard = orphan_guard
        self.delete_guard = delete_guard
        self.max_attempts = max_attempts
        self.batch = batch

    @classmethod
    def from_config(
        cls,
        config: Config,
        queue: QueueDB,
        storage: Storage,
        *,
        orphan_guard: float | None = None,
        delete_guard: float | None = None,
    ) -> Sweeper:
        return cls(
            queue,
            storage,
            orphan_guard=config.sweep.orphan_guard if orphan_guard is None else orphan_guard,
            delete_guard=config.sweep.delete_guard if delete_guard is None else delete_guard,
            max_attempts=config.queue.max_attempts,
        )

    def run_once(self) -> SweepReport:
        """One pass. Never raises for an unavailable database or store: the report says
        so, and the next pass picks up where this one stopped."""
        report = SweepReport()
        try:
            if not self.queue.try_sweep_lock():
                report.skipped = True
                log.debug("another sweeper holds the lock; pass skipped")
                return report
            try:
                self._reject_exhausted(report)
                self._delete_orphans(report)
                self._complete_deletions(report)
            finally:
                with contextlib.suppress(DatabaseUnavailable):
                    self.queue.sweep_unlock()
        except (StorageUnavailable, DatabaseUnavailable) as error:
            # Both messages are built by derivd from error codes: safe to show.
            report.error = str(error)
        except Exception as error:  # a bug or an fs error: keep the supervisor alive
            report.error = f"sweep failed: {type(error).__name__}"
            log.debug("sweep failure detail", exc_info=True)
        self._log(report)
        return report

    # -- the three duties --------------------------------------------------------------

    def _reject_exhausted(self, report: SweepReport) -> None:
        while True:
            ids = self.queue.reject_exhausted(max_attempts=self.max_attempts, limit=self.batch)
            report.exhausted += ids
            if len(ids) < self.batch:
                return

    def _delete_orphans(self, report: SweepReport) -> None:
        while True:
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
            due = self.queue.deletions_due(guard_s=self.delete_guard, limit=self.batch)
            for file_id, original_key in due:
                report.objects_deleted += self.storage.delete_all_versions(original_key)
                report.objects_deleted += self.storage.delete_all_versions(
                    derived_prefix(file_id)
                )
                # Fenced on `deleting`: False means another pass finished it first.
                if self.queue.mark_deleted(file_id):
                    report.deletions_completed.append(file_id)
            if len(due) < self.batch:
                return

    def _log(self, report: SweepReport) -> None:
        fields = {
            "exhausted": len(report.exhausted),
            "orphans": len(report.orphans_deleted),
            "deletions": len(report.deletions_completed),
            "objects": report.objects_deleted,
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
) -> Iterator[Sweeper]:
    """A sweeper with its own connection and store, closed on exit, so a caller (the
    supervisor) holds neither between passes."""
    storage = open_storage(config)
    with QueueDB.open(dsn, role="derivd-sweep") as queue:
        yield Sweeper.from_config(
            config, queue, storage, orphan_guard=orphan_guard, delete_guard=delete_guard
        )


def sweep_once(config: Config, dsn: str) -> SweepReport:
    """One pass with fresh connections (what the supervisor calls every [sweep] interval).

    Never raises for an unreachable database or store: `report.error` says what stopped it.
    """
    try:
        with open_sweeper(config, dsn) as sweeper:
            return sweeper.run_once()
    except DatabaseUnavailable as error:  # could not even connect
        report = SweepReport(error=str(error))
        event(log, "sweep skipped", logging.WARNING, reason=report.error)
        return report
