"""The prefork supervisor: keeps `[supervisor] workers` children alive and in line.

The parent never imports pyvips and never holds a storage client: children build their
own after fork (`derivd.processes.child`). The parent holds one database connection for the
things only it can do: fail the attempt of a worker it killed past `job_timeout`,
release the jobs of workers it killed at shutdown, reject exhausted rows, read queue
stats for the metrics.

Signal handlers only queue the signal and write to a wake-up pipe; the main loop
(`run`) dispatches: SIGTERM/SIGINT stop gracefully (a second one escalates), SIGHUP
reloads the configuration, SIGCHLD just wakes the loop so it reaps at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from derivd.config import Config, ConfigError, load_config
from derivd.ops.logs import event
from derivd.ops.metrics import Metrics
from derivd.processes.child import EXIT_BOOT_ERROR, WAKE, ChildSpec, run_child
from derivd.processes.procutil import (
    Pidfile,
    PidfileError,
    sd_notify,
    set_proctitle,
    watchdog_interval,
)
from derivd.processes.sweeper import SweepProcess
from derivd.processes.workerproc import WorkerProc, exit_text, job_from_message
from derivd.queue.db import DatabaseUnavailable, Job, QueueDB, QueueListener
from derivd.queue.retry import retry_delay

log = logging.getLogger("derivd.supervisor")

RESTART_BASE = 0.5  # seconds; a slot's second crash in a row waits this, then doubles
RESTART_MAX = 30.0
HEALTHY_AFTER = 30.0  # a worker that lived this long resets its slot's backoff
LOOP_MAX_SLEEP = 1.0
# While a worker holds jobs the parent reads its progress pipe (job starts, which do not
# wake the parent) at least this often: a deadline is enforced at most this late.
PROGRESS_POLL = 0.2
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)


@dataclass
class Slot:
    failures: int = 0  # crashes in a row
    not_before: float = 0.0  # backoff: no respawn before this (monotonic)
    drained: bool = False  # --burst: this slot's worker found nothing left to do


@dataclass
class Outcome:
    code: int
    message: str | None = None  # one line for the operator when code != 0


@dataclass
class Timers:
    maintenance: float = 0.0
    stats: float = 0.0
    watchdog: float = 0.0


class Arbiter:
    def __init__(
        self,
        config: Config,
        dsn: str,
        *,
        burst: bool = False,
        metrics: Metrics | None = None,
        reload: Callable[[], Config] | None = None,
    ) -> None:
        self.config = config
        self.dsn = dsn
        self.burst = burst
        self.metrics = metrics or Metrics()
        self._reload = reload or _reload_from(config)
        self.pid = os.getpid()
        self.workers: dict[int, WorkerProc] = {}
        self.slots: dict[int, Slot] = {}
        self.generation = 1
        self.ready_generations: set[int] = set()
        self.previous: tuple[Config, int] | None = None  # kept until a reload proves itself
        self.stop_deadline: float | None = None
        self.signals: list[int] = []
        self.outcome: Outcome | None = None
        self.notified_ready = False
        self.timers = Timers()
        self.watchdog = watchdog_interval()
        self.rng = random.Random()
        self.title = ""
        self._queue: QueueDB | None = None
        self._db_warned = False
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        # One LISTEN connection for the fleet (none in --burst: no worker ever idles).
        self.listener = None if burst else QueueListener(dsn)
        self.listen_retry_at = 0.0
        self.sweeper = SweepProcess()

    # -- signals -----------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum != signal.SIGCHLD:
            self.signals.append(signum)
        with contextlib.suppress(BlockingIOError):
            os.write(self.wake_w, b"s")

    def install_signals(self) -> dict[int, Any]:
        return {sig: signal.signal(sig, self._on_signal) for sig in HANDLED_SIGNALS}

    def handle_signals(self) -> None:
        while self.signals:
            signum = self.signals.pop(0)
            if signum == signal.SIGHUP:
                self.handle_hup()
            else:
                self.handle_stop(signal.Signals(signum).name)

    def handle_stop(self, name: str) -> None:
        if self.stop_deadline is None:
            grace = self.config.supervisor.shutdown_grace
            event(log, "stopping", signal=name, grace_s=grace, busy=self.busy_count())
            sd_notify("STOPPING=1\nSTATUS=stopping: finishing running jobs")
            self.stop_deadline = time.monotonic() + grace
            for worker in self.workers.values():
                self.ask_stop(worker)
        else:
            event(log, "stopping now", logging.WARNING, signal=name, busy=self.busy_count())
            self.stop_deadline = time.monotonic()

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
        event(log, "reloading", generation=self.generation, workers=new.worker_count)

    # -- the fleet ---------------------------------------------------------------------

    def spawn_worker(self, slot: int) -> None:
        status_r, status_w = os.pipe()
        progress_r, progress_w = os.pipe()
        cmd_r, cmd_w = os.pipe()
        inherited = (*self._parent_fds(), status_r, progress_r, cmd_w)
        spec = ChildSpec(
            slot=slot,
            config=self.config,
            dsn=self.dsn,
            status_w=status_w,
            progress_w=progress_w,
            cmd_r=cmd_r,
            parent_pid=self.pid,
            burst=self.burst,
            inherited_fds=inherited,
        )
        pid = os.fork()
        if pid == 0:
            run_child(spec)  # never returns
        os.close(status_w)
        os.close(progress_w)
        os.close(cmd_r)
        os.set_blocking(status_r, False)
        os.set_blocking(progress_r, False)
        os.set_blocking(cmd_w, False)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # the child does it too; whoever is first wins the race
        self.workers[pid] = WorkerProc(
            pid, slot, self.generation, status_r, progress_r, cmd_w, spawned_at=time.monotonic()
        )
        log.debug("spawned worker %s pid %s", slot, pid)

    def _parent_fds(self) -> tuple[int, ...]:
        """Descriptors a forked child must close: the other children's pipes, the wake-up
        pipe, the LISTEN connection and the metrics socket are the parent's alone."""
        fds = [fd for w in self.workers.values() for fd in (w.status_r, w.progress_r, w.cmd_w)]
        fds += [self.wake_r, self.wake_w]
        for shared in (self.listener.fileno() if self.listener else None, self.metrics.fileno()):
            if shared is not None:
                fds.append(shared)
        return tuple(fds)

    def manage_workers(self) -> None:
        """Fork what is missing in the current generation (respecting slot backoff)."""
        if self.stop_deadline is not None or self.outcome is not None:
            return
        now = time.monotonic()
        current = {w.slot for w in self.workers.values() if w.generation == self.generation}
        for slot_no in range(1, self.config.worker_count + 1):
            slot = self.slots.setdefault(slot_no, Slot())
            if slot_no in current or slot.drained or slot.not_before > now:
                continue
            self.spawn_worker(slot_no)

    def ask_stop(self, worker: WorkerProc) -> None:
        """Finish the current job, then exit."""
        if worker.stop_sent:
            return
        worker.stop_sent = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGTERM)

    def kill_worker(self, worker: WorkerProc, reason: str, grace: float) -> None:
        """TERM the child's process group now, KILL it after `grace` (0: KILL at once)."""
        if worker.kill_reason is None:
            worker.kill_reason = reason
        sig = signal.SIGKILL if grace <= 0 else signal.SIGTERM
        worker.kill_at = time.monotonic() + grace
        self._signal_group(worker, sig)

    def _signal_group(self, worker: WorkerProc, sig: int) -> None:
        if sig == signal.SIGKILL:
            worker.killed = True
        try:
            os.killpg(worker.pid, sig)
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, sig)  # not yet in its own group

    def wake_idle(self, count: int = 1) -> int:
        """Wake up to `count` idle workers (for issue 7's shared LISTEN connection)."""
        woken = 0
        for worker in self.workers.values():
            if woken >= count:
                break
            if worker.ready and not worker.held and not worker.stop_sent:
                with contextlib.suppress(BlockingIOError, BrokenPipeError):
                    os.write(worker.cmd_w, WAKE)
                    woken += 1
        return woken

    def busy_count(self) -> int:
        return sum(1 for w in self.workers.values() if w.held)

    # -- wake-up on NOTIFY -------------------------------------------------------------

    def keep_listening(self) -> None:
        """(Re)open the LISTEN connection when `[queue] listen` is on (closed when a
        reload turns it off). After a (re)connect every idle worker claims once:
        notifications sent while nobody listened are lost."""
        if self.listener is None:
            return
        if not self.config.queue.listen:
            self.listener.close()
            return
        now = time.monotonic()
        if self.listener.connected or now < self.listen_retry_at:
            return
        if self.listener.connect():
            self.wake_idle(len(self.workers))
        else:
            self.listen_retry_at = now + min(self.config.queue.poll_interval, 5.0)

    def on_notify(self) -> None:
        """Rows entered `queued`: wake one idle worker per notification. Notifications of
        one transaction fold into one, so a bulk enqueue wakes one worker; each worker
        that then finds a job wakes the next idle one (dispatch, "claimed")."""
        assert self.listener is not None
        count = self.listener.drain()
        if count:
            # A worker that went idle before the row was queued has said so already
            # ("finished" precedes its empty claim): read that first, so it is woken.
            for worker in list(self.workers.values()):
                if not worker.eof:
                    self.read_status(worker)
            self.wake_idle(count)

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
        if kind == "ready":
            worker.ready = True
            self.ready_generations.add(worker.generation)
            event(
                log,
                "worker ready",
                slot=worker.slot,
                pid=worker.pid,
                boot_s=time.monotonic() - worker.spawned_at,
            )
            self.on_generation_ready(worker.generation)
        elif kind == "claimed":
            for data in message["jobs"]:
                job = job_from_message(data)
                worker.held[job.id] = job
            if self.listener is not None and self.listener.connected:
                self.wake_idle(1)  # it found work: there may be more for an idle one
        elif kind == "finished":
            self.on_job_finished(worker, message)
        elif kind == "exiting":
            worker.exit_reason = str(message.get("reason"))
        elif kind == "boot_error":
            worker.boot_error = str(message.get("msg") or "unknown error")

    def on_job_finished(self, worker: WorkerProc, message: dict[str, Any]) -> None:
        self.slots.setdefault(worker.slot, Slot()).failures = 0
        for file_id, outcome, code, duration_s, wait_s in message["results"]:
            worker.held.pop(int(file_id), None)
            self.metrics.job_finished(
                outcome=str(outcome),
                code=code,
                duration_s=float(duration_s or 0.0),
                wait_s=float(wait_s or 0.0),
                backend=self.config.derive.backend,
            )

    def on_generation_ready(self, generation: int) -> None:
        if generation == self.generation and self.previous is not None:
            # The reloaded configuration boots: retire the old workers gracefully.
            old_generation = self.previous[1]
            self.previous = None
            for worker in self.workers.values():
                if worker.generation <= old_generation:
                    self.ask_stop(worker)
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
                worker = self.workers.pop(pid)
                self.read_status(worker)  # what it wrote just before dying
                os.close(worker.status_r)
                os.close(worker.progress_r)
                os.close(worker.cmd_w)
                self.on_worker_exit(worker, status)

    def on_worker_exit(self, worker: WorkerProc, status: int) -> None:
        slot = self.slots.setdefault(worker.slot, Slot())
        how = exit_text(status)
        code = os.waitstatus_to_exitcode(status)
        if worker.boot_error is not None or (code == EXIT_BOOT_ERROR and not worker.ready):
            self.on_boot_error(worker, worker.boot_error or how)
        elif worker.kill_reason == "timeout":
            self.on_timeout(worker)
        elif worker.kill_reason in ("shutdown", "aborted"):
            self.release(worker)
        elif code == 0 and worker.exit_reason in ("max_jobs", "rss"):
            event(
                log, "worker recycled", slot=worker.slot, pid=worker.pid, reason=worker.exit_reason
            )
            self.metrics.worker_restarted("recycle")
        elif code == 0 and worker.exit_reason == "drained" and self.burst:
            slot.drained = True
        elif code == 0 and worker.stop_sent:
            if worker.generation != self.generation:
                self.metrics.worker_restarted("reload")
        else:
            self.on_crash(worker, slot, how)
        # Whatever it still held and did not run (unstarted, or derived but never
        # committed) goes back without burning an attempt. The job that was running when
        # it died stays `processing`: its lease expires and the next claim counts the
        # attempt, so a job that kills workers cannot loop.
        running = worker.running()
        for job in list(worker.held.values()):
            if running is None or job.token != running[0].token:
                self.release_job(worker, job)

    def on_boot_error(self, worker: WorkerProc, text: str) -> None:
        if self.previous is not None and worker.generation == self.generation:
            # A reloaded configuration that cannot boot: keep running the old one.
            log.error(
                "reload aborted, keeping the running configuration: worker could not start: %s",
                text,
            )
            failed = self.generation
            self.config, self.generation = self.previous
            self.previous = None
            for other in self.workers.values():
                if other.generation == failed:
                    self.kill_worker(other, "aborted", 0)
            sd_notify(f"READY=1\nSTATUS={self.status_line()}")
        elif worker.generation in self.ready_generations:
            # This configuration booted before (a database blip, say): back off, retry.
            log.warning("worker %s could not start: %s", worker.slot, text)
            self._back_off(self.slots.setdefault(worker.slot, Slot()))
        elif self.outcome is None:
            self.halt(Outcome(1, f"worker could not start: {text}"))

    def on_timeout(self, worker: WorkerProc) -> None:
        running = worker.running()
        self.metrics.worker_restarted("timeout")
        if running is None:
            return  # it finished within the grace after all (on_worker_exit releases the rest)
        job = running[0]
        worker.held.pop(job.id, None)
        self.metrics.job_timed_out()
        q = self.config.queue
        delay = retry_delay(
            job.attempt, base=q.retry_base, cap=q.retry_max, jitter=q.retry_jitter, rng=self.rng
        )
        status = self._db(
            lambda db: db.fail(
                job,
                retry=True,
                code="resource_limit",
                max_attempts=q.max_attempts,
                delay_s=delay,
                extra_event="timeout",
            )
        )
        event(
            log,
            "job timed out",
            logging.WARNING,
            file_id=job.id,
            attempt=job.attempt,
            slot=worker.slot,
            timeout_s=self.config.supervisor.job_timeout,
            status=status or "lease_lost",
        )

    def release(self, worker: WorkerProc) -> None:
        for job in list(worker.held.values()):
            self.release_job(worker, job)

    def release_job(self, worker: WorkerProc, job: Job) -> None:
        """Fenced: a row that moved on since (committed, reclaimed) just gets `lease_lost`."""
        worker.held.pop(job.id, None)
        released = self._db(lambda db: db.release(job))
        event(log, "job released", file_id=job.id, attempt=job.attempt, released=bool(released))

    def on_crash(self, worker: WorkerProc, slot: Slot, how: str) -> None:
        # The row stays `processing`; its lease expires and the next claim counts the
        # attempt (or reject_exhausted ends it): a job that kills workers cannot loop.
        event(
            log,
            "worker died",
            logging.WARNING,
            slot=worker.slot,
            pid=worker.pid,
            status=how,
            file_id=running[0].id if (running := worker.running()) else "-",
        )
        self.metrics.worker_restarted("crash")
        if time.monotonic() - worker.spawned_at >= HEALTHY_AFTER:
            slot.failures = 0
        self._back_off(slot)

    def _back_off(self, slot: Slot) -> None:
        slot.failures += 1
        delay = (
            0.0 if slot.failures <= 1 else min(RESTART_MAX, RESTART_BASE * 2 ** (slot.failures - 2))
        )
        slot.not_before = time.monotonic() + delay

    def halt(self, outcome: Outcome) -> None:
        """Stop everything now (a boot failure): kill the fleet, release its jobs."""
        self.outcome = outcome
        for worker in self.workers.values():
            self.kill_worker(worker, "shutdown", 0)

    # -- deadlines ---------------------------------------------------------------------

    def enforce_deadlines(self) -> None:
        now = time.monotonic()
        sup = self.config.supervisor
        for worker in self.workers.values():
            if worker.held:
                worker.read_progress()
            running = worker.running()
            if worker.kill_at is not None and now >= worker.kill_at and not worker.killed:
                self._signal_group(worker, signal.SIGKILL)
            elif (
                running is not None
                and worker.kill_reason is None
                and now - running[1] >= sup.job_timeout
            ):
                self.kill_worker(worker, "timeout", sup.kill_grace)
        if self.stop_deadline is not None and now >= self.stop_deadline:
            for worker in self.workers.values():
                if not worker.killed:
                    self.kill_worker(worker, "shutdown", 0)

    def next_wakeup(self) -> float:
        now = time.monotonic()
        times = [now + LOOP_MAX_SLEEP]
        if self.outcome is None:  # halting: no more maintenance, only reaping
            times.append(self.timers.maintenance)
        sup = self.config.supervisor
        for worker in self.workers.values():
            if worker.kill_at is not None and not worker.killed:
                times.append(worker.kill_at)
            if worker.held and worker.kill_reason is None:
                times.append(now + PROGRESS_POLL)  # a job start it has not read yet
                running = worker.running()
                if running is not None:
                    times.append(running[1] + sup.job_timeout)
        if self.stop_deadline is not None:
            times.append(self.stop_deadline)
        times += [s.not_before for s in self.slots.values() if s.not_before > now]
        if self.watchdog:
            times.append(self.timers.watchdog)
        return max(0.0, min(times) - now)

    # -- maintenance -------------------------------------------------------------------

    def _db(self, action: Callable[[QueueDB], Any]) -> Any:
        """Run one queue call; a database outage is logged once and survived."""
        try:
            if self._queue is None:
                self._queue = QueueDB.open(self.dsn, role="derivd-supervisor")
            result = action(self._queue)
        except DatabaseUnavailable as error:
            if not self._db_warned:
                log.warning("supervisor: %s", error)
                self._db_warned = True
            return None
        self._db_warned = False
        return result

    def maintenance(self) -> None:
        now = time.monotonic()
        busy = self.busy_count()
        self.metrics.set_workers(alive=sum(w.ready for w in self.workers.values()), busy=busy)
        if self.watchdog and now >= self.timers.watchdog:
            sd_notify("WATCHDOG=1")
            self.timers.watchdog = now + self.watchdog
        if self.outcome is not None or now < self.timers.maintenance:
            return
        self.timers.maintenance = now + self.config.queue.poll_interval
        max_attempts = self.config.queue.max_attempts
        for file_id in self._db(lambda db: db.reject_exhausted(max_attempts=max_attempts)) or []:
            event(log, "attempts exhausted", logging.WARNING, file_id=file_id)
        if now >= self.timers.stats:
            self.timers.stats = now + self.config.metrics.interval
            self.refresh_queue_metrics()
            sd_notify(f"STATUS={self.status_line()}")
        self.run_sweep(now)

    def refresh_queue_metrics(self) -> None:
        """One stats query and one event count per interval, whatever the scrape rate."""
        stats = self._db(lambda db: db.queue_stats())
        if stats is not None:
            self.metrics.set_queue(stats)
        since = datetime.now(UTC) - timedelta(seconds=self.config.status.window)
        counts = self._db(lambda db: db.event_counts(since))
        if counts is not None:
            self.metrics.set_event_counts(counts)

    def run_sweep(self, now: float) -> None:
        """Every [sweep] interval, one sweep pass in a short-lived child (not in --burst,
        and not while stopping)."""
        self.sweeper.reap(self.config)
        if self.burst or self.stop_deadline is not None:
            return
        self.sweeper.schedule(self.config, now)
        if self.sweeper.due(self.config, now):
            self.sweeper.start(self.config, self.dsn, self._parent_fds())

    def status_line(self) -> str:
        alive = sum(w.ready for w in self.workers.values())
        return f"{alive} workers, {self.busy_count()} busy"

    # -- the loop ----------------------------------------------------------------------

    def wait(self, timeout: float) -> None:
        fds = [self.wake_r] + [w.status_r for w in self.workers.values() if not w.eof]
        listen_fd = self.listener.fileno() if self.listener else None
        if listen_fd is not None:
            fds.append(listen_fd)
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            return
        by_fd = {w.status_r: w for w in self.workers.values()}
        for fd in ready:
            if fd == self.wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
            elif fd != listen_fd:
                self.read_status(by_fd[fd])
        if listen_fd is not None and listen_fd in ready:
            self.on_notify()  # last: the workers' own news is read first

    def finished(self) -> bool:
        if self.workers:
            return False
        if self.outcome is not None or self.stop_deadline is not None:
            return True
        slots = range(1, self.config.worker_count + 1)
        return self.burst and all(self.slots.get(n, Slot()).drained for n in slots)

    def run(self) -> Outcome:
        previous = self.install_signals()
        path = self.config.supervisor.pidfile
        pidfile = Pidfile(Path(path)) if path else None
        try:
            if pidfile:
                pidfile.create()
            if self.config.metrics.listen:
                self.metrics.serve(self.config.metrics.listen)
            event(
                log,
                "supervisor started",
                pid=self.pid,
                workers=self.config.worker_count,
                backend=self.config.derive.backend,
                burst=self.burst,
            )
            while True:
                self.handle_signals()
                self.keep_listening()  # before the first fork: no window without it
                self.manage_workers()
                self.wait(self.next_wakeup())
                self.handle_signals()
                self.reap_workers()
                self.enforce_deadlines()
                self.maintenance()
                if self.finished():
                    break
                title = self._title()
                if title != self.title:
                    set_proctitle(title)
                    self.title = title
        except PidfileError as error:
            return Outcome(1, str(error))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if pidfile:
                pidfile.remove()
            self.sweeper.stop()
            if self._queue is not None:
                self._queue.close()
            if self.listener is not None:
                self.listener.close()
        outcome = self.outcome or Outcome(0)
        event(log, "supervisor stopped", code=outcome.code)
        return outcome

    def _title(self) -> str:
        state = " stopping" if self.stop_deadline is not None else ""
        return f"derivd: supervisor ({self.config.worker_count} workers){state}"


def _reload_from(config: Config) -> Callable[[], Config]:
    def reload() -> Config:
        if config.source == "(defaults)":
            return load_config()
        return load_config(Path(config.source), required=True)

    return reload
