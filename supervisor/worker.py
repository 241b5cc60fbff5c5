"""One worker: what it holds and the work it does on one job (GET the original, derive,
write-ahead and PUT the variants). Its loop is `derivd.worker_loop` (`run`), an
attempt's stages and their outcomes `derivd.attempt`.

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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypedDict

from derivd import analysis_rules
from derivd.config import Config
from derivd.errors import ErrorCode, Permanent
from derivd.fingerprint import configured_set, set_problem, slot
from derivd.handlers.base import Analysis, Derivation, DerivedVariant, DeriveSpec, Handler
from derivd.handlers.registry import create_handler
from derivd.logs import event
from derivd.pipeline import worker_depth
from derivd.queue.db import DatabaseUnavailable, Finished, Job, QueueDB, StoredVariant
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
        self._count_lock = threading.Lock()  # jobs end on the loop's store lanes too
        # `noop` (reads_original = False) measures the queue itself: no GET.
        self.reads_original = bool(getattr(handler, "reads_original", True))
        # Nor a write-ahead prefix at each claim (stores_objects = False): the worker
        # registers the keys of any variant such a handler returns itself, durably.
        self.stores_objects = bool(getattr(handler, "stores_objects", True))
        # How many jobs this worker has at different stages (it tells its supervisor).
        self.depth = worker_depth(
            config.supervisor.pipeline,
            config.queue.claim_batch,
            reads_original=self.reads_original,
            stores_objects=self.stores_objects,
        )
        # The threads a job's PUTs and the next job's GET run on, made on first use, in
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

    # -- what its loop asks of it (derivd.worker_loop) ---------------------------------

    def claim_terms(self) -> ClaimTerms:
        """What every claim of this worker asks for, from [queue] and the host: one place
        for the claim alone and the claim that rides on a commit."""
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
        """Claim up to `limit` jobs and report them held."""
        jobs = self.queue.claim_many(limit=limit, **self.claim_terms())
        if jobs:
            self.hooks.jobs_claimed(jobs)
        return jobs

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

    # -- one job's work ----------------------------------------------------------------

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
        Permanent for a wrong set or a malformed analysis before any PUT."""
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
