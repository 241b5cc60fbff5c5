"""The supervisor's one-off writes, through its database thread (derivd.processes.dbthread):
the attempts it ends itself (timed out, released, lease lost, its worker died), the
leases of sweep passes it killed, and its host registry row. Its periodic work is
derivd.processes.duties."""

from __future__ import annotations

import logging
import uuid

from derivd.config import Config
from derivd.logs import event
from derivd.ops.metrics import Metrics
from derivd.processes.dbthread import DatabaseThread
from derivd.processes.lifecycle import Returned
from derivd.queue.db import HostInfo, Job, QueueDB
from derivd.queue.retry import record_failure

log = logging.getLogger("derivd.supervisor")


def warn(message: str, job: Job, **fields: object) -> None:
    """A warning about one attempt: its file and attempt number, and `fields`."""
    event(log, message, logging.WARNING, **job.log_fields(), attempt=job.attempt, **fields)


class Bookkeeping:
    """The supervisor's one-off writes, through the database thread: the attempts it ends
    itself (timed out, released, lease lost), leases of killed sweep passes, and its host
    registry row."""

    def __init__(self, thread: DatabaseThread, metrics: Metrics) -> None:
        self.thread = thread
        self.metrics = metrics

    def fail_timed_out(self, job: Job, config: Config, slot: int) -> None:
        """Record a timeout: resource_limit, retried while attempts remain."""
        settings, timeout = config.queue, config.supervisor.job_timeout

        def fail(db: QueueDB) -> str | None:
            return record_failure(
                db, job, settings, retry=True, code="resource_limit", extra_event="timeout"
            )

        def logged(status: str | None) -> None:
            status = status or "lease_lost or database unavailable"
            warn("job timed out", job, slot=slot, timeout_s=timeout, status=status)

        self.thread.submit("fail", fail, logged)

    def worker_died(self, returned: Returned, config: Config, slot: int) -> None:
        """A dead worker's job back to `queued` (or rejected on its last attempt), fenced,
        with a `worker_died` event; the decision is lifecycle.returned_jobs."""
        job, max_attempts = returned.job, config.queue.max_attempts

        def give_back(db: QueueDB) -> str | None:
            return db.worker_died(job, max_attempts=max_attempts, delay_s=returned.delay_s)

        def logged(status: str | None) -> None:
            status = status or "lease_lost or database unavailable"
            warn("crashed job returned", job, slot=slot, status=status)

        self.thread.submit("worker_died", give_back, logged)

    def release(self, job: Job) -> None:
        """Fenced: a row that moved on since (committed, reclaimed) just gets `lease_lost`."""

        def logged(released: bool | None) -> None:
            event(
                log,
                "job released",
                **job.log_fields(),
                attempt=job.attempt,
                released=bool(released),
            )

        self.thread.submit("release", lambda db: db.release(job), logged)

    def lease_lost(self, job: Job, slot: int) -> None:
        self.metrics.job_killed_lease_lost()
        warn("job killed: lease lost", job, slot=slot)
        self.thread.submit("lease_lost", lambda db: db.record_lease_lost(job))

    def give_back_leases(self, abandoned: list[uuid.UUID], name: str) -> None:
        """Drop leases their holders could not (a sweep pass killed mid-way), fenced on
        each holder's id, so the next holder need not wait for them to expire. One that
        fails (database away) is retried with the next call; or its lease expires."""
        while abandoned:
            self._drop_lease(abandoned, name, abandoned.pop(0))

    def _drop_lease(self, abandoned: list[uuid.UUID], name: str, holder: uuid.UUID) -> None:
        def retry(dropped: bool | None) -> None:
            if dropped is None:
                abandoned.append(holder)

        self.thread.submit(f"drop_lease:{holder}", lambda db: db.drop_lease(name, holder), retry)

    def deregister(self, host: HostInfo) -> None:
        """Fenced on this run's pid and start: never another run's row of the same name."""
        self.thread.submit(
            "deregister", lambda db: db.deregister_host(host.host, host.pid, host.started_at)
        )
