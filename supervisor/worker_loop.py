"""The worker loop, the only one: claim, start each job in claim order, derive it, store
and commit it, at any depth (`[supervisor] pipeline`, DESIGN.md "Pipelined worker";
its decisions are `derivd.pipeline`, an attempt's stages `derivd.attempt`).

Threads, all in the worker process (made after fork):

- this one (the worker's main thread) claims, starts and derives one job at a time,
  fails a job whose derive failed, releases a held job a stop (or its own lease) sends
  back, and answers signals;
- a store lane (one thread per pipeline place; at depth 1 the main thread itself) runs
  a derived job's write-ahead, its PUTs (side by side, on the worker's I/O threads) and
  its fenced commit, and folds the next claim into that commit when there is room then
  (one round trip);
- the I/O threads run each claimed job's GET as soon as it is claimed.

A job is *held* from its claim and *started* when its derive begins, once its original
is in (`job_started`: the supervisor's deadline for it runs from there, and only the job
started last is counted when its worker dies). A held job starts only while its own
lease still covers a whole job (`derivd.pipeline.may_start`), otherwise it goes back
unburned: the time it waited behind another job never costs it its lease or an
attempt. A stop sends back every held job and lets the started ones end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from derivd.attempt import STOP_POLL_S, UNKNOWN, Attempt, Outcome, commit
from derivd.derive_clock import DeriveClock, Spent
from derivd.handlers.base import Derivation
from derivd.logs import event
from derivd.pipeline import (
    OnStop,
    Stage,
    StartTerms,
    capacity,
    claim_room,
    defer_commit,
    may_start,
    on_stop,
)
from derivd.queue.db import DatabaseUnavailable, Finished, Job
from derivd.worker import IdleWait, Worker

log = logging.getLogger("derivd.worker")

# A stored job's commit waits for the next one's at most this long after its job
# started (a claim batch of short jobs shares one commit round trip; a job that ran
# this long is committed before the next one starts).
FLUSH_AFTER_S = 0.05


def run(
    worker: Worker,
    should_stop: Callable[[], bool],
    *,
    idle: IdleWait | None = None,
    burst: bool = False,
    max_jobs: int = 0,
) -> str:
    """Work until told to stop, at the worker's depth. Returns why it stopped: stopped,
    drained, max_jobs. Jobs held and not started are given back on the way out."""
    loop = WorkerLoop(worker, worker.depth)
    return loop.run(should_stop, idle or IdleWait(), burst=burst, max_jobs=max_jobs)


def run_claimed(worker: Worker, jobs: Sequence[Job], *, claimed_at: float | None = None) -> None:
    """Run jobs claimed already, in claim order, through the same loop (no claim of its
    own), each to its reported outcome. `claimed_at`: taken before their claim was sent
    (default: now)."""
    sent = time.monotonic() if claimed_at is None else claimed_at
    WorkerLoop(worker, worker.depth, claims=False).run_claimed(jobs, IdleWait(), claimed_at=sent)


class WorkerLoop:
    """One run of a worker's loop with `depth` jobs at most at different stages (a claim
    batch at depth 1). `claims` = False: no claims of its own, only the jobs handed to
    `run_claimed`."""

    def __init__(self, worker: Worker, depth: int, *, claims: bool = True) -> None:
        config = worker.config
        self.worker = worker
        self.depth = depth
        self.batch = config.queue.claim_batch
        self.limit = capacity(depth, self.batch)
        self.terms = StartTerms(
            lease_s=config.queue.lease,
            job_timeout=config.supervisor.job_timeout,
            kill_grace=config.supervisor.kill_grace,
            renew=config.queue.renew,
        )
        self.claims = claims
        self.cond = threading.Condition()
        self.attempts: list[Attempt] = []  # claim order; guarded by `cond`
        self.claiming = 0  # jobs asked for by claims not yet answered
        self.stopping = False
        self.should_stop: Callable[[], bool] = lambda: False  # the run's (`run`)
        self.max_jobs = 0
        # Depth 1 stores and commits on this thread: nothing to overlap it with.
        self.inline = depth == 1
        self.lanes = None if self.inline else ThreadPoolExecutor(depth, "derivd-store")
        # Stored attempts whose commit waits to share a round trip (inline only).
        self.stored: list[tuple[Attempt, Finished]] = []
        self.report_lock = threading.Lock()  # outcomes reach the supervisor whole
        self.clock = DeriveClock()  # this thread's derives and waits

    # -- the main thread ---------------------------------------------------------------

    def run(
        self, should_stop: Callable[[], bool], idle: IdleWait, *, burst: bool, max_jobs: int
    ) -> str:
        """Work until told to stop. Returns why it stopped: stopped, drained, max_jobs.
        On the way out every held job goes back (once) and every started one ends."""
        self.max_jobs = max_jobs
        self.should_stop = should_stop
        try:
            return self._loop(idle, burst=burst)
        finally:
            self._stop()
            self._drain()
            if self.lanes is not None:
                self.lanes.shutdown(wait=True)
            event(log, "pipeline time", logging.INFO, depth=self.depth, **self.clock.fields())

    def run_claimed(self, jobs: Sequence[Job], idle: IdleWait, *, claimed_at: float) -> str:
        """Run jobs claimed already (their claim reported) to their outcomes."""
        self._admit(jobs, claimed_at, reserved=0, announce=False)
        return self.run(lambda: False, idle, burst=True, max_jobs=0)

    def _loop(self, idle: IdleWait, *, burst: bool) -> str:
        poll = self.worker.config.queue.poll_interval
        while True:
            if self._stop_requested():
                return "stopped"  # held jobs go back, started ones end (`run`)
            if self.max_jobs and self.worker.jobs_done >= self.max_jobs and not self._held():
                return "max_jobs"
            try:
                claimed = self._claim_if_room()
            except DatabaseUnavailable as error:
                log.warning("%s; retrying in %.1fs", error, poll)
                idle.wait(poll)
                continue
            nxt = self._next_held()
            if nxt is not None:
                self._take_up(nxt)
            elif self._held():
                self._commit_stored()
                self._wait_for_a_place(claimed=claimed)
            elif not claimed:
                if not self.claims:
                    return "drained"
                # Nothing held and nothing claimable: rows whose worker died on their last
                # attempt are the ExhaustedRejection duty's (derivd.processes.duties).
                due_in = self.worker.burst_wait() if burst else None
                if burst and due_in is None:
                    return "drained"
                idle.wait(due_in if due_in is not None else poll)

    def _held(self) -> int:
        with self.cond:
            return len(self.attempts) + self.claiming

    def _next_held(self) -> Attempt | None:
        with self.cond:
            return next((a for a in self.attempts if a.stage is Stage.HELD), None)

    def _reserve(self, *, leaving: Sequence[Attempt] = ()) -> int:
        """Under `cond`: how many jobs to claim (`claim_room`), reserved (`claiming`).
        `leaving`: the attempts whose commit the claim goes with."""
        if not self.claims:
            return 0
        if self.should_stop():  # a claim on a commit must not wait for the loop to look
            self.stopping = True
        limit = claim_room(
            [a.stage for a in self.attempts],
            limit=self.limit,
            batch=self.batch,
            claiming=self.claiming,
            replaced=sum(a.replaced for a in self.attempts),
            leaving=len(leaving),
            stopping=self.stopping,
            jobs_left=self.max_jobs - self.worker.jobs_done if self.max_jobs else None,
        )
        for attempt in leaving:
            attempt.replaced = limit > 0  # what the claim takes arrives after it leaves
        self.claiming += limit
        return limit

    def _claim_if_room(self) -> bool:
        with self.cond:
            limit = self._reserve()
        if not limit:
            return False
        sent = time.monotonic()
        jobs: list[Job] = []
        try:
            jobs = self.worker.queue.claim_many(limit=limit, **self.worker.claim_terms())
        finally:
            self._admit(jobs, sent, reserved=limit)
        return bool(jobs)

    def _admit(
        self, jobs: Sequence[Job], sent: float, *, reserved: int, announce: bool = True
    ) -> None:
        """Claimed jobs enter the loop, held: the supervisor learns of them, and each
        one's GET is issued. A job claimed behind one still to derive has waited."""
        if jobs and announce:
            self.worker.hooks.jobs_claimed(jobs)
        with self.cond:
            ahead = any(a.stage in (Stage.HELD, Stage.DERIVING) for a in self.attempts)
            for i, job in enumerate(jobs):
                waited = ahead or i > 0
                attempt = Attempt.fetch(
                    self.worker, job, sent, waited=waited, ahead=not self.inline
                )
                self.attempts.append(attempt)
            self.claiming -= reserved
            self.cond.notify_all()

    def _take_up(self, attempt: Attempt) -> None:
        """Once its original is in, start `attempt` and derive it here, then hand it to a
        store lane; or give it back unburned (a stop, or too little of its lease left for
        a whole job)."""
        within = self.terms.job_timeout
        try:
            original = attempt.original_in(
                self.worker,
                self.clock,
                self._stop_requested,
                within=within,
                tick=lambda: self._release_late(attempt),
            )
        except Exception as error:  # its GET failed: classified by the attempt
            self._commit_stored()  # outcomes in order: the earlier commits first
            self._end([attempt], [attempt.fail(self.worker, error)])
            return
        now = time.monotonic()
        with self.cond:
            if original is None or self._stop_requested():
                start = on_stop(attempt.stage) is not OnStop.RELEASE
            else:
                start = may_start(
                    now, claimed_at=attempt.claimed_at, waited=attempt.waited, terms=self.terms
                )
            if start:
                attempt.stage, attempt.started_at = Stage.DERIVING, now
        if not start or original is None:
            self._commit_stored()
            self._release(attempt, late=original is not None and not self.stopping)
            return
        self._release_late(attempt)
        if self.stored and now - (self.stored[0][0].started_at or now) >= FLUSH_AFTER_S:
            self._commit_stored()
        try:  # the next job is claimed as this one starts: its GET overlaps the derive
            self._claim_if_room()
        except DatabaseUnavailable as error:
            log.warning("claim failed: %s", error)
        # Started only now, right before its derive: a crash during the claim above costs
        # this job nothing (it is still held), and its deadline runs from here.
        self.worker.hooks.job_started(attempt.job)
        try:
            derivation = attempt.derive(self.worker, original, self.clock)
        except Exception as error:  # classified by the attempt
            self._commit_stored()  # outcomes in order: the earlier commits first
            self._end([attempt], [attempt.fail(self.worker, error)])
            return
        del original  # its bytes go before the next job's
        with self.cond:
            # Nothing to PUT (noop): its commit is next, and carries the next claim.
            attempt.stage = Stage.STORING if derivation else Stage.COMMITTING
            if self.lanes is not None:
                attempt.lane = self.lanes.submit(self._store_and_commit, attempt, derivation)
        if self.lanes is None:
            self._store_and_commit(attempt, derivation)

    def _release_late(self, ahead: Attempt) -> None:
        """Held jobs behind `ahead` (about to start, or waiting for its original) whose
        own latest start has passed go back now, unburned: each would wait for a whole
        job more, and its lease might not outlast the wait."""
        now = time.monotonic()
        with self.cond:
            late = [
                a
                for a in self.attempts
                if a.stage is Stage.HELD
                and a is not ahead
                and not may_start(now, claimed_at=a.claimed_at, waited=a.waited, terms=self.terms)
            ]
        for attempt in late:
            self._release(attempt, late=True)

    def _wait_for_a_place(self, *, claimed: bool) -> None:
        """Every held job is being stored: wait until one ends, a stop comes, or (when
        the last claim found nothing, with room left) the poll interval passes, for
        the next claim to look again."""
        poll = self.worker.config.queue.poll_interval
        until = time.monotonic() + (poll if not claimed else float("inf"))
        with self.clock.spending(Spent.PLACE), self.cond:
            before = len(self.attempts)
            while len(self.attempts) == before and not self.stopping:
                left = until - time.monotonic()
                if left <= 0 or self.should_stop():
                    return
                if self.cond.wait(min(STOP_POLL_S, left)):
                    return

    def _stop(self) -> None:
        with self.cond:
            self.stopping = True

    def _stop_requested(self) -> bool:
        """Whether the loop is stopping: `should_stop` is asked, and remembered."""
        if self.should_stop():
            self._stop()
        return self.stopping

    def _drain(self) -> None:
        """On the way out: commit what waits for a commit, release each held job (once:
        it leaves the loop with its outcome), let the stores end."""
        while True:
            self._commit_stored()
            with self.cond:
                held = [a for a in self.attempts if a.stage is Stage.HELD]
                storing = [a for a in self.attempts if a.lane is not None]
                stray = [a for a in self.attempts if a.stage is not Stage.HELD and a.lane is None]
            if stray:  # started, no lane, no outcome (a bug): say so, move on
                self._end(stray, [UNKNOWN] * len(stray))
            if not held and not storing and not stray:
                return
            for attempt in held:
                self._release(attempt)
            for attempt in storing:
                assert attempt.lane is not None
                attempt.lane.exception()  # waits; the lane reports its outcome itself
                with self.cond:
                    stuck = attempt in self.attempts
                if stuck:  # the lane ended without an outcome (a bug): say so, move on
                    self._end([attempt], [UNKNOWN])

    # -- outcomes (either thread) -------------------------------------------------------

    def _release(self, attempt: Attempt, *, late: bool = False) -> None:
        """Give a held job back (`late`: its latest start has passed). Not while a claim
        is on its way: one decided before the stop (a store lane's, folded into its
        commit) would take the released row straight back, to be released again."""
        if late:
            log.info("%s: too little of its lease left to start; released", attempt.job.label)
        with self.cond:
            while self.claiming:
                self.cond.wait()
        self._end([attempt], [attempt.release(self.worker)])

    def _end(self, attempts: Sequence[Attempt], outcomes: Sequence[Outcome]) -> None:
        """`attempts` leave the loop with their outcomes, reported at once, together."""
        now = time.monotonic()
        results = [
            self.worker.outcome(a.job, o.outcome, o.code, now - (a.started_at or a.claimed_at))
            for a, o in zip(attempts, outcomes, strict=True)
        ]
        with self.report_lock:
            self.worker.hooks.jobs_finished(results)
        with self.cond:
            for attempt in attempts:
                if attempt in self.attempts:
                    self.attempts.remove(attempt)
            self.cond.notify_all()

    # -- a store lane (the main thread at depth 1) --------------------------------------

    def _store_and_commit(self, attempt: Attempt, derivation: Derivation) -> None:
        try:
            finished = attempt.store(self.worker, derivation)
        except Exception as error:  # classified by the attempt
            self._commit_stored()
            self._end([attempt], [attempt.fail(self.worker, error)])
            return
        now = time.monotonic()
        with self.cond:
            attempt.stage = Stage.COMMITTING
            self.stored.append((attempt, finished))
            first = self.stored[0][0]
            wait = defer_commit(
                inline=self.inline,
                next_held=not self.stopping and any(a.stage is Stage.HELD for a in self.attempts),
                oldest_age_s=now - (first.started_at or now),
                flush_after_s=FLUSH_AFTER_S,
            )
        if not wait:
            self._commit_stored()

    def _commit_stored(self) -> None:
        """The fenced commit of every stored attempt waiting; with room once they leave,
        the next claim goes in the same statement."""
        with self.cond:
            group, self.stored = self.stored, []
            claim = self._reserve(leaving=[a for a, _ in group]) if group else 0
        if not group:
            return
        sent = time.monotonic()
        claimed: list[Job] = []
        outcomes = [UNKNOWN] * len(group)
        try:
            try:
                outcomes, claimed = commit(self.worker, group, claim=claim)
            except Exception as error:  # a bug, not an outcome: the rows' leases decide
                log.error("commit step failed: %s", type(error).__name__)
                log.debug("commit step failure detail", exc_info=True)
            self._end([a for a, _ in group], outcomes)
        finally:
            self._admit(claimed, sent, reserved=claim)  # the reservation ends with it
