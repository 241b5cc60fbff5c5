"""One worker: claim -> GET original -> derive -> PUT variants -> fenced commit.

Everything a worker holds (database connection, storage client, image library) is created
by `Worker.create` in the process that runs it, after any fork. Work happens outside any
transaction; the only writes that matter are the fenced statements of `QueueDB`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import select
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from handlers.base import DerivedVariant, DeriveSpec, Handler
from handlers.registry import create_handler
from supervisor.backoff import retry_delay
from supervisor.logs import event
from supervisor.outcomes import ErrorCode, Permanent, Transient
from supervisor.queue import DatabaseUnavailable, Job, QueueDB, StoredVariant
from supervisor.settings import Config
from supervisor.storage import Storage, derived_key, open_storage

log = logging.getLogger("derivd.worker")

NOTIFY_CHANNEL = "derivd_queued"


@dataclass(frozen=True)
class JobResult:
    """What became of one claimed job, as the worker saw it."""

    job: Job
    outcome: str  # ready | retry | rejected | lease_lost | released | unknown
    code: ErrorCode | None
    duration_s: float


class WorkerHooks(Protocol):
    """How a worker tells its supervisor what it is doing (a pipe, in prefork mode)."""

    def job_started(self, job: Job) -> None: ...

    def job_finished(self, result: JobResult) -> None: ...


class NoHooks:
    def job_started(self, job: Job) -> None:
        return None

    def job_finished(self, result: JobResult) -> None:
        return None


class IdleWait:
    """Sleep until work may be there: a wake-up fd or the poll interval.

    `wake_fds` are read ends of pipes (a signal wake-up pipe, the supervisor's wake-up
    channel, which it writes to when its LISTEN connection hears of new rows); anything
    readable on them ends the wait and is drained.
    """

    def __init__(self, wake_fds: Sequence[int] = ()) -> None:
        self.wake_fds = list(wake_fds)

    def wait(self, timeout: float) -> None:
        try:
            ready, _, _ = select.select(self.wake_fds, [], [], timeout)
        except InterruptedError:
            return
        for fd in ready:
            _drain_fd(fd)

    def close(self) -> None:
        return None


def _drain_fd(fd: int) -> None:
    with contextlib.suppress(BlockingIOError, InterruptedError):
        os.read(fd, 4096)


class Worker:
    def __init__(
        self,
        config: Config,
        *,
        queue: QueueDB,
        storage: Storage,
        handler: Handler,
        hooks: WorkerHooks | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.queue = queue
        self.storage = storage
        self.handler = handler
        self.spec: DeriveSpec = config.derive.spec()
        self.hooks: WorkerHooks = hooks or NoHooks()
        self.rng = rng or random.Random()
        self.jobs_done = 0

    @classmethod
    def create(cls, config: Config, dsn: str, *, hooks: WorkerHooks | None = None) -> Worker:
        """Open everything this process needs. Raises on a bad boot (caller reports it)."""
        queue = QueueDB.open(dsn, role=f"derivd-worker-{os.getpid()}")
        storage = open_storage(config)
        handler = create_handler(config.derive.backend, config.derive.spec())
        return cls(config, queue=queue, storage=storage, handler=handler, hooks=hooks)

    def close(self) -> None:
        self.queue.close()

    # -- one job -----------------------------------------------------------------------

    def claim(self) -> Job | None:
        q = self.config.queue
        return self.queue.claim(lease_s=q.lease, max_attempts=q.max_attempts)

    def run_once(self) -> JobResult | None:
        """Claim and process one job; None when nothing is claimable."""
        job = self.claim()
        if job is None:
            return None
        return self.process(job)

    def process(self, job: Job) -> JobResult:
        started = time.monotonic()
        self.hooks.job_started(job)
        outcome, code = self._attempt(job)
        result = JobResult(job, outcome, code, time.monotonic() - started)
        self.jobs_done += 1
        event(
            log,
            "job finished",
            file_id=job.id,
            attempt=job.attempt,
            outcome=outcome,
            code=code or "-",
            duration_s=result.duration_s,
            wait_s=job.wait_s,
            backend=self.handler.name,
        )
        self.hooks.job_finished(result)
        return result

    def _attempt(self, job: Job) -> tuple[str, ErrorCode | None]:
        try:
            variants = self._derive(job)
            stored = self._store(job, variants)
            committed = self.queue.commit(job, stored)
        except Permanent as error:
            log.debug("job %s rejected: %s", job.id, error, exc_info=True)
            return self._fail(job, retry=False, code=error.code), error.code
        except Transient as error:
            # The message may carry text we did not write (a plugin's, a library's): the
            # class name is what INFO and above get; the text stays at DEBUG.
            log.warning(
                "job %s attempt %s failed transiently: %s",
                job.id,
                job.attempt,
                type(error).__name__,
            )
            log.debug("job %s transient failure: %s", job.id, error, exc_info=True)
            return self._fail(job, retry=True, code=error.code), error.code
        except Exception as error:  # unknown: retry, end as processing_failed
            log.error(
                "job %s attempt %s failed: %s",
                job.id,
                job.attempt,
                type(error).__name__,
            )
            log.debug("job %s failure detail", job.id, exc_info=True)
            return self._fail(job, retry=True, code="processing_failed"), "processing_failed"
        if not committed:
            event(log, "lease lost", logging.WARNING, file_id=job.id, attempt=job.attempt)
            return "lease_lost", None
        return "ready", None

    def _derive(self, job: Job) -> list[DerivedVariant]:
        if job.original_version is None:
            raise Permanent("processing_failed", "row has no original version")
        original = self.storage.get(
            job.original_key, job.original_version, max_bytes=self.spec.max_input_bytes
        )
        return self.handler.derive(original, self.spec)

    def _store(self, job: Job, variants: Sequence[DerivedVariant]) -> list[StoredVariant]:
        keys = [derived_key(job.id, job.token, v.name) for v in variants]
        if keys:
            # Write-ahead: a crash after a PUT leaves a record for the orphan sweep.
            self.queue.register_pending(job, keys)
        return [
            StoredVariant(
                v.name,
                key,
                self.storage.put(key, v.data, v.content_type),
                v.sha256,
                v.width,
                v.height,
            )
            for key, v in zip(keys, variants, strict=True)
        ]

    def _fail(self, job: Job, *, retry: bool, code: ErrorCode) -> str:
        q = self.config.queue
        delay = retry_delay(
            job.attempt, base=q.retry_base, cap=q.retry_max, jitter=q.retry_jitter, rng=self.rng
        )
        try:
            status = self.queue.fail(
                job, retry=retry, code=code, max_attempts=q.max_attempts, delay_s=delay
            )
        except DatabaseUnavailable as error:
            # The row stays `processing`; its lease expires and the attempt is counted.
            log.warning("job %s: could not record failure: %s", job.id, error)
            return "unknown"
        if status is None:
            event(log, "lease lost", logging.WARNING, file_id=job.id, attempt=job.attempt)
            return "lease_lost"
        return "retry" if status == "queued" else "rejected"

    def reject_exhausted(self) -> list[int]:
        """Reject rows whose worker died on their last attempt (cheap; run when idle)."""
        ids = self.queue.reject_exhausted(max_attempts=self.config.queue.max_attempts)
        for file_id in ids:
            event(log, "attempts exhausted", logging.WARNING, file_id=file_id)
        return ids

    def release(self, job: Job) -> bool:
        return self.queue.release(job)

    # -- the loop ----------------------------------------------------------------------

    def run(
        self,
        should_stop: Callable[[], bool],
        *,
        idle: IdleWait | None = None,
        burst: bool = False,
        max_jobs: int = 0,
    ) -> str:
        """Work until told to stop. Returns why it stopped: stopped, drained, max_jobs."""
        idle = idle or IdleWait()
        while not should_stop():
            if max_jobs and self.jobs_done >= max_jobs:
                return "max_jobs"
            try:
                result = self.run_once()
            except DatabaseUnavailable as error:
                log.warning("%s; retrying in %.1fs", error, self.config.queue.poll_interval)
                idle.wait(self.config.queue.poll_interval)
                continue
            if result is None:
                if self.reject_exhausted():
                    continue
                if burst:
                    return "drained"
                idle.wait(self.config.queue.poll_interval)
        return "stopped"
