"""A pipelined worker's loop: while one job's variants are stored and committed, the next
job's original is fetched and derived (`[supervisor] pipeline`, DESIGN.md "Pipelined
worker"; the decisions are `derivd.pipeline`).

Threads, all in the worker process (made after fork):

- this one (the worker's main thread) claims, derives one job at a time, fails a job
  whose derive failed, releases a job a stop finds waiting, and answers signals;
- a store lane (one thread per pipeline place) runs a derived job's write-ahead, its
  PUTs (side by side, on the worker's I/O threads) and its fenced commit, and folds the
  next claim into that commit when the pipeline has room then (one round trip);
- the I/O threads run each claimed job's GET as soon as it is claimed.

Each job keeps its own token, lease and fence: its commit, failure or release is fenced
by its token alone, so a job whose lease was lost while it waited is refused at its
commit (`lease_lost`, its objects left to the orphan sweep) and never committed. Every
claim is reported to the supervisor with its start at once (`jobs_claimed`, then
`job_started`): its deadline (job_timeout) runs from its claim, and the supervisor knows
every job the worker holds. The crash order is the one-job worker's: objects first
(write-ahead record before any PUT), the commit last.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from derivd.derive_clock import DeriveClock, Spent
from derivd.errors import ErrorCode
from derivd.handlers.base import Derivation
from derivd.logs import event
from derivd.pipeline import OnStop, Stage, claim_room, on_stop
from derivd.queue.db import DatabaseUnavailable, Finished, Job

if TYPE_CHECKING:
    from derivd.worker import IdleWait, JobResult, Worker

log = logging.getLogger("derivd.worker")

# How often the main thread looks at its stop flag while it waits for a store to end
# (a signal's handler runs in this thread, but does not end a wait on a condition).
STOP_POLL_S = 0.2


@dataclass(eq=False)
class InFlight:
    """One claimed job in the pipeline."""

    job: Job
    started: float  # monotonic, when its claim was sent: its deadline counts from here
    original: Future[bytes]
    prefetched: bool = False  # claimed while other jobs were in the pipeline
    replaced: bool = False  # its commit carries a claim that takes its place
    stage: Stage = Stage.FETCHING
    store: Future[None] | None = field(default=None, repr=False)


class PipelinedRun:
    """One run of a worker's loop with `depth` jobs at most in flight."""

    def __init__(self, worker: Worker, depth: int) -> None:
        self.worker = worker
        self.depth = depth
        self.cond = threading.Condition()
        self.jobs: list[InFlight] = []  # claim order; guarded by `cond`
        self.claiming = 0  # claims sent and not yet answered
        self.stopping = False
        self.max_jobs = 0
        self.lanes = ThreadPoolExecutor(depth, thread_name_prefix="derivd-store")
        self.report_lock = threading.Lock()  # outcomes reach the supervisor in order
        self.clock = DeriveClock()  # the main thread's derives and waits

    # -- the main thread -----------------------------------------------------------------

    def run(
        self, should_stop: Callable[[], bool], idle: IdleWait, *, burst: bool, max_jobs: int
    ) -> str:
        """Work until told to stop. Returns why it stopped: stopped, drained, max_jobs."""
        self.max_jobs = max_jobs
        try:
            return self._loop(should_stop, idle, burst=burst)
        finally:
            self._stop()
            self._drain()
            self.lanes.shutdown(wait=True)
            event(log, "pipeline time", logging.INFO, depth=self.depth, **self.clock.fields())

    def _loop(self, should_stop: Callable[[], bool], idle: IdleWait, *, burst: bool) -> str:
        while True:
            if should_stop():
                self._stop()  # no more claims; what is not derived yet is `_derive`'s
            if self.stopping and self._next_to_derive() is None:
                return "stopped"  # the stores drain on the way out (`run`)
            if self.max_jobs and self.worker.jobs_done >= self.max_jobs and not self._held():
                return "max_jobs"
            try:
                claimed = self._claim_if_room()
            except DatabaseUnavailable as error:
                log.warning("%s; retrying in %.1fs", error, self.worker.config.queue.poll_interval)
                idle.wait(self.worker.config.queue.poll_interval)
                continue
            nxt = self._next_to_derive()
            if nxt is not None:
                self._derive(nxt, should_stop)
            elif self._held():
                self._wait_for_a_place(should_stop, claimed=claimed)
            elif not claimed:
                # Nothing held and nothing claimable: rows whose worker died on their last
                # attempt are the ExhaustedRejection duty's (derivd.processes.duties).
                due_in = self.worker.burst_wait() if burst else None
                if burst and due_in is None:
                    return "drained"
                poll = self.worker.config.queue.poll_interval
                idle.wait(due_in if due_in is not None else poll)

    def _held(self) -> int:
        with self.cond:
            return len(self.jobs) + self.claiming

    def _jobs_left(self) -> int | None:
        return self.max_jobs - self.worker.jobs_done if self.max_jobs else None

    def _claim_limit(self, *, folded: bool = False) -> int:
        """Under `cond`: how many to claim (`claim_room`), reserved (`claiming`).
        `folded`: the claim goes with a commit."""
        limit = claim_room(
            [j.stage for j in self.jobs],
            depth=self.depth,
            claiming=self.claiming,
            replaced=sum(j.replaced for j in self.jobs),
            stopping=self.stopping,
            jobs_left=self._jobs_left(),
            folded=folded,
        )
        self.claiming += limit
        return limit

    def _claim_if_room(self) -> bool:
        with self.cond:
            limit = self._claim_limit()
        if not limit:
            return False
        sent = time.monotonic()
        jobs: list[Job] = []
        try:
            jobs = self.worker.queue.claim_many(limit=limit, **self.worker._claim_terms())
        finally:
            self._admit(jobs, sent, reserved=limit)
        return bool(jobs)

    def _admit(self, jobs: Sequence[Job], sent: float, *, reserved: int) -> None:
        """Claimed jobs enter the pipeline: the supervisor learns of them (held, and each
        started: its deadline runs from its claim), and each one's GET is issued."""
        if jobs:
            self.worker.hooks.jobs_claimed(jobs)
            for job in jobs:
                self.worker.hooks.job_started(job)
        entries = [InFlight(j, sent, self.worker.io.submit(self.worker.fetch, j)) for j in jobs]
        with self.cond:
            for entry in entries:
                entry.prefetched = bool(self.jobs)
                self.jobs.append(entry)
            self.claiming -= reserved
            self.cond.notify_all()

    def _next_to_derive(self) -> InFlight | None:
        with self.cond:
            return next((j for j in self.jobs if j.stage is Stage.FETCHING), None)

    def _derive(self, entry: InFlight, should_stop: Callable[[], bool]) -> None:
        """Derive `entry` here (once its GET is in), then hand it to a store lane. A stop
        before its derive starts releases it instead."""
        try:
            with self.clock.spending(Spent.ORIGINAL):
                original = entry.original.result()
        except Exception as error:  # the GET failed: classified like any failure
            self._fail(entry, error)
            return
        if should_stop():
            self._stop()
        with self.cond:
            if self.stopping and self._on_stop(entry) is OnStop.RELEASE:
                release = True
            else:
                release = False
                entry.stage = Stage.DERIVING
        if release:
            self._release(entry)
            return
        # The next job is claimed as this derive starts, so its GET overlaps the derive.
        try:
            self._claim_if_room()
        except DatabaseUnavailable as error:
            log.warning("claim failed: %s", error)
        try:
            with self.clock.spending(Spent.DERIVE):
                derivation = self.worker.derive_original(original)
        except Exception as error:  # classified in _failed
            self._fail(entry, error)
            return
        del original  # the original's bytes go before the next derive
        entry.original = _done(b"")
        with self.cond:
            # Nothing to PUT (noop): its commit is next, and carries the next claim.
            entry.stage = Stage.STORING if derivation else Stage.COMMITTING
            entry.store = self.lanes.submit(self._store_and_commit, entry, derivation)

    def _wait_for_a_place(self, should_stop: Callable[[], bool], *, claimed: bool) -> None:
        """Every held job is being stored: wait until one ends, a stop comes, or (when
        the last claim found nothing, with room left) the poll interval passes, for
        the next claim to look again."""
        poll = self.worker.config.queue.poll_interval
        until = time.monotonic() + (poll if not claimed else float("inf"))
        with self.clock.spending(Spent.PLACE), self.cond:
            before = len(self.jobs)
            while len(self.jobs) == before and not self.stopping:
                left = until - time.monotonic()
                if left <= 0 or should_stop():
                    return
                if self.cond.wait(min(STOP_POLL_S, left)):
                    return

    @staticmethod
    def _on_stop(entry: InFlight) -> OnStop:
        return on_stop(entry.stage, prefetched=entry.prefetched)

    def _stop(self) -> None:
        with self.cond:
            self.stopping = True

    def _drain(self) -> None:
        """On the way out (the loop derived what a stop drains): release what waits for
        a derive still, let the stores end."""
        while True:
            with self.cond:
                waiting = [j for j in self.jobs if j.stage is Stage.FETCHING]
                storing = [j for j in self.jobs if j.store is not None]
            if not waiting and not storing:
                return
            for entry in waiting:
                self._release(entry)
            for entry in storing:
                assert entry.store is not None
                entry.store.exception()  # waits; the lane reports its outcome itself
                with self.cond:
                    stuck = entry in self.jobs
                if stuck:  # the lane ended without an outcome (a bug): say so, move on
                    self._end(entry, "unknown", None)

    # -- outcomes (either thread) ---------------------------------------------------------

    def _fail(self, entry: InFlight, error: Exception) -> None:
        outcome, code = self.worker._failed(entry.job, error)
        self._end(entry, outcome, code)

    def _release(self, entry: InFlight) -> None:
        """Give a job that never reached its derive back: fenced, no attempt burned. Not
        while a claim is on its way: one decided before the stop (a store lane's, folded
        into its commit) would take the released row straight back, to be released again."""
        entry.original.cancel()
        with self.cond:
            while self.claiming:
                self.cond.wait()
        try:
            released = self.worker.queue.release(entry.job)
        except DatabaseUnavailable:
            self._end(entry, "unknown", None)
            return
        if not released:
            event(
                log,
                "lease lost",
                logging.WARNING,
                **entry.job.log_fields(),
                attempt=entry.job.attempt,
            )
        self._end(entry, "released" if released else "lease_lost", None)

    def _end(self, entry: InFlight, outcome: str, code: ErrorCode | None) -> None:
        """`entry` leaves the pipeline with its outcome, reported at once."""
        result = self.worker.outcome(entry.job, outcome, code, time.monotonic() - entry.started)
        self._report([result])
        with self.cond:
            if entry in self.jobs:
                self.jobs.remove(entry)
            self.cond.notify_all()

    def _report(self, results: Sequence[JobResult]) -> None:
        with self.report_lock:
            self.worker.hooks.jobs_finished(results)

    # -- a store lane ---------------------------------------------------------------------

    def _store_and_commit(self, entry: InFlight, derivation: Derivation) -> None:
        try:
            finished = self.worker.store(entry.job, derivation)
        except Exception as error:  # classified in _failed
            self._fail(entry, error)
            return
        try:
            self._commit(entry, finished)
        except Exception as error:  # a bug, not an outcome: the row's lease decides
            log.error("%s commit step failed: %s", entry.job.label, type(error).__name__)
            log.debug("commit step failure detail", exc_info=True)
            self._end(entry, "unknown", None)

    def _commit(self, entry: InFlight, finished: Finished) -> None:
        """The fenced commit; with room in the pipeline once this job leaves, the next
        claim goes in the same statement (derivd_commit_and_claim)."""
        with self.cond:
            entry.stage = Stage.COMMITTING
            limit = self._claim_limit(folded=True)
            entry.replaced = limit > 0  # what the claim takes arrives after it leaves
        sent = time.monotonic()
        claimed: list[Job] = []
        queue = self.worker.queue
        try:
            if limit:
                committed, claimed = queue.commit_and_claim(
                    [finished], limit=limit, **self.worker._claim_terms()
                )
            else:
                committed = queue.commit_many([finished])
        except DatabaseUnavailable as error:
            # The row stays `processing`; its lease expires and the attempt is counted.
            log.warning("%s: could not commit: %s", entry.job.label, error)
            self._end(entry, "unknown", None)
            self._admit([], sent, reserved=limit)
            return
        except BaseException:
            self._admit([], sent, reserved=limit)  # the reservation ends with the claim
            raise
        if entry.job.id in committed:
            self._end(entry, "ready", None)
        else:
            event(
                log,
                "lease lost",
                logging.WARNING,
                **entry.job.log_fields(),
                attempt=entry.job.attempt,
            )
            self._end(entry, "lease_lost", None)
        self._admit(claimed, sent, reserved=limit)


def _done(value: bytes) -> Future[bytes]:
    future: Future[bytes] = Future()
    future.set_result(value)
    return future
