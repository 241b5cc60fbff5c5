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
from datetime import UTC, datetime
from typing import Any

import click

from derivd.config import Config, StatusSettings
from derivd.ops.budget import connection_budget
from derivd.ops.durations import duration
from derivd.ops.health import (
    PROBE_TIMEOUT_S,
    Alarm,
    Report,
    StatusUnavailable,
    collect,
    evaluate,
    notices,
    reading_age,
)
from derivd.ops.webhook_view import endpoint_json, endpoint_lines
from derivd.queue.db import DatabaseUnavailable, QueueDB, SchemaMismatch
from derivd.states import EventKind

HEALTHY = 0
UNHEALTHY = 1
UNAVAILABLE = 3

# The recent events the table sums up, with their labels.
RECENT_EVENTS: tuple[tuple[str, EventKind], ...] = (
    ("ready", "ready"),
    ("retries", "retry"),
    ("rejected", "rejected"),
    ("exhausted", "exhausted"),
    ("lease lost", "lease_lost"),
    ("timeouts", "timeout"),
)


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
