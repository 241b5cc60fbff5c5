"""Both ends of the worker pipe protocol: what a child writes, and how the parent reads it.

A child reports over its status pipe, one JSON object per line:

    {"t": "ready", "cpu_s": 0.12, "depth": 2}        booted (CPU s since fork), about to claim;
                                                     its depth (derivd.pipeline.worker_depth)
    {"t": "boot_error", "msg": "..."}                could not boot; exit EXIT_BOOT_ERROR
    {"t": "claimed", "jobs": [{id, token, attempt, file_id?}]} rows it now holds (one claim)
    {"t": "finished", "results": [[id, outcome, code, duration_s, wait_s], ...], "rss_mb": ...}
                                                     attempts that ended (one flush)
    {"t": "exiting", "reason": "stopped|drained|max_jobs|rss"}

Each child has a pipe of its own, so lines of two children never mix; a line is still
kept below PIPE_BUF (a long list is split over several lines) so that one write is one
whole line: the parent never reads half a line from a child killed mid-write.

Over its progress pipe, which the parent does not wait on (a job start costs one small
write and no wake-up of the parent), the child writes a fixed-size record per job start
(when its derive begins; a job claimed and not started is only held): the lease token
and the CLOCK_MONOTONIC start time (the parent's deadline for that job runs from it).

The parent writes WAKE to the child's command pipe to end an idle wait; stopping is
SIGTERM, killing is SIGKILL to the child's process group (the supervisor's business).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import struct
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from derivd.osproc import fork, rss_mb, set_proctitle
from derivd.processes.reasons import KillReason, StopReason
from derivd.queue.db import Job

if TYPE_CHECKING:
    from derivd.worker import JobResult

log = logging.getLogger("derivd.supervisor")

WAKE = b"w"
PROGRESS = struct.Struct("=16sd")  # lease token bytes, monotonic start time
LINE_MAX = select.PIPE_BUF - 1  # bytes of one status line, newline excluded


# -- the child's end -------------------------------------------------------------------


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def job_to_dict(job: Job) -> dict[str, Any]:
    """What the parent needs to fail or release the row, and for a re-derivation the
    file it serves (the heartbeat finds its commit there)."""
    data: dict[str, Any] = {"id": job.id, "token": str(job.token), "attempt": job.attempt}
    if job.file_id is not None and job.file_id != job.id:
        data["file_id"] = job.file_id
    return data


def encode_lines(kind: str, key: str, items: Sequence[Any], **extra: Any) -> list[bytes]:
    """`{"t": kind, key: items, **extra}` as one line or, when that would reach
    PIPE_BUF, as several lines each carrying a share of `items`."""
    line = encode({"t": kind, key: list(items), **extra})
    if len(line) <= LINE_MAX or len(items) <= 1:
        return [line]
    half = len(items) // 2
    return encode_lines(kind, key, items[:half], **extra) + encode_lines(
        kind, key, items[half:], **extra
    )


class Reporter:
    """The worker's hooks (derivd.worker.WorkerHooks) over the status and progress pipes;
    also decides an RSS recycle after each reported batch of outcomes."""

    def __init__(self, status_w: int, progress_w: int, *, slot: int, max_rss_mb: int) -> None:
        self.status_w = status_w
        self.progress_w = progress_w
        self.slot = slot
        self.max_rss_mb = max_rss_mb
        self.recycle = False
        self.running: uuid.UUID | None = None  # the token of the job its title names

    def send(self, message: dict[str, Any]) -> None:
        self.write(encode(message))

    def write(self, line: bytes) -> None:
        with contextlib.suppress(OSError):  # the parent is gone; PR_SET_PDEATHSIG ends us
            os.write(self.status_w, line)

    def idle(self) -> None:
        """Waiting for a wake-up or the poll: its last claim found nothing."""
        set_proctitle(f"derivd: worker {self.slot} idle")

    def busy(self) -> None:
        """Between jobs: committing, claiming, or about to."""
        set_proctitle(f"derivd: worker {self.slot} claiming")

    def jobs_claimed(self, jobs: Sequence[Job]) -> None:
        for line in encode_lines("claimed", "jobs", [job_to_dict(j) for j in jobs]):
            self.write(line)

    def job_started(self, job: Job) -> None:
        # Blocking on purpose: the parent drains this pipe at least every few hundred ms;
        # a dropped record would make it time the wrong job. The record goes before the
        # title, so whoever sees "job N" in ps knows the supervisor can learn of it.
        with contextlib.suppress(OSError):
            os.write(self.progress_w, PROGRESS.pack(job.token.bytes, time.monotonic()))
        self.running = job.token
        set_proctitle(f"derivd: worker {self.slot} job {job.id}")

    def jobs_finished(self, results: Sequence[JobResult]) -> None:
        rss = rss_mb()
        if self.max_rss_mb and rss > self.max_rss_mb:
            self.recycle = True
        rows = [
            [r.job.id, r.outcome, r.code, round(r.duration_s, 6), round(r.job.wait_s, 6)]
            for r in results
        ]
        for line in encode_lines("finished", "results", rows, rss_mb=round(rss, 1)):
            self.write(line)
        # The title keeps naming the job it runs while the ones before it end.
        if self.running is None or any(r.job.token == self.running for r in results):
            self.running = None
            self.busy()


# -- the parent's end ------------------------------------------------------------------


@dataclass
class WorkerProc:
    """What the parent knows about one child (rq's WorkerData, with its jobs on it)."""

    pid: int
    slot: int
    generation: int
    status_r: int
    progress_r: int
    cmd_w: int
    spawned_at: float
    ready: bool = False
    held: dict[int, Job] = field(default_factory=dict)  # claimed, no outcome yet
    # Jobs the child has at different stages at once, as it reported when ready
    # (derivd.pipeline.worker_depth): how many of its latest starts are kept.
    depth: int = 1
    # the last `depth` starts, and older ones of jobs still held (`read_progress`)
    starts: list[tuple[uuid.UUID, float]] = field(default_factory=list)
    timed_out: set[uuid.UUID] = field(default_factory=set)  # why kill_reason = timeout
    lost: set[uuid.UUID] = field(default_factory=set)  # why kill_reason = lease_lost
    progress_buffer: bytes = b""
    stop_sent: bool = False
    kill_reason: KillReason | None = None
    kill_at: float | None = None  # when SIGTERM escalates to SIGKILL
    killed: bool = False
    exit_reason: StopReason | None = None  # from the child's "exiting" message
    boot_error: str | None = None
    eof: bool = False
    buffer: bytes = b""

    @classmethod
    def spawn(
        cls, slot: int, generation: int, start: Callable[[int, int, int, tuple[int, ...]], None]
    ) -> WorkerProc:
        """Open the three pipes and fork; the child runs `start(status_w, progress_w,
        cmd_r, own_parent_ends)`, which never returns."""
        status_r, status_w = os.pipe()
        progress_r, progress_w = os.pipe()
        cmd_r, cmd_w = os.pipe()
        pid = fork()
        if pid == 0:
            start(status_w, progress_w, cmd_r, (status_r, progress_r, cmd_w))
        for fd in (status_w, progress_w, cmd_r):
            os.close(fd)
        for fd in (status_r, progress_r, cmd_w):
            os.set_blocking(fd, False)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # the child does it too; whoever is first wins the race
        return cls(pid, slot, generation, status_r, progress_r, cmd_w, time.monotonic())

    def fds(self) -> tuple[int, int, int]:
        return self.status_r, self.progress_r, self.cmd_w

    def wake(self) -> bool:
        """End the child's idle wait (any byte on its command pipe)."""
        try:
            os.write(self.cmd_w, WAKE)
        except (BlockingIOError, BrokenPipeError):
            return False
        return True

    def ask_stop(self) -> None:
        """SIGTERM: finish the current job, release the unstarted ones, exit."""
        if self.stop_sent:
            return
        self.stop_sent = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)

    def kill(self, reason: KillReason, grace: float) -> None:
        """TERM the child's process group now, KILL it after `grace` (0: KILL at once).
        The first reason given is the one its exit is judged by."""
        if self.kill_reason is None:
            self.kill_reason = reason
        self.kill_at = time.monotonic() + grace
        self.signal_group(signal.SIGKILL if grace <= 0 else signal.SIGTERM)

    def signal_group(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            self.killed = True
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)  # not yet in its own group

    @property
    def last_start(self) -> tuple[uuid.UUID, float] | None:
        """The latest job start the child recorded (token, monotonic start)."""
        return self.starts[-1] if self.starts else None

    @last_start.setter
    def last_start(self, start: tuple[uuid.UUID, float] | None) -> None:
        self.starts = [] if start is None else [start]

    def in_flight(self) -> list[tuple[Job, float]]:
        """The jobs the child started and still holds, oldest start first, each with its
        start: a job's deadline runs from its start (its derive began), never from its
        claim; a job held and not started has none."""
        by_token = {job.token: job for job in self.held.values()}
        return [(by_token[t], at) for t, at in self.starts if t in by_token]

    def running(self) -> tuple[Job, float] | None:
        """The job the child is running, with its start time: of the jobs it started and
        still holds, the one it started last (it derives one job at a time; the ones
        started before it are being stored or committed)."""
        flying = self.in_flight()
        return flying[-1] if flying else None

    def read_messages(self) -> list[dict[str, Any]]:
        """The complete status lines read so far, decoded; EOF sets `eof`. A line that is
        not JSON is logged and skipped: a child cannot take its supervisor down."""
        while True:
            try:
                chunk = os.read(self.status_r, 65536)
            except (BlockingIOError, InterruptedError):
                break
            if not chunk:
                self.eof = True
                break
            self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        messages = []
        for line in filter(None, lines):
            try:
                message = json.loads(line)
            except ValueError:
                message = None
            if isinstance(message, dict):
                messages.append(message)
            else:
                log.warning("worker %s sent an unreadable status line", self.slot)
        return messages

    def read_progress(self) -> None:
        """The job starts the child recorded (`starts`). They are matched against the
        jobs held by token whenever they are needed (`in_flight`, `running`), so the order
        in which the two pipes are read does not matter."""
        while True:
            try:
                chunk = os.read(self.progress_r, 65536)
            except (BlockingIOError, InterruptedError):
                break
            if not chunk:
                break
            self.progress_buffer += chunk
        size = PROGRESS.size
        whole = len(self.progress_buffer) // size * size
        for offset in range(0, whole, size):
            token, started = PROGRESS.unpack_from(self.progress_buffer, offset)
            # CLOCK_MONOTONIC is system-wide: the child's start time is comparable.
            self.starts.append((uuid.UUID(bytes=token), min(started, time.monotonic())))
        self.starts = kept_starts(self.starts, self.held.values(), self.depth)
        self.progress_buffer = self.progress_buffer[whole:]

    def apply(self, message: dict[str, Any]) -> list[list[Any]]:
        """Take in one status message: what the child holds, whether it booted, why it
        exits. Returns the outcome rows of a "finished" message ([] otherwise). Raises
        ValueError, KeyError or TypeError on a malformed message."""
        kind = message.get("t")
        if kind == "ready":
            self.ready = True
            self.depth = max(1, int(message.get("depth", self.depth)))
        elif kind == "claimed":
            for data in message["jobs"]:
                job = job_from_message(data)
                self.held[job.id] = job
        elif kind == "finished":
            rows: list[list[Any]] = message["results"]
            for row in rows:
                self.held.pop(int(row[0]), None)
            return rows
        elif kind == "exiting":
            self.exit_reason = StopReason.parse(message.get("reason"))
        elif kind == "boot_error":
            self.boot_error = str(message.get("msg") or "unknown error")
        return []

    def close(self) -> None:
        for fd in self.fds():
            with contextlib.suppress(OSError):
                os.close(fd)


def job_from_message(data: dict[str, Any]) -> Job:
    return Job(
        id=int(data["id"]),
        token=uuid.UUID(data["token"]),
        attempt=int(data["attempt"]),
        original_key=str(data.get("original_key") or ""),
        original_version=data.get("original_version"),
        wait_s=float(data.get("wait_s") or 0.0),
        file_id=int(data["file_id"]) if data.get("file_id") is not None else None,
    )


def kept_starts(
    starts: list[tuple[uuid.UUID, float]], held: Iterable[Job], depth: int
) -> list[tuple[uuid.UUID, float]]:
    """The job starts a supervisor keeps (WorkerProc.read_progress): the last `depth`
    (a start may come before the claim that holds it is read), and any older one whose
    job is still held, so a job whose commit waits while the pipeline's other places run
    job after job keeps its deadline."""
    tokens = {job.token for job in held}
    older, latest = starts[:-depth], starts[-depth:]
    return [start for start in older if start[0] in tokens] + latest
