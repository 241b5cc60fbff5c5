"""One attempt at one claimed job, with its stages, each written once: fetch, derive,
store, commit, fail, release.

Every stage is fenced by the attempt's own token (DESIGN.md, "The lease protocol"):
nothing commits, fails or goes back without its lease. What each stage's outcome is
(ready, retry, rejected, lease_lost, released, unknown) is decided here; when and on
which thread a stage runs is `derivd.worker_loop`'s. The crash order is objects first
(a write-ahead record before any PUT), the commit last.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from derivd.derive_clock import DeriveClock, Spent
from derivd.errors import ErrorCode, Permanent, Transient
from derivd.handlers.base import Derivation
from derivd.logs import event
from derivd.pipeline import Stage
from derivd.queue.db import DatabaseUnavailable, Finished, Job
from derivd.queue.retry import record_failure
from derivd.worker import Worker

log = logging.getLogger("derivd.worker")

# How often the worker looks at its stop flag while it waits for an original or for a
# place in its loop (a signal's handler runs in the main thread, but does not end a wait
# on a future or a condition).
STOP_POLL_S = 0.2


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended, as the worker saw it (its report is the loop's)."""

    outcome: str  # ready | retry | rejected | lease_lost | released | unknown
    code: ErrorCode | None = None


READY = Outcome("ready")
UNKNOWN = Outcome("unknown")
LEASE_LOST = Outcome("lease_lost")


@dataclass(eq=False)
class Attempt:
    """One claimed job in the worker loop, from its claim to its outcome."""

    job: Job
    claimed_at: float  # monotonic, taken before its claim was sent
    original: Future[bytes] | None  # its GET, issued as it was claimed (`fetch`)
    waited: bool  # claimed behind another job still to derive (derivd.pipeline.may_start)
    stage: Stage = Stage.HELD
    started_at: float | None = None  # monotonic: its derive began (its deadline runs)
    replaced: bool = False  # its commit carries a claim that takes its place
    lane: Future[None] | None = field(default=None, repr=False)  # its store and commit

    @classmethod
    def fetch(
        cls, worker: Worker, job: Job, claimed_at: float, *, waited: bool, ahead: bool
    ) -> Attempt:
        """The first stage: a claimed job's GET. `ahead`: issued at once on the worker's
        I/O threads, so that it overlaps whatever the worker does before the job starts;
        else when the job is taken up, on the deriving thread (at depth 1 there is
        nothing to overlap it with, and a batch's originals are not all held at once)."""
        original = worker.io.submit(worker.fetch, job) if ahead else None
        return cls(job, claimed_at, original, waited)

    def original_in(
        self,
        worker: Worker,
        clock: DeriveClock,
        stop: Callable[[], bool],
        *,
        within: float,
        tick: Callable[[], None],
    ) -> bytes | None:
        """The original, once what is left of its GET is in (the wait on `clock`, with
        `tick` run every STOP_POLL_S); the job is still held. None: a stop came first
        (the job goes back). Raises what the GET raised, or Transient past `within`
        seconds (a store that hangs): counted as any failed attempt, retried."""
        give_up_at = time.monotonic() + within
        with clock.spending(Spent.ORIGINAL):
            if self.original is None:  # not fetched ahead: its GET now
                return None if stop() else worker.fetch(self.job)
            while True:
                left = give_up_at - time.monotonic()
                if left <= 0:
                    raise Transient(f"its original was not in within {within:g} s")
                try:
                    return self.original.result(timeout=min(STOP_POLL_S, left))
                except TimeoutError:
                    if stop():
                        return None
                    tick()

    def derive(self, worker: Worker, original: bytes, clock: DeriveClock) -> Derivation:
        """Derive the started job's original (on `clock`)."""
        self.original = None  # the original's bytes go with this call
        with clock.spending(Spent.DERIVE):
            return worker.derive_original(original)

    def store(self, worker: Worker, derivation: Derivation) -> Finished:
        """Write-ahead, PUT every variant; what the fenced commit records."""
        return worker.store(self.job, derivation)

    def fail(self, worker: Worker, error: Exception) -> Outcome:
        """Record a failure, classified: content errors final, transient ones retried
        with backoff, anything else retried and ended `processing_failed`. Fenced."""
        job = self.job
        if isinstance(error, Permanent):
            log.debug("%s rejected: %s", job.label, error, exc_info=True)
            return _record(worker, job, retry=False, code=error.code)
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
            return _record(worker, job, retry=True, code=error.code)
        log.error("%s attempt %s failed: %s", job.label, job.attempt, type(error).__name__)
        log.debug("%s failure detail", job.label, exc_info=True)
        return _record(worker, job, retry=True, code="processing_failed")

    def release(self, worker: Worker) -> Outcome:
        """Give a job that never started back: fenced, no attempt burned."""
        if self.original is not None:
            self.original.cancel()
        try:
            released = worker.queue.release(self.job)
        except DatabaseUnavailable as error:
            # The row stays `processing` until its lease expires; the attempt counts.
            log.warning("%s: could not release: %s", self.job.label, error)
            return UNKNOWN
        if not released:
            _lease_lost(self.job)
            return LEASE_LOST
        return Outcome("released")


def commit(
    worker: Worker, stored: Sequence[tuple[Attempt, Finished]], *, claim: int = 0
) -> tuple[list[Outcome], list[Job]]:
    """The fenced commit of `stored`, in one statement; with `claim` the next claim goes
    in the same statement (derivd_commit_and_claim). Each row passes or fails its own
    fence (a failed one is `lease_lost`). Returns each attempt's outcome and the jobs
    claimed.

    A commit whose answer was lost (a dropped connection, a restart, a deadlock) either
    took its commits with it or committed without an answer. The fenced commit alone is
    safe to send again (a row commits once, under its token), so it is sent once more
    before any attempt is called unknown: a success is not left to wait out its lease,
    derived again, or rejected `attempts_exhausted` after its last attempt. The claim
    waits for the next commit."""
    finished = [f for _, f in stored]
    queue = worker.queue
    claimed: list[Job] = []
    try:
        if claim:
            committed, claimed = queue.commit_and_claim(
                finished, limit=claim, **worker.claim_terms()
            )
        else:
            committed = queue.commit_many(finished)
    except DatabaseUnavailable as error:
        log.warning("commit failed (%s); committing again", error)
        try:
            committed = queue.commit_many(finished)
        except DatabaseUnavailable as again:
            # The rows stay `processing`; their leases expire and the attempts count.
            log.warning("commit failed again (%s); outcome unknown", again)
            return [UNKNOWN for _ in stored], []
    outcomes = []
    for attempt, _ in stored:
        job = attempt.job
        if job.id in committed:
            outcomes.append(READY)
        elif job.id in committed.rejected:
            # A re-derivation whose set is not its run's configured one (this worker
            # runs another configuration than the backfill's): the file keeps its set.
            log.error("%s: its variant set is not the backfill's target", job.label)
            outcomes.append(Outcome("rejected", "processing_failed"))
        else:
            _lease_lost(job)
            outcomes.append(LEASE_LOST)
    return outcomes, claimed


def _record(worker: Worker, job: Job, *, retry: bool, code: ErrorCode) -> Outcome:
    try:
        status = record_failure(
            worker.queue, job, worker.config.queue, retry=retry, code=code, rng=worker.rng
        )
    except DatabaseUnavailable as error:
        # The row stays `processing`; its lease expires and the attempt is counted.
        log.warning("%s: could not record failure: %s", job.label, error)
        return Outcome("unknown", code)
    if status is None:
        _lease_lost(job)
        return Outcome("lease_lost", code)
    return Outcome("retry" if status == "queued" else "rejected", code)


def _lease_lost(job: Job) -> None:
    event(log, "lease lost", logging.WARNING, **job.log_fields(), attempt=job.attempt)
