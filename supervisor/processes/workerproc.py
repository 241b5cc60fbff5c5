"""What the supervisor knows about one worker process, and how it reads the child's pipes.

A child speaks on two pipes (see `derivd.processes.child`): JSON lines on its status pipe
(ready, claimed, finished, exiting, boot_error), and fixed-size job-start records on its
progress pipe, which the parent reads without being woken by it. This module turns
those bytes into messages and into "which job is running since when"; what to do about
them is the arbiter's business.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from derivd.processes.child import PROGRESS
from derivd.queue.db import Job

log = logging.getLogger("derivd.supervisor")


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
    last_start: tuple[uuid.UUID, float] | None = None  # token, monotonic start
    progress_buffer: bytes = b""
    stop_sent: bool = False
    kill_reason: str | None = None  # timeout | shutdown | aborted
    kill_at: float | None = None  # when SIGTERM escalates to SIGKILL
    killed: bool = False
    exit_reason: str | None = None  # from the child's "exiting" message
    boot_error: str | None = None
    eof: bool = False
    buffer: bytes = b""

    def running(self) -> tuple[Job, float] | None:
        """The job the child last started, with its start time, while it holds it."""
        if self.last_start is None:
            return None
        token, started = self.last_start
        for job in self.held.values():
            if job.token == token:
                return job, started
        return None

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
        """The latest job start the child recorded. It is matched against the jobs held
        by token whenever it is needed (`running`), so the order in which the two pipes
        are read does not matter."""
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
        if whole:
            token, started = PROGRESS.unpack_from(self.progress_buffer, whole - size)
            # CLOCK_MONOTONIC is system-wide: the child's start time is comparable.
            self.last_start = (uuid.UUID(bytes=token), min(started, time.monotonic()))
            self.progress_buffer = self.progress_buffer[whole:]


def job_from_message(data: dict[str, Any]) -> Job:
    return Job(
        id=int(data["id"]),
        token=uuid.UUID(data["token"]),
        attempt=int(data["attempt"]),
        original_key=str(data.get("original_key") or ""),
        original_version=data.get("original_version"),
        wait_s=float(data.get("wait_s") or 0.0),
    )


def exit_text(status: int) -> str:
    """`signal SIGKILL` or `exit 3`, for the log."""
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit {os.waitstatus_to_exitcode(status)}"
