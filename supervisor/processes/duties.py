"""What the supervisor asks of the database, and when: the heartbeat (lease check of every
job held on this host, optional renewal, host registry), maintenance (reject exhausted
rows), stats (queue gauges, host registry, pruning stale hosts), and the attempts it ends
itself (timeouts, releases, lost leases).

`Duties` hands each one to `derivd.processes.upkeep` (run on its thread) and reads the
answers back in the loop; what to do about a lost lease is the arbiter's (`on_lost`).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from derivd import __version__
from derivd.config import Config
from derivd.ops.logs import event
from derivd.ops.metrics import Metrics
from derivd.processes.pipe import WorkerProc
from derivd.processes.upkeep import Upkeep
from derivd.queue.db import HostInfo, Job, QueueDB, QueueStats
from derivd.queue.retry import record_failure

log = logging.getLogger("derivd.supervisor")


@dataclass
class Schedule:
    """Monotonic due times of the periodic duties (0: at the first chance)."""

    heartbeat: float = 0.0
    maintenance: float = 0.0
    stats: float = 0.0

    def next(self) -> float:
        return min(self.heartbeat, self.maintenance, self.stats)


@dataclass
class HeartbeatState:
    last_ok: float | None = None  # monotonic time of the last answered heartbeat
    beats: int = 0
    failures: int = 0
    sent: list[Job] = field(default_factory=list)


def host_info(config: Config, *, busy: int) -> HostInfo:
    return HostInfo(
        host=config.host_id,
        pid=os.getpid(),
        version=__version__,
        backend=config.derive.backend,
        workers=config.worker_count,
        busy=busy,
        heartbeat_s=config.queue.heartbeat_s,
    )


def held_jobs(workers: Iterable[WorkerProc]) -> list[Job]:
    """Every job held on this host: running, claimed and not started, derived and not
    yet committed. A worker being killed still holds its jobs until it is reaped."""
    return [job for w in workers for job in w.held.values()]


def heartbeat_task(config: Config, jobs: list[Job], busy: int) -> Callable[[QueueDB], set[int]]:
    info = host_info(config, busy=busy)
    renew, lease = config.queue.renew, config.queue.lease
    return lambda db: db.heartbeat(info, jobs, renew=renew, lease_s=lease)


def lost_tokens(sent: Iterable[Job], valid: set[int]) -> set[uuid.UUID]:
    """The leases the database no longer grants: sent in the heartbeat, not returned (it
    returns the held ones and those their own attempt just ended: a worker whose job
    committed is never killed for it)."""
    return {job.token for job in sent if job.id not in valid}


def to_kill(workers: Iterable[WorkerProc], lost: set[uuid.UUID]) -> list[WorkerProc]:
    """Workers whose running job lost its lease and that are not being killed already.
    A lost job that has not started yet is left alone: the worker would start it and
    fail its commit, and the next heartbeat finds it running."""
    found = []
    for worker in workers:
        running = worker.running()
        if running is not None and running[0].token in lost and worker.kill_reason is None:
            found.append(worker)
    return found


@dataclass(frozen=True)
class Snapshot:
    """One stats round: queue gauges, recent events, the host registry."""

    stats: QueueStats
    events: dict[str, int]
    hosts: list[dict[str, Any]]
    pruned: list[str]


def stats_task(config: Config) -> Callable[[QueueDB], Snapshot]:
    window, guard = config.status.window, config.sweep.orphan_guard
    max_age = config.metrics.interval  # shared gauges: reuse another host's recent stats

    def run(db: QueueDB) -> Snapshot:
        pruned = db.prune_hosts(guard_s=guard)
        stats = db.queue_stats(max_age_s=max_age)
        recent = db.event_window(window_s=window, max_age_s=max_age)
        return Snapshot(stats, recent.events, db.hosts(), pruned)

    return run


class Duties:
    """The supervisor's database duties, on their timers, through `upkeep`'s thread."""

    def __init__(
        self, upkeep: Upkeep, metrics: Metrics, on_lost: Callable[[set[uuid.UUID]], None]
    ) -> None:
        self.upkeep = upkeep
        self.metrics = metrics
        self.on_lost = on_lost  # the arbiter kills the workers running these leases
        self.schedule = Schedule()
        self.beat = HeartbeatState()

    def tick(self, config: Config, now: float, workers: Iterable[WorkerProc], busy: int) -> None:
        """Whatever is due: heartbeat, maintenance, stats. Never waits."""
        last = self.beat.last_ok
        self.metrics.set_heartbeat_age(None if last is None else now - last)
        self.upkeep.check_stuck(now)
        q, sched = config.queue, self.schedule
        if now >= sched.heartbeat:
            sched.heartbeat = now + q.heartbeat_s
            self.send_heartbeat(config, held_jobs(workers), busy)
        if now >= sched.maintenance:
            sched.maintenance = now + q.poll_interval
            self.upkeep.submit("reject_exhausted", _reject_exhausted(config), single=True)
        if now >= sched.stats:
            sched.stats = now + config.metrics.interval
            self.upkeep.submit("stats", stats_task(config), self.on_stats, single=True)

    def send_heartbeat(self, config: Config, jobs: list[Job], busy: int) -> None:
        self.upkeep.submit(
            "heartbeat",
            heartbeat_task(config, jobs, busy),
            lambda valid: self.on_heartbeat(jobs, valid),
            single=True,
        )

    def on_heartbeat(self, sent: list[Job], valid: set[int] | None) -> None:
        self.metrics.heartbeat(ok=valid is not None)
        if valid is None:
            return
        self.beat.last_ok = time.monotonic()
        self.beat.beats += 1
        lost = lost_tokens(sent, valid)
        if lost:
            self.on_lost(lost)

    def on_stats(self, snapshot: Snapshot | None) -> None:
        if snapshot is None:
            return
        self.metrics.set_queue(snapshot.stats)
        self.metrics.set_event_counts(snapshot.events)
        self.metrics.set_hosts(alive=sum(1 for h in snapshot.hosts if h["alive"]))
        for host in snapshot.pruned:
            event(log, "stale host pruned", host=host)

    # -- attempts the supervisor ends ----------------------------------------------------

    def fail_timed_out(self, job: Job, config: Config, slot: int) -> None:
        """Record a timeout: resource_limit, retried while attempts remain."""
        settings, timeout = config.queue, config.supervisor.job_timeout

        def fail(db: QueueDB) -> str | None:
            return record_failure(
                db, job, settings, retry=True, code="resource_limit", extra_event="timeout"
            )

        def logged(status: str | None) -> None:
            event(
                log,
                "job timed out",
                logging.WARNING,
                file_id=job.id,
                attempt=job.attempt,
                slot=slot,
                timeout_s=timeout,
                status=status or "lease_lost or database unavailable",
            )

        self.upkeep.submit("fail", fail, logged)

    def release(self, job: Job) -> None:
        """Fenced: a row that moved on since (committed, reclaimed) just gets `lease_lost`."""

        def logged(released: bool | None) -> None:
            event(log, "job released", file_id=job.id, attempt=job.attempt, released=bool(released))

        self.upkeep.submit("release", lambda db: db.release(job), logged)

    def lease_lost(self, job: Job, slot: int) -> None:
        self.metrics.job_killed_lease_lost()
        event(
            log,
            "job killed: lease lost",
            logging.WARNING,
            file_id=job.id,
            attempt=job.attempt,
            slot=slot,
        )
        self.upkeep.submit("lease_lost", lambda db: db.record_lease_lost(job))

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

        self.upkeep.submit(f"drop_lease:{holder}", lambda db: db.drop_lease(name, holder), retry)

    # -- the host registry -------------------------------------------------------------

    def register(self, config: Config) -> HostInfo:
        host = host_info(config, busy=0)
        self.upkeep.submit("register", lambda db: db.register_host(host))
        return host

    def deregister(self, host: HostInfo) -> None:
        self.upkeep.submit("deregister", lambda db: db.deregister_host(host.host, host.pid))


def _reject_exhausted(config: Config) -> Callable[[QueueDB], list[int]]:
    """Rows whose worker died on their last attempt are rejected, not reclaimed."""
    max_attempts = config.queue.max_attempts

    def run(db: QueueDB) -> list[int]:
        ids = db.reject_exhausted(max_attempts=max_attempts)
        for file_id in ids:
            event(log, "attempts exhausted", logging.WARNING, file_id=file_id)
        return ids

    return run
