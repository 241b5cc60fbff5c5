"""Why the supervisor kills a worker, and why a worker says it stopped: closed sets,
compared as members, never as text (the pipe carries a worker's reason as its value)."""

from __future__ import annotations

from enum import StrEnum


class KillReason(StrEnum):
    """Why the supervisor killed a worker; the first reason given is the one its exit is
    judged by (derivd.processes.lifecycle.classify_exit)."""

    TIMEOUT = "timeout"  # its running job passed job_timeout
    LEASE_LOST = "lease_lost"  # the heartbeat found its job's lease gone
    SHUTDOWN = "shutdown"  # the graceful stop's time ran out
    ABORTED = "aborted"  # a reload whose new workers cannot boot


class StopReason(StrEnum):
    """Why a worker left its loop by itself (the child's `exiting` message)."""

    STOPPED = "stopped"  # asked to stop (shutdown, reload), or its parent is gone
    DRAINED = "drained"  # --burst and nothing claimable
    MAX_JOBS = "max_jobs"  # max_jobs_per_worker done: recycle
    RSS = "rss"  # over max_worker_rss_mb: recycle

    @classmethod
    def parse(cls, value: object) -> StopReason | None:
        """A reason read off the pipe; None for anything else (a crash, then)."""
        try:
            return cls(str(value))
        except ValueError:
            return None


class DeadlineAction(StrEnum):
    """What a worker's deadlines call for now (lifecycle.deadline_action)."""

    KILL = "kill"  # a TERM sent earlier has had its grace: SIGKILL now
    TIMEOUT = "timeout"  # its running job passed job_timeout: start killing
