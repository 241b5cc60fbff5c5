"""The supervisor's background duties, each with one contract (River's services).

A duty is started and stopped with the supervisor, runs a round every `interval` seconds
(its own setting), and `run_once(db)` is that round, here and now: what tests and
`derivd sweep` call. `tick(now)` is the loop's side: when a round is due it launches one
without waiting for it. The database duties run their rounds on the database thread
(derivd.processes.dbthread); the sweep forks a child per round
(derivd.processes.sweep_child), because only a child may hold a storage client.

- `Heartbeat` ([queue] heartbeat): the leases of every job held on this host (renewed
  with `renew`), and this host's registry row;
- `ExhaustedRejection` ([queue] exhausted_interval): the one place that rejects rows whose
  worker died on their last allowed attempt (`attempts_exhausted`);
- `FleetStats` ([metrics] interval): the queue gauges, recent events, the registry;
- `EventPartitions` ([sweep] partitions_interval, and at start: whichever process starts
  first makes the days ahead): archive_events partitions ahead, the DEFAULT partition
  emptied, days past retention dropped;
- `Listening` ([database] listen_retry): the LISTEN connection (re)opened, and refused
  (logged once) when it goes through a pooler.

The supervisor's one-off writes (attempts it ends itself, the host registry) go through
the same thread: derivd.processes.bookkeeping.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, ClassVar, Generic, TypeVar

from derivd import __version__
from derivd.config import Config
from derivd.fingerprint import configured_set, target_digest
from derivd.logs import event
from derivd.ops.metrics import Metrics
from derivd.processes.dbthread import DatabaseThread
from derivd.processes.pipe import WorkerProc
from derivd.queue.db import (
    PARENT_STATEMENT_TIMEOUT_S,
    DatabaseUnavailable,
    HostInfo,
    Job,
    LockBusy,
    QueueDB,
    QueueListener,
    QueueStats,
    open_connection,
)

log = logging.getLogger("derivd.supervisor")

T = TypeVar("T")

PARTITIONS_AHEAD_DAYS = 8
# A partition round that found archive_events locked (a long reader) tries again this
# soon instead of waiting for its interval.
PARTITIONS_RETRY_S = 60.0


class Duty(ABC, Generic[T]):
    """Started with the supervisor, stopped with it, a round every `interval` seconds."""

    name: ClassVar[str]

    def __init__(self, config: Callable[[], Config]) -> None:
        self.config = config  # the supervisor's current configuration (SIGHUP changes it)
        self.active = False
        self.due_at = 0.0  # monotonic time of the next round, while active

    @property
    @abstractmethod
    def interval(self) -> float:
        """Seconds between rounds, from the duty's own setting (0: off; a reload may
        turn it on or off)."""

    @property
    def next_round(self) -> float:
        """When `tick` next has something to do (inf: stopped, or off)."""
        return self.due_at if self.active and self.interval > 0 else math.inf

    def start(self, now: float) -> None:
        """The first round at the first chance."""
        self.active, self.due_at = True, now

    def stop(self) -> None:
        self.active = False

    def stopping(self) -> None:
        """The supervisor began a graceful stop; it keeps ticking until the end. Most
        duties go on (the heartbeat protects the jobs still running)."""

    def tick(self, now: float) -> None:
        """Launch a round when one is due. Never waits."""
        if now < self.next_round:
            return
        self.due_at = now + self.interval
        self.launch()

    @abstractmethod
    def launch(self) -> None:
        """Start one round without waiting for it."""


class DatabaseDuty(Duty[T]):
    """A duty whose rounds run on the database thread, one at a time."""

    @abstractmethod
    def run_once(self, db: QueueDB) -> T:
        """One round, here and now (the database thread's, or a test's)."""

    def __init__(self, config: Callable[[], Config], thread: DatabaseThread | None = None) -> None:
        super().__init__(config)
        self.thread = thread  # None: run_once only (tests, `derivd sweep`)

    def launch(self) -> None:
        assert self.thread is not None
        self.thread.submit(self.name, self.run_once, self.on_result, single=True)

    def on_result(self, result: T | None) -> None:
        """In the loop, after the round (None: the database failed)."""


# -- the heartbeat -----------------------------------------------------------------------


def host_info(config: Config, *, busy: int) -> HostInfo:
    return HostInfo(
        host=config.host_id,
        pid=os.getpid(),
        version=__version__,
        backend=config.derive.backend,
        workers=config.worker_count,
        busy=busy,
        heartbeat_s=config.queue.heartbeat_s,
        variant_set=variant_set_of(config),
    )


def variant_set_of(config: Config) -> str:
    """The digest of the variant set `config` derives (what backfill rolls out)."""
    return target_digest(configured_set(config.derive_spec(), config.derive.backend))


def held_jobs(workers: Iterable[WorkerProc]) -> list[Job]:
    """Every job held on this host: running, claimed and not started, derived and not
    yet committed. A worker being killed still holds its jobs until it is reaped."""
    return [job for w in workers for job in w.held.values()]


def lost_tokens(sent: Iterable[Job], valid: set[int]) -> set[uuid.UUID]:
    """The leases the database no longer grants: sent in the heartbeat, not returned (it
    returns the held ones and those their own attempt just ended: a worker whose job
    committed is never killed for it)."""
    return {job.token for job in sent if job.id not in valid}


def to_kill(workers: Iterable[WorkerProc], lost: set[uuid.UUID]) -> list[WorkerProc]:
    """Workers with a job in flight whose lease is lost and that are not being killed
    already. A lost job that has not started yet is left alone: the worker would start
    it and fail its commit, and the next heartbeat finds it running. A worker is killed
    for any job it started and holds (a derive cannot be interrupted otherwise);
    the supervisor releases the others it held, fenced, without burning their attempts
    (derivd.processes.lifecycle.to_release)."""
    found = []
    for worker in workers:
        flying = {job.token for job, _ in worker.in_flight()}
        if flying & lost and worker.kill_reason is None:
            found.append(worker)
    return found


class Heartbeat(DatabaseDuty[set[int]]):
    name = "heartbeat"

    def __init__(
        self,
        config: Callable[[], Config],
        thread: DatabaseThread,
        metrics: Metrics,
        fleet: Callable[[], Iterable[WorkerProc]],
        on_lost: Callable[[set[uuid.UUID]], None],
    ) -> None:
        super().__init__(config, thread)
        self.metrics = metrics
        self.fleet = fleet
        self.on_lost = on_lost  # the supervisor kills the workers running these leases
        self.last_ok: float | None = None  # monotonic time of the last answered heartbeat
        # This run's start in the registry: the heartbeat refreshes that row only.
        self.started_at: datetime | None = None
        self.variant_set_told: str | None = None  # what the registry last learned

    @property
    def interval(self) -> float:
        return self.config().queue.heartbeat_s

    def tick(self, now: float) -> None:
        last = self.last_ok
        self.metrics.set_heartbeat_age(None if last is None else now - last)
        super().tick(now)

    def launch(self) -> None:
        workers = list(self.fleet())
        jobs, busy = held_jobs(workers), sum(1 for w in workers if w.held)
        assert self.thread is not None
        self.thread.submit(
            self.name,
            lambda db: self.run_once(db, jobs, busy),
            lambda valid: self.on_heartbeat(jobs, valid),
            single=True,
        )

    def run_once(self, db: QueueDB, jobs: Sequence[Job] = (), busy: int = 0) -> set[int]:
        """The ids of `jobs` whose lease still holds (renewed with [queue] renew)."""
        config = self.config()
        info = replace(host_info(config, busy=busy), started_at=self.started_at)
        valid = db.heartbeat(info, jobs, renew=config.queue.renew, lease_s=config.queue.lease)
        if info.variant_set != self.variant_set_told and db.record_variant_set(info):
            # Once per change (a reload; the first beat, after a prune re-made the row).
            self.variant_set_told = info.variant_set
        return valid

    def on_heartbeat(self, sent: list[Job], valid: set[int] | None) -> None:
        self.metrics.heartbeat(ok=valid is not None)
        if valid is None:
            return
        self.last_ok = time.monotonic()
        lost = lost_tokens(sent, valid)
        if lost:
            self.on_lost(lost)


# -- rows whose worker died on their last attempt -----------------------------------------


class ExhaustedRejection(DatabaseDuty[list[int]]):
    """Rows whose lease expired on their last allowed attempt are rejected
    `attempts_exhausted`, never reclaimed: a file that kills its worker every time stops
    after max_attempts runs. The claim never takes such a row, so this is the only way
    out of `processing` for it."""

    name = "reject_exhausted"
    batch = 500

    @property
    def interval(self) -> float:
        return self.config().queue.exhausted_interval

    def run_once(self, db: QueueDB) -> list[int]:
        max_attempts = self.config().queue.max_attempts
        rejected: list[int] = []
        while True:
            ids = db.reject_exhausted(max_attempts=max_attempts, limit=self.batch)
            for file_id in ids:
                event(log, "attempts exhausted", logging.WARNING, file_id=file_id)
            rejected += ids
            if len(ids) < self.batch:
                return rejected


# -- the queue gauges ---------------------------------------------------------------------


@dataclass(frozen=True)
class FleetState:
    """One stats round: queue gauges, recent events, the host registry."""

    stats: QueueStats
    events: dict[str, int]
    hosts: list[dict[str, Any]]
    pruned: list[str]


class FleetStats(DatabaseDuty[FleetState]):
    name = "stats"

    def __init__(
        self, config: Callable[[], Config], thread: DatabaseThread, metrics: Metrics
    ) -> None:
        super().__init__(config, thread)
        self.metrics = metrics

    @property
    def interval(self) -> float:
        return self.config().metrics.interval

    def run_once(self, db: QueueDB) -> FleetState:
        config = self.config()
        pruned = db.prune_hosts(guard_s=config.sweep.orphan_guard)
        # Shared gauges: another host's readings younger than an interval are reused.
        max_age = config.metrics.interval
        stats = db.queue_stats(max_age_s=max_age)
        recent = db.event_window(window_s=config.status.window, max_age_s=max_age)
        return FleetState(stats, recent.events, db.hosts(), pruned)

    def on_result(self, result: FleetState | None) -> None:
        if result is None:
            return
        self.metrics.set_queue(result.stats)
        self.metrics.set_event_counts(result.events)
        self.metrics.set_hosts(alive=sum(1 for h in result.hosts if h["alive"]))
        for host in result.pruned:
            event(log, "stale host pruned", host=host)


# -- event partitions ----------------------------------------------------------------------


@dataclass
class PartitionRound:
    """What one partition round did; `busy`: it gave up waiting for its lock (a long
    reader on archive_events) and is tried again soon."""

    created: list[str] = field(default_factory=list)
    rehomed: list[str] = field(default_factory=list)  # days that received DEFAULT's rows
    dropped: list[str] = field(default_factory=list)
    busy: bool = False


class EventPartitions(DatabaseDuty[PartitionRound]):
    name = "event_partitions"

    @property
    def interval(self) -> float:
        return self.config().sweep.partitions_interval

    def run_once(self, db: QueueDB) -> PartitionRound:
        days = self.config().sweep.events_retention_days
        done = PartitionRound()
        try:
            done.created = db.create_event_partitions(PARTITIONS_AHEAD_DAYS)
            done.rehomed = db.rehome_default_events(older_than_days=days)
            if days:
                done.dropped = db.drop_event_partitions(older_than_days=days)
        except LockBusy:
            done.busy = True
        if done.rehomed:
            event(log, "events moved out of the DEFAULT partition", days=len(done.rehomed))
        if done.dropped:
            event(log, "event partitions dropped", partitions=len(done.dropped))
        return done

    def on_result(self, result: PartitionRound | None) -> None:
        if result is None or result.busy:  # retried soon, not a whole interval later
            self.due_at = min(self.due_at, time.monotonic() + PARTITIONS_RETRY_S)


# -- LISTEN ---------------------------------------------------------------------------------


def listen_problem(config: Config, dsn: str) -> str | None:
    """Why LISTEN would silently hear nothing (the listen path goes through a pooler, where
    a LISTEN lands on whichever server connection ran it), or None; None too when the
    database cannot be asked (the workers' boot reports that)."""
    target = config.database.listen_dsn or dsn
    try:
        conn, pooled = open_connection(
            target, application_name="derivd-check", bound_s=PARENT_STATEMENT_TIMEOUT_S
        )
    except DatabaseUnavailable:
        return None
    conn.close()
    return pooled_listen(config) if pooled else None


def pooled_listen(config: Config) -> str:
    setting = "listen_dsn" if config.database.listen_dsn else "dsn"
    return (
        f"[database] {setting} goes through a connection pooler, where LISTEN hears "
        "nothing: set [database] listen_dsn to a direct connection to PostgreSQL "
        "(or [queue] listen = no to poll)"
    )


class Listening(DatabaseDuty[str]):
    """The one LISTEN connection of the fleet's wake-ups. Every (re)connect checks for a
    pooler: through one, wake-ups would be lost without a word, so the connection is
    dropped, the problem logged once (until LISTEN works again) and workers poll."""

    name = "listen"

    def __init__(
        self,
        config: Callable[[], Config],
        thread: DatabaseThread,
        listener: QueueListener,
        on_listening: Callable[[], None],
    ) -> None:
        super().__init__(config, thread)
        self.listener = listener
        self.on_listening = on_listening  # notifications were lost meanwhile: wake all
        self.problem: str | None = None
        thread.watch(listener)

    @property
    def interval(self) -> float:
        return self.config().database.listen_retry

    def run_once(self, db: QueueDB) -> str:
        """`listening` (a new connection), `connected`, `pooled`, `unavailable`, or `off`
        while [queue] listen = no (a reload may turn it on or off)."""
        if not self.config().queue.listen:
            self.listener.close()
            return "off"
        return self.listener.connect()

    def on_result(self, result: str | None) -> None:
        if result == "listening":
            if self.problem is not None:
                event(log, "LISTEN works again: wake-ups resume")
            self.problem = None
            self.on_listening()
        elif result == "pooled" and self.problem is None:
            self.problem = pooled_listen(self.config())
            log.warning("supervisor: %s; workers poll meanwhile", self.problem)
