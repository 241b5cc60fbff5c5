"""`derivd status`: the queue's health signals as a table or one JSON object.

The exit status makes it a health check (cron, systemd, Kubernetes):

    0  healthy
    1  unhealthy: a [status] threshold is crossed
    2  bad configuration or usage (like every derivd command)
    3  cannot tell: the database is unreachable or has no derivd schema

The verdict is the service's health, and its thresholds tell the usual troubles apart:
claimable work waiting too long (too little capacity), expired leases piling up (workers
crash or hang, or the lease is too short), claimable work with no live supervisor to
claim it (derivd is not running: `[status] min_hosts`), and a webhook endpoint whose
events wait too long or whose circuit stays open (`max_webhook_age`,
`max_webhook_open`). A large rejected share is mostly users' bad uploads: it is reported
beside the verdict, and fails it only with `[status] fail_on_rejected`.

A probe never hangs: its connection and every statement are bounded (PROBE_TIMEOUT_S,
client-side everywhere, plus statement_timeout and lock_timeout on a direct connection),
and a database that does not answer in time is one line and exit status 3.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import click
import psycopg

from derivd.config import Config, StatusSettings
from derivd.ops.backfill import Progress
from derivd.ops.budget import connection_budget
from derivd.ops.durations import duration
from derivd.ops.webhook_view import endpoint_json, endpoint_lines
from derivd.queue.db import (
    NO_SCHEMA,
    PARENT_LOCK_TIMEOUT_S,
    PARENT_STATEMENT_TIMEOUT_S,
    DatabaseUnavailable,
    LockBusy,
    QueueDB,
    QueueStats,
    SchemaMismatch,
)
from derivd.redact import one_line
from derivd.states import EventKind, Status

HEALTHY = 0
UNHEALTHY = 1
UNAVAILABLE = 3

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
# The recent events the table sums up, with their labels.
RECENT_EVENTS: tuple[tuple[str, EventKind], ...] = (
    ("ready", "ready"),
    ("retries", "retry"),
    ("rejected", "rejected"),
    ("exhausted", "exhausted"),
    ("lease lost", "lease_lost"),
    ("timeouts", "timeout"),
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


def as_json(report: Report, alarms: list[Alarm], limits: StatusSettings) -> dict[str, Any]:
    stats = report.stats
    return {
        "healthy": not alarms,
        "checked_at": datetime.fromtimestamp(report.checked_at, UTC).isoformat(),
        "reading_age_s": round(report.reading_age_s, 3),
        "counts": report.counts,
        "oldest_claimable_age_s": stats.oldest_claimable_age_s,
        "expired_leases": stats.expired_leases,
        "rejected_ratio": stats.rejected_ratio,
        "window_s": report.window_s,
        "lease_lost": report.events.get("lease_lost", 0),
        "timeouts": report.events.get("timeout", 0),
        "retries": report.events.get("retry", 0),
        "recent_finished": report.recent_finished,
        "recent_rejected_ratio": report.recent_rejected_ratio,
        "rejected_by_code": dict(sorted(report.rejected_by_code.items())),
        "events": dict(sorted(report.events.items())),
        "thresholds": {
            "max_oldest_age": limits.max_oldest_age,
            "max_expired_leases": limits.max_expired_leases,
            "max_rejected_ratio": limits.max_rejected_ratio,
            "fail_on_rejected": limits.fail_on_rejected,
            "min_finished": limits.min_finished,
            "min_hosts": limits.min_hosts,
            "max_webhook_age": limits.max_webhook_age,
            "max_webhook_open": limits.max_webhook_open,
        },
        "live_hosts": report.live_hosts,
        "problems": [a.__dict__ for a in alarms],
        "notices": [a.__dict__ for a in notices(report, limits)],
        "hosts": [host_json(h) for h in report.hosts],
        "backfill": report.backfill.as_json() if report.backfill else None,
        "warnings": report.warnings,
        "webhooks": [endpoint_json(row) for row in report.webhooks],
    }


def host_json(row: dict[str, Any]) -> dict[str, Any]:
    """One supervisor of the host registry: alive = it heartbeated within 3 of its
    intervals (a stale row stays, not alive, until pruned after [sweep] orphan_guard)."""
    return {
        "host": row["host"],
        "pid": row["pid"],
        "alive": bool(row["alive"]),
        "workers": row["workers"],
        "busy": row["busy"],
        "heartbeat_age_s": round(float(row["heartbeat_age_s"]), 3),
        "in_flight": row["in_flight"],
        "version": row["version"],
        "backend": row["backend"],
        "started_at": row["started_at"].isoformat(),
        "connections": connection_budget(row["workers"]).total,
    }


def _host_lines(hosts: list[dict[str, Any]]) -> list[str]:
    if not hosts:
        # A clean stop removes its host's row; a dead host's row is pruned once stale.
        return ["", "hosts: none running"]
    lines = [
        "",
        f"  {'host':<24}{'pid':>8}  {'state':<6}{'workers':>8}{'busy':>6}"
        f"{'in flight':>11}{'heartbeat':>11}{'conns':>7}",
    ]
    for h in hosts:
        state = "alive" if h["alive"] else "STALE"
        lines.append(
            f"  {h['host'][:23]:<24}{h['pid']:>8}  {state:<6}{h['workers']:>8}{h['busy']:>6}"
            f"{h['in_flight']:>11}{duration(h['heartbeat_age_s']) + ' ago':>11}"
            f"{connection_budget(h['workers']).total:>7}"
        )
    lines.append("  conns: the most database connections a host opens (README: Running many hosts)")
    return lines


def reading_age(seconds: float) -> str:
    """How old the shared counts are, in words for the table and the dashboard."""
    if seconds < 0.5:
        return "counts read now"
    return f"counts read {duration(seconds)} ago by the fleet ([status] max_age)"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _limit(value: float, render: Callable[[float], str]) -> str:
    return "off" if not value else render(value)


def render_table(report: Report, alarms: list[Alarm], limits: StatusSettings) -> str:
    stats, crossed = report.stats, {a.signal for a in alarms}
    noticed = notices(report, limits)
    window = duration(report.window_s)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report.checked_at))
    lines = [f"derivd status  {stamp}  ({reading_age(report.reading_age_s)})", "", "rows by status"]
    lines += [f"  {name:<12}{n:>10}" for name, n in report.counts.items()]

    def row(label: str, value: str, limit: str, signal: str | None, note: str = "") -> str:
        verdict = "" if signal is None else ("UNHEALTHY" if signal in crossed else "ok")
        if any(n.signal == signal for n in noticed):
            verdict = "HIGH"  # reported beside the verdict
        return f"  {label:<28}{value:>10}  {limit:>8}  {verdict:<10}{note}".rstrip()

    judged = report.recent_finished >= limits.min_finished
    lines += [
        "",
        f"  {'signal':<28}{'value':>10}  {'limit':>8}",
        row(
            "oldest claimable age",
            duration(stats.oldest_claimable_age_s) if stats.oldest_claimable_age_s else "none",
            _limit(limits.max_oldest_age, duration),
            "oldest_claimable_age_s",
        ),
        row(
            "expired leases",
            str(stats.expired_leases),
            _limit(limits.max_expired_leases, lambda v: str(int(v))),
            "expired_leases",
        ),
        row(
            f"rejected share (last {window})",
            _percent(report.recent_rejected_ratio),
            _limit(limits.max_rejected_ratio, _percent),
            "recent_rejected_ratio" if judged else None,
            f"of {report.recent_finished} finished"
            + ("" if judged else f" (judged from {limits.min_finished})"),
        ),
        row("rejected share (all rows)", _percent(stats.rejected_ratio), "", None),
        row(
            "live hosts",
            str(report.live_hosts),
            _limit(limits.min_hosts, lambda v: str(int(v))),
            "live_hosts" if report.claimable else None,
            "" if report.claimable else "(judged while work is claimable)",
        ),
        "",
        f"last {window}: "
        + "  ".join(f"{label} {report.events.get(kind, 0)}" for label, kind in RECENT_EVENTS),
    ]
    if report.rejected_by_code:
        codes = sorted(report.rejected_by_code.items(), key=lambda kv: (-kv[1], kv[0]))
        lines.append(
            f"rejected by code (last {window}): " + ", ".join(f"{c} {n}" for c, n in codes)
        )
    lines += _host_lines(report.hosts)
    lines += endpoint_lines(report.webhooks, window)
    if report.backfill is not None:
        lines += ["", report.backfill.line()]
    lines.append("")
    lines += [f"WARNING {warning}" for warning in report.warnings]
    for notice in noticed:
        lines.append(f"NOTICE {notice.signal}: {_show(notice)} (unhealthy only with "
                     "[status] fail_on_rejected = yes)")  # fmt: skip
        lines.append(f"  -> {notice.hint}")
    if not alarms:
        lines.append("health: ok")
    for alarm in alarms:
        lines.append(f"UNHEALTHY {alarm.signal}: {_show(alarm)}")
        lines.append(f"  -> {alarm.hint}")
    return "\n".join(lines)


def _show(alarm: Alarm) -> str:
    if alarm.signal == "oldest_claimable_age_s":
        return f"{duration(alarm.value)} > {duration(alarm.limit)}"
    if alarm.signal == "recent_rejected_ratio":
        return f"{_percent(alarm.value)} > {_percent(alarm.limit)}"
    if alarm.signal == "live_hosts":
        return f"{alarm.value:g} < {alarm.limit:g} while work is claimable"
    if alarm.endpoint is not None:
        return f"{alarm.endpoint}: {duration(alarm.value)} > {duration(alarm.limit)}"
    return f"{alarm.value:g} > {alarm.limit:g}"


def check_once(
    queue: QueueDB, limits: StatusSettings, *, as_json_out: bool, warnings: Sequence[str] = ()
) -> tuple[int, str]:
    """(exit status, text) of one look at the queue; `warnings` are added to its own."""
    report = collect(queue, limits)
    report.warnings[:0] = warnings
    alarms = evaluate(report, limits)
    if as_json_out:
        text = json.dumps(as_json(report, alarms, limits), sort_keys=False)
    else:
        text = render_table(report, alarms, limits)
    return (UNHEALTHY if alarms else HEALTHY), text


def run_status(
    config: Config,
    *,
    as_json_out: bool = False,
    watch: bool = False,
    interval: float = 2.0,
    count: int | None = None,
) -> int:
    """The `derivd status` command. Returns the exit status (see the module doc)."""
    from derivd.embedded import EmbeddedError
    from derivd.embedded.runtime import database

    try:
        # One connection: the schema is checked on the one that reads the status.
        with (
            database(config, read_only=True, check=False) as dsn,
            QueueDB.open(dsn, role="derivd-status", bound_s=PROBE_TIMEOUT_S) as queue,
        ):
            queue.check_schema()
            warnings = _listen_warnings(config, dsn, queue)
            if not watch:
                code, text = check_once(
                    queue, config.status, as_json_out=as_json_out, warnings=warnings
                )
                click.echo(text)
                return code
            return _watch(queue, config.status, as_json_out, interval, count)
    except (
        StatusUnavailable,
        DatabaseUnavailable,
        SchemaMismatch,
        EmbeddedError,
    ) as e:
        click.echo(f"derivd: {e}", err=True)
        return UNAVAILABLE


def _listen_warnings(config: Config, dsn: str, queue: QueueDB) -> list[str]:
    """The supervisors' LISTEN path, checked as they check it on every (re)connect. With
    no listen_dsn that path is `dsn`, whose pooler this command's own connection can
    tell: no second connection, and the supervisor's modules (metrics and all) are
    imported only when there is something to say. A health probe runs this every few
    seconds."""
    if not config.queue.listen:
        return []
    if config.database.listen_dsn:
        from derivd.processes.duties import listen_problem

        problem = listen_problem(config, dsn)
    elif queue.pooled():
        from derivd.processes.duties import pooled_listen

        problem = pooled_listen(config)
    else:
        problem = None
    return [f"wake-ups fall back to polling: {problem}"] if problem else []


def _watch(
    queue: QueueDB, limits: StatusSettings, as_json_out: bool, interval: float, count: int | None
) -> int:
    """Refresh until Ctrl-C (or `count` refreshes). On a terminal the table is redrawn in
    place; piped, each refresh follows the last (JSON: one object per line). A database
    outage is shown and watched through rather than ending the watch."""
    in_place = sys.stdout.isatty() and not as_json_out
    code, shown = HEALTHY, 0
    try:
        while True:
            try:
                code, text = check_once(queue, limits, as_json_out=as_json_out)
            except StatusUnavailable as error:
                code, text = UNAVAILABLE, f"derivd: {error}"
            if in_place:
                click.echo("\x1b[H\x1b[2J", nl=False)  # home + clear: redraw in place
            elif shown and not as_json_out:
                click.echo("")
            click.echo(text)
            shown += 1
            if count is not None and shown >= count:
                return code
            time.sleep(interval)
    except KeyboardInterrupt:
        return code
