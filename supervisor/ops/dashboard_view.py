"""What the dashboard shows, as records: one snapshot of the fleet (hosts, jobs in flight,
the last hour per minute, `derivd status`'s report). `derivd.ops.dashboard` reads it from
the database, `derivd.ops.dashboard_page` renders it; neither imports the other's module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from derivd.config import Config, StatusSettings
from derivd.ops.health import Alarm, Report

MEDIAN_SAMPLE = 200  # a minute's median duration: from at most this many of its latest jobs


@dataclass(frozen=True)
class HostView:
    host: str
    pid: int
    alive: bool
    workers: int
    busy: int
    heartbeat_age_s: float | None
    this_host: bool

    @property
    def idle(self) -> int:
        return max(0, self.workers - self.busy) if self.alive else 0


@dataclass(frozen=True)
class InFlight:
    id: int
    attempt: int
    age_s: float
    lease_left_s: float
    holder: str  # the host that claimed it (claimed_by; "" for rows claimed before 0004)


@dataclass(frozen=True)
class Minute:
    minutes_ago: int
    finished: int
    median_s: float | None


@dataclass(frozen=True)
class Snapshot:
    taken_at: float  # unix time
    host: str
    refresh_s: float
    job_timeout: float
    limits: StatusSettings
    report: Report | None  # None: the database could not answer (see error)
    alarms: tuple[Alarm, ...] = ()
    notices: tuple[Alarm, ...] = ()  # crossed, reported beside the verdict
    error: str | None = None
    hosts: tuple[HostView, ...] = ()
    in_flight: tuple[InFlight, ...] = ()
    minutes: tuple[Minute, ...] = ()
    minutes_capped: bool = False
    stale_s: float | None = None  # served while a newer read is slow: this view's age

    @classmethod
    def taken(cls, config: Config, report: Report | None) -> Snapshot:
        """A snapshot taken now, with what the configuration says about the page; the
        rest is filled with dataclasses.replace."""
        return cls(
            taken_at=time.time(),
            host=config.host_id,
            refresh_s=config.metrics.interval,
            job_timeout=config.supervisor.job_timeout,
            limits=config.status,
            report=report,
        )

    @property
    def healthy(self) -> bool | None:
        """True/False as `derivd status` exits 0/1; None when it cannot tell (exit 3)."""
        return None if self.report is None else not self.alarms
