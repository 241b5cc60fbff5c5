"""Prometheus metrics of the supervisor (names prefixed `derivd_`).

Children never serve metrics: they report job results to the parent over their pipe and
the parent records them here. Queue gauges come from one SQL query on a timer.
This is the interface the supervisor calls; the Operators' view issue fills it in.
"""

from __future__ import annotations

from supervisor.queue import QueueStats


class Metrics:
    def job_finished(
        self, *, outcome: str, code: str | None, duration_s: float, wait_s: float, backend: str
    ) -> None:
        """One attempt ended: outcome is ready|retry|rejected|lease_lost|released|unknown."""

    def job_timed_out(self) -> None:
        """The supervisor killed a worker past job_timeout."""

    def worker_restarted(self, reason: str) -> None:
        """A worker was replaced: crash | timeout | recycle | reload."""

    def set_workers(self, *, alive: int, busy: int) -> None:
        """Current fleet state."""

    def set_queue(self, stats: QueueStats) -> None:
        """Queue gauges from the periodic stats query."""

    def serve(self, listen: str) -> None:
        """Start the HTTP endpoint on host:port (a daemon thread in the supervisor)."""
