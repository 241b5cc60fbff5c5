"""The supervisor's own database work: the LISTEN connection, failing the attempt of a
worker it killed past `job_timeout`, releasing jobs, rejecting exhausted rows, queue
stats for the metrics.

Workers hold their own connections; this is the parent's, opened lazily and survived
when the database is away (logged once, retried on the next call).
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from derivd.config import Config
from derivd.ops.logs import event
from derivd.ops.metrics import Metrics
from derivd.queue.db import DatabaseUnavailable, Job, QueueDB, QueueListener
from derivd.queue.retry import record_failure

log = logging.getLogger("derivd.supervisor")

T = TypeVar("T")


class Upkeep:
    def __init__(
        self, dsn: str, metrics: Metrics, *, listen: bool, listen_dsn: str = ""
    ) -> None:
        self.dsn = dsn
        self.metrics = metrics
        self.rng = random.Random()
        self._queue: QueueDB | None = None
        self._warned = False
        # One LISTEN connection for the fleet (none in --burst: no worker ever idles).
        # LISTEN needs a session of its own: a direct connection when dsn is a pooler.
        self.listener = QueueListener(listen_dsn or dsn) if listen else None
        self.listen_retry_at = 0.0
        self.maintenance_at = 0.0  # monotonic
        self.stats_at = 0.0

    def _db(self, action: Callable[[QueueDB], T]) -> T | None:
        """Run one queue call; a database outage is logged once and survived."""
        try:
            if self._queue is None:
                self._queue = QueueDB.open(self.dsn, role="derivd-supervisor")
            result = action(self._queue)
        except DatabaseUnavailable as error:
            if not self._warned:
                log.warning("supervisor: %s", error)
                self._warned = True
            return None
        self._warned = False
        return result

    # -- wake-up on NOTIFY -------------------------------------------------------------

    def keep_listening(self, config: Config, now: float) -> bool:
        """(Re)open the LISTEN connection when `[queue] listen` is on (closed when a
        reload turns it off). True when it was just (re)opened: notifications sent
        while nobody listened are lost, so every idle worker should claim once."""
        if self.listener is None:
            return False
        if not config.queue.listen:
            self.listener.close()
            return False
        if self.listener.connected or now < self.listen_retry_at:
            return False
        if self.listener.connect():
            return True
        self.listen_retry_at = now + min(config.queue.poll_interval, 5.0)
        return False

    def listen_fd(self) -> int | None:
        return self.listener.fileno() if self.listener else None

    def notifications(self) -> int:
        return self.listener.drain() if self.listener else 0

    # -- attempts the supervisor ends --------------------------------------------------

    def fail_timed_out(self, job: Job, config: Config) -> str | None:
        """Record a timeout (resource_limit, retried while attempts remain)."""
        return self._db(
            lambda db: record_failure(
                db,
                job,
                config.queue,
                retry=True,
                code="resource_limit",
                rng=self.rng,
                extra_event="timeout",
            )
        )

    def release(self, job: Job) -> bool:
        """Fenced: a row that moved on since (committed, reclaimed) just gets `lease_lost`."""
        released = bool(self._db(lambda db: db.release(job)))
        event(log, "job released", file_id=job.id, attempt=job.attempt, released=released)
        return released

    # -- periodic ------------------------------------------------------------------------

    def due(self, now: float) -> bool:
        return now >= self.maintenance_at

    def maintain(self, config: Config, now: float) -> bool:
        """Every poll interval: reject rows whose worker died on their last attempt;
        every metrics interval, refresh the queue gauges (True then)."""
        self.maintenance_at = now + config.queue.poll_interval
        max_attempts = config.queue.max_attempts
        for file_id in self._db(lambda db: db.reject_exhausted(max_attempts=max_attempts)) or []:
            event(log, "attempts exhausted", logging.WARNING, file_id=file_id)
        if now < self.stats_at:
            return False
        self.stats_at = now + config.metrics.interval
        self.refresh_queue_metrics(config)
        return True

    def refresh_queue_metrics(self, config: Config) -> None:
        """One stats query and one event count per interval, whatever the scrape rate."""
        # Shared gauges: reuse what another host computed within the interval.
        max_age = config.metrics.interval
        stats = self._db(lambda db: db.queue_stats(max_age_s=max_age))
        if stats is not None:
            self.metrics.set_queue(stats)
        since = datetime.now(UTC) - timedelta(seconds=config.status.window)
        counts: dict[str, int] | None = self._db(lambda db: db.event_counts(since))
        if counts is not None:
            self.metrics.set_event_counts(counts)

    def give_back_leases(self, abandoned: list[uuid.UUID], name: str) -> None:
        """Drop leases their holders could not (a sweep pass killed mid-way), fenced on
        each holder's id, so the next holder need not wait for them to expire."""
        while abandoned:
            if self._db(lambda db: db.drop_lease(name, abandoned[0])) is None:
                return  # database unreachable: retried next time (or the lease expires)
            abandoned.pop(0)

    def fds(self) -> list[int]:
        """Descriptors a forked child must close."""
        fd = self.listen_fd()
        return [] if fd is None else [fd]

    def close(self) -> None:
        if self._queue is not None:
            self._queue.close()
        if self.listener is not None:
            self.listener.close()
