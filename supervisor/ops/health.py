"""The queue's health: what `derivd status` and the dashboard read (`collect`, a `Report`) and
the alarms and notices its thresholds raise (`evaluate`, `notices`, `[status]`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import psycopg

from derivd.config import StatusSettings
from derivd.ops.backfill import Progress
from derivd.ops.durations import duration
from derivd.queue.db import (
    NO_SCHEMA,
    PARENT_LOCK_TIMEOUT_S,
    PARENT_STATEMENT_TIMEOUT_S,
    DatabaseUnavailable,
    LockBusy,
    QueueDB,
    QueueStats,
)
from derivd.redact import one_line
from derivd.states import Status

# The order rows are listed in: the live states first (every status, see test_states).
STATUS_ORDER: tuple[Status, ...] = (
    "queued",
    "processing",
    "ready",
    "rejected",
    "pending",
    "deleting",
    "deleted",
)


DEFAULT_EVENTS = (
    "archive_events_default holds events: days no partition covered (the partition duty "
    "was away longer than the week it creates ahead); a supervisor moves them out within "
    "[sweep] partitions_interval, or run `derivd sweep`"
)


class StatusUnavailable(Exception):
    """The queue's health cannot be read (one line for the operator)."""


# The probe's bounds: its statements, and its waits for a lock (a reading of the shared
# stats another connection is recomputing) on a direct connection.
PROBE_TIMEOUT_S = PARENT_STATEMENT_TIMEOUT_S
PROBE_LOCK_TIMEOUT_S = PARENT_LOCK_TIMEOUT_S


@dataclass(frozen=True)
class Report:
    """Everything `derivd status` shows, read in three cheap queries."""

    stats: QueueStats
    events: dict[str, int]
    rejected_by_code: dict[str, int]
    window_s: float
    events_age_s: float = 0.0  # how old the shared reading of the recent events is
    checked_at: float = field(default_factory=time.time)
    hosts: list[dict[str, Any]] = field(default_factory=list)  # the host registry
    backfill: Progress | None = None  # the latest `derivd backfill --apply` run
    warnings: list[str] = field(default_factory=list)  # degraded, not unhealthy
    webhooks: list[dict[str, Any]] = field(default_factory=list)  # per endpoint

    @property
    def counts(self) -> dict[str, int]:
        return {s: self.stats.counts.get(s, 0) for s in (*STATUS_ORDER, *self.stats.counts)}

    @property
    def reading_age_s(self) -> float:
        """How old the oldest of the shared readings shown is (counts, recent events):
        another host or probe may have computed it up to [status] max_age ago."""
        return max(self.stats.age_s, self.events_age_s)

    @property
    def recent_rejected(self) -> int:
        return self.events.get("rejected", 0) + self.events.get("exhausted", 0)

    @property
    def recent_finished(self) -> int:
        return self.events.get("ready", 0) + self.recent_rejected

    @property
    def recent_rejected_ratio(self) -> float | None:
        finished = self.recent_finished
        return self.recent_rejected / finished if finished else None

    @property
    def live_hosts(self) -> int:
        """Supervisors that heartbeated within three of their intervals."""
        return sum(1 for h in self.hosts if h["alive"])

    @property
    def claimable(self) -> bool:
        """Some row could be claimed now: a due queued row, or an expired lease."""
        return self.stats.oldest_claimable_age_s is not None or self.stats.expired_leases > 0


@dataclass(frozen=True)
class Alarm:
    signal: str
    value: float
    limit: float
    hint: str
    endpoint: str | None = None  # the webhook endpoint a webhook signal is about


def collect(queue: QueueDB, limits: StatusSettings) -> Report:
    """Read the health signals; StatusUnavailable when the database cannot answer. The
    counts and the recent events are shared with the fleet: a reading younger than
    `[status] max_age` is reused, so a probe every few seconds costs a cache read, not a
    count over the table and the window's events."""
    window_s, max_age_s = limits.window, limits.max_age
    try:
        recent = queue.event_window(window_s=window_s, max_age_s=max_age_s)
        return Report(
            stats=queue.queue_stats(max_age_s=max_age_s),
            events=recent.events,
            rejected_by_code=recent.rejected_by_code,
            window_s=window_s,
            events_age_s=recent.age_s,
            hosts=queue.hosts(),
            backfill=_backfill(queue),
            warnings=[DEFAULT_EVENTS] if queue.default_events() else [],
            webhooks=queue.webhook_stats(window_s=window_s),
        )
    except DatabaseUnavailable as error:
        raise StatusUnavailable(str(error)) from None
    except LockBusy:
        raise StatusUnavailable(
            f"the database did not answer within {PROBE_LOCK_TIMEOUT_S:g}s: a lock another "
            "connection holds (lock_timeout)"
        ) from None
    except psycopg.errors.UndefinedTable:  # dropped since the check at start
        raise StatusUnavailable(NO_SCHEMA) from None
    except psycopg.Error as error:
        raise StatusUnavailable(f"database error: {one_line(error)}") from None


def _backfill(queue: QueueDB) -> Progress | None:
    row = queue.backfill_progress()
    return None if row is None else Progress.from_row(row)


def evaluate(report: Report, limits: StatusSettings) -> list[Alarm]:
    """The thresholds crossed that make the service unhealthy, each with what to do
    about it. A limit of 0 is off."""
    alarms: list[Alarm] = [*_service_alarms(report, limits), *_webhook_alarms(report, limits)]
    rejected = _rejected_alarm(report, limits)
    if rejected and limits.fail_on_rejected:
        alarms.append(rejected)
    return alarms


def notices(report: Report, limits: StatusSettings) -> list[Alarm]:
    """The thresholds crossed that are reported beside the verdict: a rejected share
    above its limit, unless [status] fail_on_rejected makes it unhealthy."""
    rejected = _rejected_alarm(report, limits)
    return [rejected] if rejected and not limits.fail_on_rejected else []


def _service_alarms(report: Report, limits: StatusSettings) -> list[Alarm]:
    alarms: list[Alarm] = []
    age = report.stats.oldest_claimable_age_s or 0.0
    if limits.max_oldest_age and age > limits.max_oldest_age:
        alarms.append(
            Alarm(
                "oldest_claimable_age_s",
                age,
                limits.max_oldest_age,
                "work is waiting: if the workers are all busy, add workers or hosts "
                "(capacity); if none are busy, check that derivd runs and reaches the database",
            )
        )
    expired = report.stats.expired_leases
    if limits.max_expired_leases and expired > limits.max_expired_leases:
        alarms.append(
            Alarm(
                "expired_leases",
                expired,
                limits.max_expired_leases,
                "workers die or hang mid-job: look for crashes, OOM kills and worker "
                "restarts; if jobs legitimately run that long, raise [queue] lease",
            )
        )
    if limits.min_hosts and report.claimable and report.live_hosts < limits.min_hosts:
        alarms.append(
            Alarm(
                "live_hosts",
                report.live_hosts,
                limits.min_hosts,
                "work is claimable and too few supervisors are alive to claim it: start "
                "`derivd run` (or its service) on a host, or see why it stopped in its log",
            )
        )
    return alarms


def _rejected_alarm(report: Report, limits: StatusSettings) -> Alarm | None:
    ratio = report.recent_rejected_ratio
    if (
        not limits.max_rejected_ratio
        or ratio is None
        or report.recent_finished < limits.min_finished
        or ratio <= limits.max_rejected_ratio
    ):
        return None
    return Alarm(
        "recent_rejected_ratio",
        ratio,
        limits.max_rejected_ratio,
        "many jobs are rejected: unsupported/corrupt_content or resource_limit "
        "mean bad input; missing_original: the upload API queues keys or versions "
        "the store does not have; processing_failed or attempts_exhausted mean a "
        "broken backend or crashing workers",
    )


def _webhook_alarms(report: Report, limits: StatusSettings) -> list[Alarm]:
    """Per configured endpoint: its events wait too long, or its circuit stays open while
    events wait (a receiver down, or refusing every event)."""
    alarms: list[Alarm] = []
    for w in report.webhooks:
        if w.get("removed") or not w["backlog"]:
            continue
        age, opened = w["oldest_undelivered_age_s"] or 0.0, w["open_age_s"] or 0.0
        if limits.max_webhook_age and age > limits.max_webhook_age:
            alarms.append(Alarm(
                "webhook_oldest_undelivered_age_s", age, limits.max_webhook_age,
                f"events for endpoint {w['name']} wait: see its last error in `derivd "
                "webhooks list`; the receiver may be down or slow (raise its concurrency)",
                w["name"]))  # fmt: skip
        if limits.max_webhook_open and opened > limits.max_webhook_open:
            alarms.append(Alarm(
                "webhook_circuit_open_s", opened, limits.max_webhook_open,
                f"endpoint {w['name']} fails every probe ({w['last_error'] or 'no answer'}): "
                "fix the receiver, then `derivd webhooks test` or `resume` lets its "
                "backlog flow", w["name"]))  # fmt: skip
    return alarms


def reading_age(seconds: float) -> str:
    """How old the shared counts are, in words for the table and the dashboard."""
    if seconds < 0.5:
        return "counts read now"
    return f"counts read {duration(seconds)} ago by the fleet ([status] max_age)"
