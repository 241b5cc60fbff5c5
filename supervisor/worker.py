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
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypedDict

from derivd import analysis_rules
from derivd.config import Config
from derivd.errors import ErrorCode, Permanent, Transient
from derivd.fingerprint import configured_set, set_problem, slot
from derivd.handlers.base import Analysis, Derivation, DerivedVariant, DeriveSpec, Handler
from derivd.handlers.registry import create_handler
from derivd.logs import event
from derivd.pipeline import worker_depth
from derivd.queue.db import (
    Committed,
    DatabaseUnavailable,
    Finished,
    Job,
    QueueDB,
    StoredVariant,
)
from derivd.queue.retry import record_failure
from derivd.storage.base import ObjectMissing, Storage, derived_key
from derivd.storage.configured import open_storage
from derivd.storage.parallel import Put, put_all

# How a re-derivation's ending outcomes are reported (the others, retry, lease_lost, ...,
# are an attempt's whatever it derives).
REDERIVATION_OUTCOMES = {"ready": "rederived", "rejected": "rederive_rejected"}


class ClaimTerms(TypedDict):
    """The claim's parameters besides its limit (QueueDB.claim_many / commit_and_claim)."""

    lease_s: float
    max_attempts: int
    host: str | None
    tenant_cap: int
    write_ahead: bool
    key_prefix: str


log = logging.getLogger("derivd.worker")


@dataclass(frozen=True)
class JobResult:
    """What became of one claimed job, as the worker saw it."""

    job: Job
    outcome: str  # ready | retry | rejected | lease_lost | released | unknown
    code: ErrorCode | None
    duration_s: float


class WorkerHooks(Protocol):
    """How a worker tells its supervisor what it is doing (pipes, in prefork mode).

    `jobs_claimed` lists every row the worker now holds (the supervisor releases them
    if it has to kill the worker), `job_started` marks the one job that is running
    (its wall-clock limit starts there), `jobs_finished` reports outcomes, several at a
    time when jobs are short."""

    def jobs_claimed(self, jobs: Sequence[Job]) -> None: ...

    def job_started(self, job: Job) -> None: ...

    def jobs_finished(self, results: Sequence[JobResult]) -> None: ...


class NoHooks:
    def jobs_claimed(self, jobs: Sequence[Job]) -> None:
        return None

    def job_started(self, job: Job) -> None:
        return None

    def jobs_finished(self, results: Sequence[JobResult]) -> None:
        return None


@dataclass(frozen=True)
class _Derived:
    """An attempt whose variants are stored, waiting for its (batched) fenced commit."""

    finished: Finished  # what the commit records
    started: float  # monotonic
    duration_s: float

    @property
    def job(self) -> Job:
        return self.finished.job


# Derived results wait for a batched commit at most this long after their job started:
# short jobs share one commit round trip, and a job that ran this long is committed
# before the next one starts (so real image jobs never wait for another's).
FLUSH_AFTER_S = 0.05
# `run --burst` waits for retries due within this many seconds instead of exiting; it
# says what it leaves behind otherwise (derivd.processes.daemon).
BURST_RETRY_WAIT_S = 10.0
# Threads for a worker's storage requests: every variant of a job at once (the default
# set has five) plus the next original's GET.
IO_THREADS = 8


class IdleWait:
    """Sleep until work may be there: a wake-up fd or the poll interval.

    `wake_fds` are read ends of pipes (a signal wake-up pipe, the supervisor's wake-up
    channel, which it writes to when its LISTEN connection hears of new rows); anything
    readable on them ends the wait and is drained. `on_wait` runs as each wait begins
    (the worker's "idle" process title: it has claimed, found nothing, and waits).
    """

    def __init__(
        self, wake_fds: Sequence[int] = (), on_wait: Callable[[], None] | None = None
    ) -> None:
        self.wake_fds = list(wake_fds)
        self.on_wait = on_wait

    def wait(self, timeout: float) -> None:
        if self.on_wait is not None:
            self.on_wait()
        try:
            ready, _, _ = select.select(self.wake_fds, [], [], timeout)
        except InterruptedError:
            return
        for fd in ready:
            _drain_fd(fd)


def _storable(original: Analysis | None) -> Analysis | None:
    """The handler's analysis as the commit stores it. A malformed one is the backend's
    fault (`processing_failed` at once, before any PUT): the commit would refuse it."""
    if original is None:
        return None
    problem = analysis_rules.problem(original)
    if problem:
        raise Permanent("processing_failed", f"the handler's analysis is malformed: {problem}")
    return analysis_rules.normalised(original)


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
        self.spec: DeriveSpec = config.derive_spec()
        # What each stored variant records as the spec that made it (backfill reads it).
        self.fingerprints = configured_set(self.spec, config.derive.backend)
        self.hooks: WorkerHooks = hooks or NoHooks()
        self.rng = rng or random.Random()
        self.jobs_done = 0
        self._count_lock = threading.Lock()  # a pipelined worker finishes jobs on two threads
        # `noop` (reads_original = False) measures the queue itself: no GET.
        self.reads_original = bool(getattr(handler, "reads_original", True))
        # Nor a write-ahead prefix at each claim (stores_objects = False): the worker
        # registers the keys of any variant such a handler returns itself, durably.
        self.stores_objects = bool(getattr(handler, "stores_objects", True))
        self._pending: list[_Derived] = []
        # Jobs claimed by the last commit (commit_and_claim), with when it was sent.
        self._prefetched: tuple[list[Job], float] | None = None
        self._unreported: list[JobResult] = []
        # The threads a job's PUTs (and the pipeline's I/O) run on, made on first use, in
        # the process that works (after any fork).
        self._io: ThreadPoolExecutor | None = None

    @property
    def io(self) -> ThreadPoolExecutor:
        if self._io is None:
            self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="derivd-io")
        return self._io

    @classmethod
    def create(cls, config: Config, dsn: str, *, hooks: WorkerHooks | None = None) -> Worker:
        """Open everything this process needs. Raises on a bad boot (caller reports it)."""
        queue = QueueDB.open(dsn, role=f"derivd-worker-{os.getpid()}", generic_plans=True)
        storage = open_storage(config)
        handler = create_handler(config.derive.backend, config.derive_spec())
        return cls(config, queue=queue, storage=storage, handler=handler, hooks=hooks)

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)
        self.queue.close()

    # -- one job ---------------------------------------------------------------------

    def _claim_terms(self) -> ClaimTerms:
        """What every claim of this worker asks for, from [queue] and the host: one place
        for the claim alone and the claim that follows a commit."""
        q = self.config.queue
        return ClaimTerms(
            lease_s=q.lease,
            max_attempts=q.max_attempts,
            host=self.config.host_id,
            tenant_cap=q.max_in_flight_per_tenant,
            write_ahead=self.stores_objects,
            key_prefix=self.storage.prefix,
        )

    def claim_many(self, limit: int) -> list[Job]:
        jobs = self.queue.claim_many(limit=limit, **self._claim_terms())
        if jobs:
            self.hooks.jobs_claimed(jobs)
        return jobs

    def _run_job(self, job: Job) -> None:
        """Derive and store; a success waits in `_pending` for the batched commit, a
        failure is recorded (fenced) at once."""
        started = time.monotonic()
        self.hooks.job_started(job)
        try:
            derivation = self._derive(job)
            self._check_set(job, derivation)
            original = _storable(derivation.original)
            stored = self._store(job, derivation)
        except Exception as error:  # classified in _failed
            self._commit_pending()  # keep outcomes in order; fail after the earlier commits
            outcome, code = self._failed(job, error)
            self._finish(job, outcome, code, time.monotonic() - started)
            return
        duration_s = time.monotonic() - started
        self._pending.append(_Derived(Finished(job, stored, original), started, duration_s))

    def _failed(self, job: Job, error: Exception) -> tuple[str, ErrorCode | None]:
        if isinstance(error, Permanent):
            log.debug("%s rejected: %s", job.label, error, exc_info=True)
            return self._fail(job, retry=False, code=error.code), error.code
        if isinstance(error, Transient):
            # The message may carry text we did not write (a plugin's, a library's): the
            # class name is what INFO and above get; the text stays at DEBUG.
            log.warning(
                "%s attempt %s failed transiently: %s",
                job.label,
                job.attempt,
                error if error.own_words else type(error).__name__,
            )
            log.debug("%s transient failure: %s", job.label, error, exc_info=True)
            return self._fail(job, retry=True, code=error.code), error.code
        # unknown: retry, end as processing_failed
        log.error("%s attempt %s failed: %s", job.label, job.attempt, type(error).__name__)
        log.debug("%s failure detail", job.label, exc_info=True)
        return self._fail(job, retry=True, code="processing_failed"), "processing_failed"

    def _finish(self, job: Job, outcome: str, code: ErrorCode | None, duration_s: float) -> None:
        """One attempt's outcome: its log line now, its report with the next flush."""
        self._unreported.append(self.outcome(job, outcome, code, duration_s))

    def outcome(
        self, job: Job, outcome: str, code: ErrorCode | None, duration_s: float
    ) -> JobResult:
        """Count and log one attempt's outcome; the report is the caller's. A
        re-derivation's end is not a file's: `rederived` / `rederive_rejected` (the
        metrics' ready and rejected counts are files')."""
        with self._count_lock:
            self.jobs_done += 1
        if job.for_file != job.id:
            outcome = REDERIVATION_OUTCOMES.get(outcome, outcome)
        event(
            log,
            "job finished",
            **job.log_fields(),
            attempt=job.attempt,
            outcome=outcome,
            code=code or "-",
            duration_s=duration_s,
            wait_s=job.wait_s,
            backend=self.handler.name,
        )
        return JobResult(job, outcome, code, duration_s)

    def _commit_pending(self) -> None:
        """One fenced commit for every derived attempt waiting; each row passes or fails
        its own fence (a failed one gets `lease_lost`)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        try:
            committed = self.queue.commit_many([d.finished for d in pending])
        except DatabaseUnavailable:
            # The rows stay `processing`; their leases expire and the attempts count.
            for d in pending:
                self._finish(d.job, "unknown", None, d.duration_s)
            raise
        self._record_commits(pending, committed)

    def _commit_and_claim_next(self, max_jobs: int) -> None:
        """The steady state: commit what is pending and claim the next batch in one
        statement (one round trip and one transaction per job at claim_batch = 1, every
        fence unchanged). The new jobs wait in `_prefetched` for the next run_batch."""
        pending, self._pending = self._pending, []
        limit = self._claim_limit(max_jobs, pending=len(pending))
        sent = time.monotonic()
        try:
            committed, jobs = self.queue.commit_and_claim(
                [d.finished for d in pending], limit=limit, **self._claim_terms()
            )
        except DatabaseUnavailable as error:
            self._commit_again(pending, error)
            return
        self._record_commits(pending, committed)
        self.flush()  # outcomes first: the supervisor then learns of the rows now held
        if jobs:
            self.hooks.jobs_claimed(jobs)
        self._prefetched = (jobs, sent)

    def _commit_again(self, pending: list[_Derived], error: DatabaseUnavailable) -> None:
        """A commit-and-claim that failed (a deadlock, a dropped connection, a restart)
        took its commits with it, or committed without an answer. The fenced commit
        alone is safe to send again (a row commits once, under its token), so it is sent
        once more before any attempt is called unknown: a success is not left to wait out
        its lease, derived again, or rejected `attempts_exhausted` after its last attempt.
        The claim waits for the next batch. Raises DatabaseUnavailable (the attempts
        then unknown) if the database is still away."""
        log.warning("commit and claim failed (%s); committing again", error)
        self._pending = [*pending, *self._pending]
        self._commit_pending()

    def _record_commits(self, pending: Sequence[_Derived], committed: Committed) -> None:
        for d in pending:
            if d.job.id in committed:
                self._finish(d.job, "ready", None, d.duration_s)
            elif d.job.id in committed.rejected:
                # A re-derivation whose set is not its run's configured one (this worker
                # runs another configuration than the backfill's): the file keeps its set.
                log.error("%s: its variant set is not the backfill's target", d.job.label)
                self._finish(d.job, "rejected", "processing_failed", d.duration_s)
            else:
                event(
                    log, "lease lost", logging.WARNING, **d.job.log_fields(), attempt=d.job.attempt
                )
                self._finish(d.job, "lease_lost", None, d.duration_s)

    def flush(self) -> list[JobResult]:
        """Commit what is pending and report every outcome not yet reported."""
        try:
            self._commit_pending()
        finally:
            reported, self._unreported = self._unreported, []
            if reported:
                self.hooks.jobs_finished(reported)
        return reported

    def _release_unstarted(self, jobs: Sequence[Job]) -> None:
        """Give back claimed jobs that will not run here (stopping, or too little lease
        left for a whole job): fenced, no attempt burned."""
        for job in jobs:
            try:
                released = self.queue.release(job)
            except DatabaseUnavailable:
                self._finish(job, "unknown", None, 0.0)
                continue
            if not released:
                event(log, "lease lost", logging.WARNING, **job.log_fields(), attempt=job.attempt)
            self._finish(job, "released" if released else "lease_lost", None, 0.0)

    def _derive(self, job: Job) -> Derivation:
        return self.derive_original(self.fetch(job))

    def fetch(self, job: Job) -> bytes:
        """The job's original, by key and version (nothing for a handler that reads none)."""
        if job.original_version is None:
            raise ObjectMissing("row has no original version")
        if not self.reads_original:
            return b""
        return self.storage.get(
            job.original_key, job.original_version, max_bytes=self.spec.max_input_bytes
        )

    def derive_original(self, original: bytes) -> Derivation:
        return Derivation.of(self.handler.derive(original, self.spec))

    def store(self, job: Job, derivation: Derivation) -> Finished:
        """Write-ahead, PUT every variant, and what the fenced commit records. Raises
        Permanent for a malformed analysis before any PUT."""
        self._check_set(job, derivation)
        original = _storable(derivation.original)
        return Finished(job, self._store(job, derivation), original)

    def _check_set(self, job: Job, variants: Sequence[DerivedVariant]) -> None:
        """A backend fault (final) unless the handler returned exactly the configured set
        (or, deriving for the first time, nothing: noop): checked before any PUT. A file
        is never `ready` with part of its set, and a re-derivation never swaps in one."""
        rederive = job.for_file != job.id
        problem = set_problem(
            (slot(v.name, v.format) for v in variants), self.fingerprints, rederive=rederive
        )
        if problem:
            raise Permanent("processing_failed", f"{self.handler.name}: {problem}")

    def _store(self, job: Job, variants: Sequence[DerivedVariant]) -> list[StoredVariant]:
        # Under the file's prefix: a re-derivation's objects belong to the file it serves.
        keys = [
            derived_key(job.for_file, job.token, v.name, v.extension, self.storage.prefix)
            for v in variants
        ]
        if keys and not (self.stores_objects and self.queue.write_ahead_durable(job)):
            # Write-ahead: a crash after a PUT leaves a record for the orphan sweep. The
            # claim registered the attempt's prefix; this is its flush when no durable
            # statement has ended since (the first job after an idle claim), or the
            # record itself when the claim registered none (stores_objects = False).
            self.queue.register_pending(job, keys)
        puts = [
            Put(key, v.data, v.content_type, v.sha256)
            for key, v in zip(keys, variants, strict=True)
        ]
        versions = put_all(self.storage, puts, self.io)
        return [
            StoredVariant(
                v.name,
                key,
                version,
                v.sha256,
                v.width,
                v.height,
                v.format,
                v.content_type,
                self.fingerprints.get(slot(v.name, v.format)),
                len(v.data),
            )
            for key, version, v in zip(keys, versions, variants, strict=True)
        ]

    def _fail(self, job: Job, *, retry: bool, code: ErrorCode) -> str:
        try:
            status = record_failure(
                self.queue, job, self.config.queue, retry=retry, code=code, rng=self.rng
            )
        except DatabaseUnavailable as error:
            # The row stays `processing`; its lease expires and the attempt is counted.
            log.warning("%s: could not record failure: %s", job.label, error)
            return "unknown"
        if status is None:
            event(log, "lease lost", logging.WARNING, **job.log_fields(), attempt=job.attempt)
            return "lease_lost"
        return "retry" if status == "queued" else "rejected"

    # -- the loop ----------------------------------------------------------------------

    def _claim_limit(self, max_jobs: int, *, pending: int = 0) -> int:
        limit = self.config.queue.claim_batch
        if max_jobs:
            limit = max(1, min(limit, max_jobs - self.jobs_done - pending))
        return limit

    def run_batch(self, should_stop: Callable[[], bool], *, max_jobs: int = 0) -> int:
        """Run up to `[queue] claim_batch` jobs (`run_claimed`): the ones the previous
        batch's commit claimed, else a fresh claim. Returns how many were claimed (0:
        nothing was claimable when asked)."""
        if self._prefetched is not None:
            jobs, sent = self._prefetched
            self._prefetched = None
        else:
            sent = time.monotonic()
            jobs = self.claim_many(self._claim_limit(max_jobs))
        self.run_claimed(jobs, should_stop, claimed_at=sent, max_jobs=max_jobs, claim_next=True)
        return len(jobs)

    def _may_claim_next(self, should_stop: Callable[[], bool], max_jobs: int) -> bool:
        if not self._pending or should_stop():
            return False
        return not (max_jobs and self.jobs_done + len(self._pending) >= max_jobs)

    def release_prefetched(self) -> None:
        """Give back jobs claimed for a next batch that will not run (stopping)."""
        if self._prefetched is None:
            return
        jobs, _ = self._prefetched
        self._prefetched = None
        try:
            self._release_unstarted(jobs)
        finally:
            with contextlib.suppress(DatabaseUnavailable):
                self.flush()

    def run_claimed(
        self,
        jobs: Sequence[Job],
        should_stop: Callable[[], bool] = lambda: False,
        *,
        claimed_at: float | None = None,
        max_jobs: int = 0,
        claim_next: bool = False,
    ) -> None:
        """Run claimed jobs in claim order, commit them, report every outcome. A job is
        only started while its lease still covers a whole job (job_timeout + kill_grace,
        counted from `claimed_at`, taken before the claim was sent); stopping or running
        out of lease releases the rest at once. With `claim_next`, a batch that ran whole
        is committed together with the claim of the next one."""
        q, sup = self.config.queue, self.config.supervisor
        sent = time.monotonic() if claimed_at is None else claimed_at
        # With renewal the supervisor's heartbeat keeps every held lease ahead of us.
        latest_start = (
            float("inf") if q.renew else sent + q.lease - (sup.job_timeout + sup.kill_grace)
        )
        started = 0
        try:
            for job in jobs:
                now = time.monotonic()
                # The first job starts right after its claim, as with claim_batch = 1
                # (a lease shorter than a job, which the config check refuses, must not
                # turn into claim-release forever).
                if should_stop() or (started and now > latest_start):
                    break
                if self._pending and now - self._pending[0].started >= FLUSH_AFTER_S:
                    self.flush()
                self._run_job(job)
                started += 1
            if claim_next and started == len(jobs) and self._may_claim_next(should_stop, max_jobs):
                self._commit_and_claim_next(max_jobs)
            else:
                self._commit_pending()
            self._release_unstarted(jobs[started:])
        except DatabaseUnavailable:
            for job in jobs[started:]:
                self._finish(job, "unknown", None, 0.0)
            raise
        finally:
            self.flush()

    def run(
        self,
        should_stop: Callable[[], bool],
        *,
        idle: IdleWait | None = None,
        burst: bool = False,
        max_jobs: int = 0,
    ) -> str:
        """Work until told to stop. Returns why it stopped: stopped, drained, max_jobs.
        Jobs claimed for a batch that will not run are given back on the way out. With
        `[supervisor] pipeline` above 1 the jobs overlap (derivd.pipelined)."""
        depth = worker_depth(
            self.config.pipeline_depth,
            reads_original=self.reads_original,
            stores_objects=self.stores_objects,
        )
        if depth > 1:
            from derivd.pipelined import PipelinedRun

            run = PipelinedRun(self, depth)
            return run.run(should_stop, idle or IdleWait(), burst=burst, max_jobs=max_jobs)
        try:
            return self._loop(should_stop, idle or IdleWait(), burst=burst, max_jobs=max_jobs)
        finally:
            self.release_prefetched()

    def burst_wait(self) -> float | None:
        """With --burst and nothing claimable: how long to wait for a retry due within
        BURST_RETRY_WAIT_S (at most a poll interval at a time), or None: drained. A burst
        that left a retry due a second later would leave work nobody picks up."""
        try:
            _waiting, due_s = self.queue.not_yet_due()
        except DatabaseUnavailable:
            return self.config.queue.poll_interval
        if due_s is None or due_s > BURST_RETRY_WAIT_S:
            return None
        return min(max(due_s, 0.01), self.config.queue.poll_interval)

    def _loop(
        self, should_stop: Callable[[], bool], idle: IdleWait, *, burst: bool, max_jobs: int
    ) -> str:
        while not should_stop():
            if max_jobs and self.jobs_done >= max_jobs:
                return "max_jobs"
            try:
                claimed = self.run_batch(should_stop, max_jobs=max_jobs)
            except DatabaseUnavailable as error:
                log.warning("%s; retrying in %.1fs", error, self.config.queue.poll_interval)
                idle.wait(self.config.queue.poll_interval)
                continue
            if not claimed:
                # Rows whose worker died on their last attempt are not claimable: the
                # supervisor's ExhaustedRejection duty ends them (derivd.processes.duties).
                due_in = self.burst_wait() if burst else None
                if burst and due_in is None:
                    return "drained"
                idle.wait(due_in if due_in is not None else self.config.queue.poll_interval)
        return "stopped"
