"""The dashboard's HTML: one self-contained page (inline CSS and SVG, no script, nothing
fetched from anywhere: hosts may be air-gapped), refreshed by the browser every
`[metrics] interval`. Every value from the database or the host goes through `esc`.

Cells carry their raw numbers in `data-value` attributes next to the human text, so
tests and scrapers read the numbers without parsing "3m12s".
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Iterable, Mapping, Sequence

from derivd.ops.dashboard_view import MEDIAN_SAMPLE, HostView, InFlight, Minute, Snapshot
from derivd.ops.durations import duration
from derivd.ops.health import Report, reading_age
from derivd.ops.webhook_view import circuit_state, circuit_text

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1d2430;background:#fafafa}
h1{font-size:1.4em;margin:0}h2{font-size:1.05em;margin:1.4em 0 .4em}
header{display:flex;gap:1em;align-items:baseline;flex-wrap:wrap}
table{border-collapse:collapse;background:#fff}
th,td{padding:.25em .7em;border-bottom:1px solid #e3e6ea;text-align:left}
td.n,td.num{text-align:right;font-variant-numeric:tabular-nums}
.verdict{font-weight:600;padding:.1em .6em;border-radius:.3em}
.ok{color:#0b6b2b}.bad{color:#a11818}.unknown{color:#8a5a00}
#verdict.ok{background:#dff3e4}#verdict.bad{background:#f8dcdc}#verdict.unknown{background:#fbedcc}
.grid{display:flex;gap:2.5em;flex-wrap:wrap;align-items:flex-start}
.muted{color:#6b7480}.error{color:#a11818;font-weight:600}
svg{background:#fff;border:1px solid #e3e6ea}
svg .bar{fill:#4a7bd0}svg .median{fill:none;stroke:#d9822b;stroke-width:2}
svg .median-dot{fill:#d9822b}
svg text{font:10px system-ui,sans-serif;fill:#6b7480}
meter{width:8em}
"""


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def render(snapshot: Snapshot) -> str:
    report = snapshot.report
    parts = [
        _head(snapshot),
        _header(snapshot),
        f'<p class="error" id="error">{esc(snapshot.error)}</p>' if snapshot.error else "",
        (
            f'<p class="muted" id="stale">The database is slow to answer: this view is '
            f"{esc(duration(snapshot.stale_s))} old.</p>"
        )
        if snapshot.stale_s is not None
        else "",
    ]
    if report is not None:
        parts += [
            '<div class="grid">',
            _signals(snapshot, report),
            _status_rows(report),
            _rejections(report),
            _backfill(report),
            _webhooks(report),
            "</div>",
            _problems(snapshot),
        ]
    parts += ['<div class="grid">', _hosts(snapshot.hosts)]
    if report is not None:
        parts.append(_in_flight(snapshot, report))
    parts.append("</div>")
    if report is not None:
        parts.append(_hour(snapshot))
    parts.append(
        '<p class="muted">Read-only. The same signals and thresholds as <code>derivd '
        "status</code>; refreshed every "
        f'<span id="refresh">{esc(duration(snapshot.refresh_s))}</span>.</p></body></html>'
    )
    return "\n".join(p for p in parts if p)


def _head(snapshot: Snapshot) -> str:
    refresh = max(1, math.ceil(snapshot.refresh_s))
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{refresh}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>derivd · {esc(snapshot.host)}</title><style>{STYLE}</style></head><body>"
    )


def _header(snapshot: Snapshot) -> str:
    healthy = snapshot.healthy
    css, word = (
        ("unknown", "cannot tell")
        if healthy is None
        else ("ok", "healthy")
        if healthy
        else ("bad", "unhealthy")
    )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snapshot.taken_at))
    report = snapshot.report
    age = (
        ""
        if report is None
        else f'<span class="muted" id="reading-age" data-value="{report.reading_age_s:.3f}">'
        f"{esc(reading_age(report.reading_age_s))}</span>"
    )
    return (
        f'<header><h1>derivd</h1><span id="host">{esc(snapshot.host)}</span>'
        f'<span id="verdict" class="verdict {css}">{esc(word)}</span>'
        f'<span class="muted">checked <time id="checked-at" '
        f'data-value="{snapshot.taken_at:.3f}">{esc(stamp)}</time></span>{age}</header>'
    )


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _signals(snapshot: Snapshot, report: Report) -> str:
    limits, crossed = snapshot.limits, {a.signal for a in snapshot.alarms}
    noticed = {a.signal for a in snapshot.notices}
    stats, window = report.stats, duration(report.window_s)
    judged = report.recent_finished >= limits.min_finished
    oldest = stats.oldest_claimable_age_s

    def row(
        signal: str,
        label: str,
        value: float | None,
        shown: str,
        limit: float | None,
        limit_shown: str,
        is_judged: bool = True,
    ) -> str:
        if limit is None:
            verdict, css = "", ""
        elif not limit:
            verdict, css = "off", "muted"
        elif not is_judged:
            verdict, css = f"judged from {limits.min_finished}", "muted"
        elif signal in noticed:
            verdict, css = "high (reported)", "unknown"
        else:
            verdict, css = ("UNHEALTHY", "bad") if signal in crossed else ("ok", "ok")
        raw = "" if value is None else f"{value:g}"
        raw_limit = "" if limit is None else f"{limit:g}"
        return (
            f'<tr data-signal="{esc(signal)}"><th>{esc(label)}</th>'
            f'<td class="num value" data-value="{esc(raw)}">{esc(shown)}</td>'
            f'<td class="num limit" data-value="{esc(raw_limit)}">{esc(limit_shown)}</td>'
            f'<td class="verdict {css}">{esc(verdict)}</td></tr>'
        )

    def lim(value: float, text: str) -> str:
        return text if value else "off"

    rows = [
        row(
            "oldest_claimable_age_s",
            "oldest claimable age",
            oldest or 0.0,
            duration(oldest) if oldest else "none",
            limits.max_oldest_age,
            lim(limits.max_oldest_age, duration(limits.max_oldest_age)),
        ),
        row(
            "expired_leases",
            "expired leases",
            stats.expired_leases,
            str(stats.expired_leases),
            limits.max_expired_leases,
            lim(limits.max_expired_leases, str(limits.max_expired_leases)),
        ),
        row(
            "recent_rejected_ratio",
            f"rejected share (last {window})",
            report.recent_rejected_ratio,
            _percent(report.recent_rejected_ratio) + f" of {report.recent_finished}",
            limits.max_rejected_ratio,
            lim(limits.max_rejected_ratio, _percent(limits.max_rejected_ratio)),
            judged,
        ),
        row(
            "live_hosts",
            "live hosts",
            report.live_hosts,
            str(report.live_hosts) + ("" if report.claimable else " (nothing claimable)"),
            limits.min_hosts,
            lim(limits.min_hosts, str(limits.min_hosts)),
        ),
        row(
            "rejected_ratio",
            "rejected share (all rows)",
            stats.rejected_ratio,
            _percent(stats.rejected_ratio),
            None,
            "",
        ),
    ]
    for kind, label in (
        ("lease_lost", "lease lost"),
        ("timeout", "timeouts"),
        ("retry", "retries"),
    ):
        n = report.events.get(kind, 0)
        rows.append(row(kind, f"{label} (last {window})", n, str(n), None, ""))
    return (
        '<section id="signals"><h2>Health</h2><table><tr><th>signal</th><th>value</th>'
        f"<th>limit</th><th>verdict</th></tr>{''.join(rows)}</table></section>"
    )


def _problems(snapshot: Snapshot) -> str:
    """What to do about each crossed threshold (the hints of `derivd status`)."""
    hints = "".join(f'<li class="bad">{esc(a.signal)}: {esc(a.hint)}</li>' for a in snapshot.alarms)
    hints += "".join(
        f'<li class="unknown">{esc(a.signal)} (reported): {esc(a.hint)}</li>'
        for a in snapshot.notices
    )
    return f'<ul id="problems">{hints}</ul>' if hints else ""


def _counts_table(
    section: str, title: str, attr: str, items: Iterable[tuple[str, int]], empty: str
) -> str:
    rows = "".join(
        f'<tr {attr}="{esc(k)}"><th>{esc(k)}</th><td class="n" data-value="{n}">{n:,}</td></tr>'
        for k, n in items
    )
    body = f"<table>{rows}</table>" if rows else f'<p class="muted">{esc(empty)}</p>'
    return f'<section id="{section}"><h2>{esc(title)}</h2>{body}</section>'


def _status_rows(report: Report) -> str:
    return _counts_table("rows", "Rows by status", "data-status", report.counts.items(), "")


def _rejections(report: Report) -> str:
    codes = sorted(report.rejected_by_code.items(), key=lambda kv: (-kv[1], kv[0]))
    title = f"Rejected by code (last {duration(report.window_s)})"
    return _counts_table("rejections", title, "data-code", codes, "none")


def _backfill(report: Report) -> str:
    if report.backfill is None:
        return ""
    b = report.backfill
    return (
        f'<section id="backfill" data-state="{esc(b.state)}"><h2>Backfill</h2>'
        f"<p>{esc(b.line())}</p></section>"
    )


def _webhooks(report: Report) -> str:
    """Per endpoint: backlog, oldest undelivered, delivered / failed in the window, failed
    rows kept, the circuit and the last error (none of it secret)."""
    if not report.webhooks:
        return ""
    rows = "".join(
        f'<tr data-endpoint="{esc(w["name"])}"><td>{esc(w["name"])}</td>'
        f'<td class="num backlog" data-value="{w["backlog"]}">{w["backlog"]}</td>'
        f'<td class="num oldest">{esc(duration(w["oldest_undelivered_age_s"]))}</td>'
        f'<td class="num delivered" data-value="{w["delivered_recent"]}">'
        f"{w['delivered_recent']}</td>"
        f'<td class="num failed" data-value="{w["failed_recent"]}">{w["failed_recent"]}</td>'
        f'<td class="num kept" data-value="{w["failed_kept"]}">{w["failed_kept"]}</td>'
        f'<td class="state {"ok" if circuit_text(w) in ("ok", "failing") else "bad"}" '
        f'data-circuit="{circuit_state(w)}">{esc(circuit_text(w))}</td>'
        f'<td class="last-error">{esc(w["last_error"] or "-")}</td></tr>'
        for w in report.webhooks
    )
    return (
        f'<section id="webhooks"><h2>Webhooks (last {esc(duration(report.window_s))})</h2>'
        "<table><tr><th>endpoint</th><th>backlog</th><th>oldest</th><th>delivered</th>"
        "<th>failed</th><th>kept</th><th>circuit</th><th>last error</th></tr>"
        f"{rows}</table></section>"
    )


def _hosts(hosts: Sequence[HostView]) -> str:
    rows = "".join(
        f'<tr data-host="{esc(h.host)}"><td>{esc(h.host)}'
        f"{' <span class=muted>(this)</span>' if h.this_host else ''}</td>"
        f'<td class="num pid" data-value="{h.pid}">{h.pid}</td>'
        f'<td class="state {"ok" if h.alive else "bad"}">{"alive" if h.alive else "stale"}</td>'
        f'<td class="num workers" data-value="{h.workers}">{h.workers}</td>'
        f'<td class="num busy" data-value="{h.busy}">{h.busy}</td>'
        f'<td class="num idle" data-value="{h.idle}">{h.idle}</td>'
        f'<td class="num heartbeat">{esc(duration(h.heartbeat_age_s))}</td></tr>'
        for h in hosts
    )
    return (
        '<section id="hosts"><h2>Hosts</h2><table><tr><th>host</th><th>pid</th><th>state</th>'
        "<th>workers</th><th>busy</th><th>idle</th><th>heartbeat</th></tr>"
        f"{rows}</table></section>"
    )


def _in_flight(snapshot: Snapshot, report: Report) -> str:
    total = report.counts.get("processing", 0)
    timeout = snapshot.job_timeout
    rows = "".join(_job_row(job, timeout) for job in snapshot.in_flight)
    shown = len(snapshot.in_flight)
    note = f" (oldest {shown} shown)" if total > shown else ""
    table = (
        "<table><tr><th>file</th><th>host</th><th>attempt</th><th>age</th><th>of job_timeout "
        f"{esc(duration(timeout))}</th><th>lease left</th></tr>{rows}</table>"
        if rows
        else '<p class="muted">none</p>'
    )
    return (
        f'<section id="in-flight"><h2>Jobs in flight: <span id="in-flight-total" '
        f'data-value="{total}">{total:,}</span>{esc(note)}</h2>{table}</section>'
    )


def _job_row(job: InFlight, timeout: float) -> str:
    over = timeout and job.age_s > timeout
    lease = duration(job.lease_left_s) if job.lease_left_s > 0 else "expired"
    return (
        f'<tr data-file="{job.id}"><td class="num">{job.id}</td>'
        f'<td class="holder" data-value="{esc(job.holder)}">{esc(job.holder)}</td>'
        f'<td class="num">{job.attempt}</td>'
        f'<td class="num age{" bad" if over else ""}" data-value="{job.age_s:.3f}">'
        f"{esc(duration(job.age_s))}</td>"
        f'<td><meter min="0" max="{timeout:g}" low="{0.5 * timeout:g}" '
        f'high="{0.8 * timeout:g}" optimum="0" value="{min(job.age_s, timeout):.3f}"></meter></td>'
        f'<td class="num{" bad" if job.lease_left_s <= 0 else ""}">{esc(lease)}</td></tr>'
    )


def _hour(snapshot: Snapshot) -> str:
    total = sum(m.finished for m in snapshot.minutes)
    capped = " (capped: only the first 1,000,000 events read)" if snapshot.minutes_capped else ""
    return (
        '<section id="hour"><h2>Last hour: <span id="finished-hour" '
        f'data-value="{total}">{total:,}</span> jobs finished{esc(capped)}</h2>'
        f"{chart(snapshot.minutes, snapshot.taken_at)}"
        '<p class="muted">Bars: jobs finished per minute (ready, rejected, exhausted). '
        f"Line: median duration, claim to finish (of each minute's latest {MEDIAN_SAMPLE} jobs "
        "at most).</p></section>"
    )


W, H, PAD, SLOTS = 640, 150, 34, 60


def chart(minutes: Sequence[Minute], taken_at: float) -> str:
    """60 one-minute bars (oldest left) and a median-duration line on its own scale.

    The line runs flat across each minute's slot, so a single minute of data is a
    visible segment (a polyline of one point draws nothing), with a dot on minutes that
    have no neighbour. Labels at the right edge are anchored at their end: inside the
    picture whatever the font's width."""
    by_age = {m.minutes_ago: m for m in minutes}
    top = max((m.finished for m in minutes), default=0) or 1
    slowest = max((m.median_s or 0.0 for m in minutes), default=0.0) or 1.0
    slot = (W - 2 * PAD) / SLOTS
    plot_h = H - 2 * 14
    bars, points, dots = [], [], []
    for i in range(SLOTS):
        ago = SLOTS - 1 - i
        x = PAD + i * slot
        m = by_age.get(ago)
        if m is None:
            continue
        h = plot_h * m.finished / top
        clock = time.strftime("%H:%M", time.localtime(taken_at - ago * 60))
        median = "-" if m.median_s is None else duration(m.median_s)
        raw_median = "" if m.median_s is None else f"{m.median_s:g}"
        bars.append(
            f'<rect class="bar" x="{x + 1:.1f}" y="{14 + plot_h - h:.1f}" '
            f'width="{slot - 2:.1f}" height="{h:.1f}" data-minutes-ago="{ago}" '
            f'data-finished="{m.finished}" data-median="{raw_median}">'
            f"<title>{esc(clock)}: {m.finished} finished, median {esc(median)}</title></rect>"
        )
        if m.median_s is not None:
            y = 14 + plot_h - plot_h * m.median_s / slowest
            points.append(f"{x + 1:.1f},{y:.1f} {x + slot - 1:.1f},{y:.1f}")
            if not _has_median(by_age, ago + 1) and not _has_median(by_age, ago - 1):
                dots.append(
                    f'<circle class="median-dot" cx="{x + slot / 2:.1f}" cy="{y:.1f}" r="3"/>'
                )
    line = f'<polyline class="median" points="{" ".join(points)}"/>' if points else ""
    labels = (
        f'<text x="2" y="10">{top:,}/min</text>'
        f'<text x="{W - 2}" y="10" text-anchor="end">{esc(duration(slowest))}</text>'
        f'<text x="{PAD}" y="{H - 2}">-60 min</text>'
        f'<text x="{W - PAD}" y="{H - 2}" text-anchor="end">now</text>'
    )
    return (
        f'<svg id="chart" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'viewBox="0 0 {W} {H}" role="img" aria-label="jobs finished per minute, last hour">'
        f"{''.join(bars)}{line}{''.join(dots)}{labels}</svg>"
    )


def _has_median(by_age: Mapping[int, Minute], ago: int) -> bool:
    minute = by_age.get(ago)
    return minute is not None and minute.median_s is not None
