"""The prefork supervisor: keeps `[supervisor] workers` children alive and in line.

The parent never imports pyvips and never holds a storage client: children build their
own after fork (`derivd.processes.child`). Its background duties (heartbeat, exhausted
rows, stats, event partitions, LISTEN, the sweep) are `derivd.processes.duties` and
`derivd.processes.sweep_child`, and its database work runs on `derivd.processes.dbthread`
(two lanes: leases, maintenance); what a worker's exit means is
`derivd.processes.lifecycle`; the pipes are `derivd.processes.pipe`.

Signal handlers only queue the signal and write to a wake-up pipe; the main loop
(`run`) dispatches: SIGTERM/SIGINT stop gracefully (a second one escalates), SIGHUP
reloads the configuration, SIGCHLD just wakes the loop so it reaps at once.

One job past 450 lines: the parent's loop, one object whose state every handler here shares.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from derivd.config import Config
from derivd.config_checks import ConfigError
from derivd.logs import event
from derivd.ops.metrics import Metrics
from derivd.osproc import SignalQueue, sd_notify, set_proctitle, watchdog_interval
from derivd.processes.bookkeeping import Bookkeeping
from derivd.processes.child import ChildSpec, run_child
from derivd.processes.dbthread import DatabaseThread
from derivd.processes.duties import (
    Duty,
    EventPartitions,
    ExhaustedRejection,
    FleetStats,
    Heartbeat,
    Listening,
    host_info,
    to_kill,
)
from derivd.processes.lifecycle import (
    BootFailure,
    Exit,
    Slot,
    back_off,
    classify_exit,
    crash_returns,
    deadline_action,
    exit_text,
    next_deadline,
    on_boot_failure,
    timed_out,
    to_release,
)
from derivd.processes.pipe import WorkerProc
from derivd.processes.reasons import DeadlineAction, KillReason
from derivd.processes.sweep_child import SweepChild
from derivd.processes.webhook_child import WebhookChild, WebhookStats, WebhookSync
from derivd.queue.db import HostInfo, Job, QueueListener

log = logging.getLogger("derivd.supervisor")

LOOP_MAX_SLEEP = 1.0
# While a worker holds jobs the parent reads its progress pipe (job starts, which do not
# wake the parent) at least this often: a deadline is enforced at most this late.
PROGRESS_POLL = 0.2
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Seconds the last database work (releases, deregistering) gets after a --burst run or a
# halt; a SIGTERM stop gives it what is left of shutdown_grace + kill_grace instead.
DB_CLOSE_WAIT = 2.0


# How a worker is forked: WorkerProc.spawn(slot, generation, start).
Spawner = Callable[[int, int, Callable[[int, int, int, tuple[int, ...]], None]], WorkerProc]


@dataclass
class RunResult:
    """How `derivd run` ends: its exit status and, when not 0, one line for stderr."""

    code: int
    message: str | None = None


class Supervisor:
    def __init__(
        self,
        config: Config,
        dsn: str,
        *,
        burst: bool = False,
        metrics: Metrics | None = None,
        reload: Callable[[], Config],
        host: HostInfo | None = None,
        db_thread: DatabaseThread | None = None,
        spawn: Spawner = WorkerProc.spawn,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`db_thread`, `spawn` and `clock` are the seams the decisions are tested through
        (tests/test_supervisor_fakes.py): where the database work goes, how a worker is
        forked, what time it is (monotonic)."""
        self.clock = clock
        self.spawn = spawn
        self.config = config
        # Registered before the first fork (derivd.processes.hostclaim): its start fences
        # its row. None (the fakes' tests): an unfenced row, as the first heartbeat makes it.
        self.host = host or host_info(config, busy=0)
        self.dsn = dsn
        self.burst = burst
        self.metrics = metrics or Metrics()
        self._reload = reload
        self.pid = os.getpid()
        self.workers: dict[int, WorkerProc] = {}
        self.slots: dict[int, Slot] = {}
        self.generation = 1
        self.ready_generations: set[int] = set()
        self.previous: tuple[Config, int] | None = None  # kept until a reload proves itself
        self.stop_deadline: float | None = None
        self.signals = SignalQueue((*STOP_SIGNALS, signal.SIGHUP), wake_only=(signal.SIGCHLD,))
        self.outcome: RunResult | None = None  # set by halt(): stopping on an error
        self.notified_ready = False
        self.watchdog = watchdog_interval()
        self.watchdog_at = 0.0
        self.title = ""
        # Two database lanes: the leases (heartbeat, renewal, attempts the supervisor
        # ends) never queue behind a slow maintenance round (stats, partitions, rejections).
        # An injected thread (the fakes' tests) serves both.
        wake = self.signals.wake
        self.lease_thread = db_thread or DatabaseThread(dsn, wake=wake, lane="lease")
        self.db_thread = db_thread or DatabaseThread(dsn, wake=wake, lane="maintenance")
        self.lanes = list(dict.fromkeys((self.lease_thread, self.db_thread)))
        self.db_thread.on_notify = self.on_notify
        self.books = Bookkeeping(self.lease_thread, self.metrics)
        current = lambda: self.config  # noqa: E731  (duties follow a reload)
        heartbeat = Heartbeat(
            current, self.lease_thread, self.metrics, self.workers.values, self.on_lost
        )
        heartbeat.started_at = self.host.started_at
        self.duties: list[Duty[Any]] = [
            heartbeat,
            ExhaustedRejection(current, self.db_thread),
            FleetStats(current, self.db_thread, self.metrics),
            EventPartitions(current, self.db_thread),
        ]
        if not burst:  # one LISTEN connection for the fleet (--burst: no worker idles)
            listener = QueueListener(config.database.listen_dsn or dsn)
            self.duties.append(Listening(current, self.db_thread, listener, self.on_listening))
            self.duties.append(SweepChild(current, dsn, self._parent_fds, self._give_back_sweep))
        # Webhooks: the endpoints the outbox subscribes, and the child that POSTs.
        self.webhook_sync = WebhookSync(current, self.db_thread)
        self.duties += [self.webhook_sync, WebhookStats(current, self.db_thread, self.metrics)]
        self.webhooks = WebhookChild(current, dsn, self._parent_fds)
        self.status_at = 0.0

    # -- signals -----------------------------------------------------------------------

    def handle_signals(self) -> None:
        while (signum := self.signals.pop()) is not None:
            if signum == signal.SIGHUP:
                self.handle_hup()
            else:
                self.handle_stop(signal.Signals(signum).name)

    def handle_stop(self, name: str) -> None:
        if self.stop_deadline is None:
            grace = self.config.supervisor.shutdown_grace
            event(log, "stopping", signal=name, grace_s=grace, busy=self.busy_count())
            sd_notify("STOPPING=1\nSTATUS=stopping: finishing running jobs")
            self.stop_deadline = self.clock() + grace
            for worker in self.workers.values():
                worker.ask_stop()
            for duty in self.duties:
                duty.stopping()
        else:
            event(log, "stopping now", logging.WARNING, signal=name, busy=self.busy_count())
            self.stop_deadline = self.clock()

    def handle_hup(self) -> None:
        if self.stop_deadline is not None:
            return
        try:
            new = self._reload()
        except ConfigError as error:
            log.error("reload refused, keeping the running configuration:\n%s", error)
            return
        if new.database.dsn != self.config.database.dsn:
            log.warning("reload: [database] dsn changes take effect only after a restart")
        sd_notify("RELOADING=1\nSTATUS=reloading")
        self.previous = (self.config, self.generation)
        self.config = new
        self.generation += 1
        self.notified_ready = False
        self.webhook_sync.now()
        self.webhooks.reload()
        event(log, "reloading", generation=self.generation, workers=new.worker_count)

    # -- the fleet ---------------------------------------------------------------------

    def spawn_worker(self, slot: int) -> None:
        inherited = self._parent_fds()

        def start(status_w: int, progress_w: int, cmd_r: int, own: tuple[int, ...]) -> None:
            spec = ChildSpec(
                slot=slot,
                config=self.config,
                dsn=self.dsn,
                status_w=status_w,
                progress_w=progress_w,
                cmd_r=cmd_r,
                parent_pid=self.pid,
                burst=self.burst,
                inherited_fds=(*inherited, *own),
            )
            run_child(spec)  # never returns

        worker = self.spawn(slot, self.generation, start)
        self.workers[worker.pid] = worker
        event(log, "worker spawned", logging.DEBUG, slot=slot, pid=worker.pid)

    def _parent_fds(self) -> tuple[int, ...]:
        """Descriptors a forked child must close: the other children's pipes, the wake-up
        pipe, the LISTEN connection and the metrics socket are the parent's alone."""
        fds = [fd for w in self.workers.values() for fd in w.fds()]
        fds += [*self.signals.fds(), *(fd for lane in self.lanes for fd in lane.fds())]
        metrics_fd = self.metrics.fileno()
        if metrics_fd is not None:
            fds.append(metrics_fd)
        return tuple(fds)

    def manage_workers(self) -> None:
        """Fork what is missing in the current generation (respecting slot backoff)."""
        if self.stop_deadline is not None or self.outcome is not None:
            return
        if self.config.webhooks and not self.webhook_sync.settled:
            return  # the first commits must find this configuration's endpoints
        now = self.clock()
        current = {w.slot for w in self.workers.values() if w.generation == self.generation}
        for slot_no in range(1, self.config.worker_count + 1):
            slot = self.slots.setdefault(slot_no, Slot())
            if slot_no in current or slot.drained or slot.not_before > now:
                continue
            self.spawn_worker(slot_no)

    def wake_idle(self, count: int = 1) -> int:
        """Wake up to `count` idle workers (rows were queued, or may have been)."""
        woken = 0
        for worker in self.workers.values():
            if woken >= count:
                break
            if worker.ready and not worker.held and not worker.stop_sent and worker.wake():
                woken += 1
        return woken

    def busy_count(self) -> int:
        return sum(1 for w in self.workers.values() if w.held)

    # -- wake-up on NOTIFY -------------------------------------------------------------

    def on_listening(self) -> None:
        """LISTEN (re)connected: notifications sent while nobody listened are lost, so
        every idle worker claims once."""
        self.wake_idle(len(self.workers))

    def on_notify(self, count: int) -> None:
        """Rows entered `queued`: wake one idle worker per notification. Notifications of
        one transaction fold into one, so a bulk enqueue wakes one worker; each worker
        that then finds a job wakes the next idle one (dispatch, "claimed")."""
        if not self.config.queue.listen:
            return
        # A worker that went idle before the row was queued has said so already
        # ("finished" precedes its empty claim): read that first, so it is woken.
        self.read_all()
        self.wake_idle(count)

    def read_all(self) -> None:
        for worker in list(self.workers.values()):
            if not worker.eof:
                self.read_status(worker)

    # -- messages from children --------------------------------------------------------

    def read_status(self, worker: WorkerProc) -> None:
        """Everything the child has said so far, in order, then its latest job start."""
        for message in worker.read_messages():
            try:
                self.dispatch(worker, message)
            except (ValueError, KeyError, TypeError):
                log.warning("worker %s sent an unreadable status line", worker.slot)
        worker.read_progress()

    def dispatch(self, worker: WorkerProc, message: dict[str, Any]) -> None:
        kind = message.get("t")
        finished = worker.apply(message)
        if kind == "ready":
            self.ready_generations.add(worker.generation)
            boot_s = self.clock() - worker.spawned_at
            event(log, "worker ready", slot=worker.slot, pid=worker.pid, boot_s=boot_s,
                  boot_cpu_s=message.get("cpu_s", "-"))  # fmt: skip
            self.on_generation_ready(worker.generation)
        elif kind == "claimed" and not self.burst and self.config.queue.listen:
            self.wake_idle(1)  # it found work: there may be more for an idle one
        elif kind == "finished":
            self.slots.setdefault(worker.slot, Slot()).failures = 0
        self.metrics.jobs_reported(finished, backend=self.config.derive.backend)

    def on_generation_ready(self, generation: int) -> None:
        if generation == self.generation and self.previous is not None:
            # The reloaded configuration boots: retire the old workers gracefully.
            old_generation = self.previous[1]
            self.previous = None
            for worker in self.workers.values():
                if worker.generation <= old_generation:
                    worker.ask_stop()
            event(log, "reloaded", generation=generation)
        if not self.notified_ready and self._generation_complete():
            self.notified_ready = True
            sd_notify(f"READY=1\nMAINPID={self.pid}\nSTATUS={self.status_line()}")

    def _generation_complete(self) -> bool:
        ready = {
            w.slot for w in self.workers.values() if w.generation == self.generation and w.ready
        }
        return len(ready) >= self.config.worker_count

    # -- reaping -----------------------------------------------------------------------

    def reap_workers(self) -> None:
        for pid in list(self.workers):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                self.worker_exited(pid, status)

    def worker_exited(self, pid: int, status: int) -> None:
        """The child `pid` ended with wait status `status`."""
        worker = self.workers.pop(pid)
        self.read_status(worker)  # what it wrote just before dying
        worker.close()
        self.on_worker_exit(worker, status)

    def on_worker_exit(self, worker: WorkerProc, status: int) -> None:
        slot = self.slots.setdefault(worker.slot, Slot())
        how = exit_text(status)
        kind = classify_exit(worker, status, burst=self.burst)
        if kind is Exit.BOOT_ERROR:
            self.on_boot_error(worker, worker.boot_error or how)
        elif kind is Exit.TIMEOUT:
            self.on_timeout(worker)
        elif kind is Exit.LEASE_LOST:
            self.on_lease_lost(worker)
        elif kind is Exit.RELEASE:
            self.release(worker)
        elif kind is Exit.RECYCLED:
            event(
                log, "worker recycled", slot=worker.slot, pid=worker.pid, reason=worker.exit_reason
            )
            self.metrics.worker_restarted("recycle")
        elif kind is Exit.DRAINED:
            slot.drained = True
        elif kind is Exit.STOPPED:
            if worker.generation != self.generation:
                self.metrics.worker_restarted("reload")
        else:
            self.on_crash(worker, slot, how)
        for job in to_release(worker, kind):
            self.release_job(worker, job)

    def on_boot_error(self, worker: WorkerProc, text: str) -> None:
        action = on_boot_failure(
            reloading=self.previous is not None and worker.generation == self.generation,
            booted_before=worker.generation in self.ready_generations,
        )
        if action is BootFailure.ABORT_RELOAD:
            assert self.previous is not None
            log.error(
                "reload aborted, keeping the running configuration: worker could not start: %s",
                text,
            )
            failed = self.generation
            self.config, self.generation = self.previous
            self.previous = None
            for other in self.workers.values():
                if other.generation == failed:
                    other.kill(KillReason.ABORTED, 0)
            sd_notify(f"READY=1\nSTATUS={self.status_line()}")
        elif action is BootFailure.RETRY:
            log.warning("worker %s could not start: %s", worker.slot, text)
            back_off(self.slots.setdefault(worker.slot, Slot()), self.clock())
        elif self.outcome is None:
            self.halt(RunResult(1, f"worker could not start: {text}"))

    def on_timeout(self, worker: WorkerProc) -> None:
        """Fail each job whose deadline killed the worker (to_release has the rest)."""
        self.metrics.worker_restarted("timeout")
        for job in self._still_held(worker, worker.timed_out):  # none: done within the grace
            worker.held.pop(job.id, None)
            self.metrics.job_timed_out()
            self.books.fail_timed_out(job, self.config, worker.slot)

    def on_lease_lost(self, worker: WorkerProc) -> None:
        """The heartbeat found the lease of a job in flight gone (reclaimed, deleted,
        rejected): it was killed; record that. No backoff: the worker did nothing wrong."""
        self.metrics.worker_restarted("lease_lost")
        for job in self._still_held(worker, worker.lost):  # none: reported within the grace
            worker.held.pop(job.id, None)
            self.books.lease_lost(job, worker.slot)

    @staticmethod
    def _still_held(worker: WorkerProc, tokens: set[uuid.UUID]) -> list[Job]:
        return [job for job in worker.held.values() if job.token in tokens]

    def on_lost(self, lost: set[uuid.UUID]) -> None:
        """The heartbeat's answer: kill every worker with a job in flight that the
        database no longer leases to us (reclaimed, deleted, rejected by an operator)."""
        self.read_all()  # a job that finished (and committed) since is not lost
        for worker in to_kill(self.workers.values(), lost):
            worker.lost = {job.token for job, _ in worker.in_flight()} & lost
            worker.kill(KillReason.LEASE_LOST, self.config.supervisor.kill_grace)

    def release(self, worker: WorkerProc) -> None:
        for job in list(worker.held.values()):
            self.release_job(worker, job)

    def release_job(self, worker: WorkerProc, job: Job) -> None:
        worker.held.pop(job.id, None)
        self.books.release(job)

    def on_crash(self, worker: WorkerProc, slot: Slot, how: str) -> None:
        """Every job the worker held goes back now (crash_returns): the one it was
        running counted, with a `worker_died` event, the others released. None waits for
        its lease, and a job that kills workers still ends after max_attempts. Should the
        database not take one, its lease expires as before."""
        returns = crash_returns(worker, self.config.queue)
        event(
            log,
            "worker died",
            logging.WARNING,
            slot=worker.slot,
            pid=worker.pid,
            status=how,
            file_id=",".join(str(r.job.id) for r in returns.died) or "-",
            released=len(returns.released),
        )
        for died in returns.died:
            worker.held.pop(died.job.id, None)
            self.books.worker_died(died, self.config, worker.slot)
        for job in returns.released:
            self.release_job(worker, job)
        self.metrics.worker_restarted("crash")
        now = self.clock()
        back_off(slot, now, lived_s=now - worker.spawned_at)

    def halt(self, outcome: RunResult) -> None:
        """Stop everything now (a boot failure): kill the fleet, release its jobs."""
        self.outcome = outcome
        for worker in self.workers.values():
            worker.kill(KillReason.SHUTDOWN, 0)

    # -- deadlines ---------------------------------------------------------------------

    def enforce_deadlines(self) -> None:
        now = self.clock()
        sup = self.config.supervisor
        for worker in self.workers.values():
            if worker.held:
                worker.read_progress()
            action = deadline_action(worker, now, job_timeout=sup.job_timeout)
            if action is DeadlineAction.KILL:
                worker.signal_group(signal.SIGKILL)
            elif action is DeadlineAction.TIMEOUT:
                late = timed_out(worker, now, job_timeout=sup.job_timeout)
                worker.timed_out = {late.token} if late else set()
                worker.kill(KillReason.TIMEOUT, sup.kill_grace)
        if self.stop_deadline is not None and now >= self.stop_deadline:
            for worker in self.workers.values():
                if not worker.killed:
                    worker.kill(KillReason.SHUTDOWN, 0)

    def next_wakeup(self) -> float:
        now = self.clock()
        times = [now + LOOP_MAX_SLEEP]
        if self.outcome is None:  # halting: no more duties, only reaping
            times += [duty.next_round for duty in self.duties]
        timeout = self.config.supervisor.job_timeout
        times += [
            next_deadline(w, now, job_timeout=timeout, poll=PROGRESS_POLL)
            for w in self.workers.values()
        ]
        if self.stop_deadline is not None:
            times.append(self.stop_deadline)
        times += [s.not_before for s in self.slots.values() if s.not_before > now]
        if self.watchdog:
            times.append(self.watchdog_at)
        return max(0.0, min(times) - now)

    # -- the periodic step -------------------------------------------------------------

    def housekeeping(self) -> None:
        """What the loop does besides its workers: gauges, the watchdog, the duties that
        are due (the sweep among them), the systemd status line."""
        now = self.clock()
        busy = self.busy_count()
        self.metrics.set_workers(alive=sum(w.ready for w in self.workers.values()), busy=busy)
        if self.watchdog and now >= self.watchdog_at:
            sd_notify("WATCHDOG=1")
            self.watchdog_at = now + self.watchdog
        if self.outcome is not None:
            return
        for duty in self.duties:
            duty.tick(now)
        if self.stop_deadline is not None:
            self.webhooks.reap()
        else:
            if self.drained():  # --burst: its commits' deliveries go out before it ends
                self.webhooks.finish()
            self.webhooks.tick(now)
        if now >= self.status_at:
            self.status_at = now + self.config.metrics.interval
            sd_notify(f"STATUS={self.status_line()}")

    def _give_back_sweep(self, abandoned: list[uuid.UUID]) -> None:
        self.books.give_back_leases(abandoned, "sweep")

    def status_line(self) -> str:
        alive = sum(w.ready for w in self.workers.values())
        return f"{alive} workers, {self.busy_count()} busy"

    # -- the loop ----------------------------------------------------------------------

    def wait(self, timeout: float) -> None:
        fds = [self.signals.wake_r] + [w.status_r for w in self.workers.values() if not w.eof]
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            return
        by_fd = {w.status_r: w for w in self.workers.values()}
        for fd in ready:
            if fd == self.signals.wake_r:
                self.signals.drain()
            else:
                self.read_status(by_fd[fd])
        for lane in self.lanes:  # last: the workers' own news is read first
            lane.poll()

    def drained(self) -> bool:
        """--burst: every slot's worker ended with nothing left to claim."""
        if not self.burst or self.workers:
            return False
        slots = range(1, self.config.worker_count + 1)
        return all(self.slots.get(n, Slot()).drained for n in slots)

    def finished(self) -> bool:
        if self.workers:
            return False
        if self.outcome is not None or self.stop_deadline is not None:
            return True
        return self.drained() and self.webhooks.done

    def run(self) -> RunResult:
        """Supervise until stopped (or drained, or halted on a boot error)."""
        self.signals.install()
        event(
            log,
            "supervisor started",
            pid=self.pid,
            workers=self.config.worker_count,
            backend=self.config.derive.backend,
            burst=self.burst,
        )
        for lane in self.lanes:
            lane.start()
        now = self.clock()
        for duty in self.duties:
            duty.start(now)
        self.webhooks.start(now)
        try:
            while True:
                self.handle_signals()
                self.reap_workers()
                self.manage_workers()  # right after reaping: a replacement comes first
                self.enforce_deadlines()
                self.housekeeping()
                if self.finished():
                    break
                title = self._title()
                if title != self.title:
                    set_proctitle(title)
                    self.title = title
                self.wait(self.next_wakeup())
        finally:
            self.signals.restore()
            for duty in self.duties:
                duty.stop()
            self.webhooks.stop()
            # A clean stop, or a halt (a boot failure, its jobs released): leave the
            # registry, or the next start under this name waits for the row to go stale.
            self.books.deregister(self.host)
            # Both lanes finish their queues at once, within the one close timeout.
            ends_at = self.clock() + self._close_timeout()
            for lane in self.lanes:
                lane.stop_soon()
            for lane in self.lanes:
                lane.close(max(0.0, ends_at - self.clock()))
        outcome = self.outcome or RunResult(0)
        event(log, "supervisor stopped", code=outcome.code)
        return outcome

    def _close_timeout(self) -> float:
        if self.stop_deadline is None:
            return DB_CLOSE_WAIT
        left = self.stop_deadline + self.config.supervisor.kill_grace - self.clock()
        return max(0.1, left)

    def _title(self) -> str:
        state = " stopping" if self.stop_deadline is not None else ""
        return f"derivd: supervisor ({self.config.worker_count} workers){state}"
