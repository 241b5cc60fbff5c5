"""Prometheus metrics of the supervisor (names prefixed `derivd_`).

Children never serve metrics: they report job results to the parent over their pipe and
the parent records them here. Queue gauges come from one SQL query on a timer (the
supervisor calls `set_queue`), never from a query per scrape. Each `Metrics` has its own
CollectorRegistry, so tests can build several side by side.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder, generate_latest

from derivd.config_checks import ConfigError, Problem, split_host_port
from derivd.ops.web import Response, Route, WebServer
from derivd.queue.db import QueueStats
from derivd.states import STATUSES, EventKind

# `*_created` series double the page and no dashboard uses them (process-wide switch; the
# supervisor has no other Prometheus user).
disable_created_metrics()  # type: ignore[no-untyped-call]

RESTART_REASONS = ("crash", "timeout", "recycle", "reload", "lease_lost")
# The event kinds whose recent-window gauge always exists (0 included).
COUNTED_EVENTS: tuple[EventKind, ...] = (
    "ready",
    "retry",
    "rejected",
    "lease_lost",
    "timeout",
    "exhausted",
)

# Image jobs take from a few ms (noop, thumbnails) to minutes (huge TIFFs near the timeout).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Queue wait spans ms (idle workers) to an hour (a backlog).
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 1800, 3600)


WEBHOOK_GAUGES = {
    "backlog": "Deliveries pending or being delivered, per endpoint (all hosts)",
    "oldest_undelivered_seconds": "Age of the oldest undelivered event, per endpoint",
    "delivered_recent": "Deliveries delivered over the [status] window, per endpoint",
    "failed_recent": "Deliveries failed over the [status] window, per endpoint",
    "failed_kept": "Failed deliveries kept (until replayed or past retention), per endpoint",
    "paused": "1 while the endpoint's circuit pauses its claims, per endpoint",
    "circuit_open": "1 while the endpoint's circuit is open (one probe at a time), per endpoint",
    "next_probe_seconds": "Seconds until the open circuit's next probe (0: due, or closed)",
    "removed": "1 once the endpoint left the INI (listed while its failed rows are kept)",
}
WEBHOOK_COLUMNS = {
    "oldest_undelivered_seconds": "oldest_undelivered_age_s",
    "circuit_open": "open",
    "next_probe_seconds": "next_probe_s",
}


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self._server: WebServer | None = None
        self.workers_now: tuple[int, int] = (0, 0)  # alive, busy
        r = self.registry
        self.jobs = Counter(
            "derivd_jobs_finished",
            "Attempts ended, by outcome, error code (none when not rejected/retried) and backend",
            ["outcome", "code", "backend"],
            registry=r,
        )
        self.duration = Histogram(
            "derivd_job_duration_seconds",
            "Wall time of one attempt (claim to commit), by backend and outcome",
            ["backend", "outcome"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.wait = Histogram(
            "derivd_queue_wait_seconds",
            "Time a row was claimable before a worker claimed it",
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.lease_lost = Counter(
            "derivd_lease_lost",
            "Attempts whose fenced commit or failure found the lease gone",
            registry=r,
        )
        self.timeouts = Counter(
            "derivd_job_timeouts", "Workers killed past job_timeout", registry=r
        )
        self.restarts = Counter(
            "derivd_worker_restarts", "Workers replaced, by reason", ["reason"], registry=r
        )
        for reason in RESTART_REASONS:
            self.restarts.labels(reason)  # exported at 0, so rate() works from the start
        self.workers_alive = Gauge("derivd_workers_alive", "Worker processes alive", registry=r)
        self.workers_busy = Gauge(
            "derivd_workers_busy", "Workers processing a job right now", registry=r
        )
        self.rows = Gauge("derivd_queue_rows", "Rows per status", ["status"], registry=r)
        self.oldest = Gauge(
            "derivd_queue_oldest_claimable_age_seconds",
            "How long the oldest claimable queued row has waited (0: none waiting)",
            registry=r,
        )
        self.expired = Gauge(
            "derivd_queue_expired_leases",
            "Rows in processing whose lease has expired (their worker died or hung)",
            registry=r,
        )
        self.rejected_ratio = Gauge(
            "derivd_queue_rejected_ratio", "rejected / (ready + rejected), all rows", registry=r
        )
        self.stats_updated = Gauge(
            "derivd_queue_stats_updated_timestamp_seconds",
            "Unix time of the last successful queue stats query (stale: the database is down)",
            registry=r,
        )
        self.heartbeats = Counter(
            "derivd_heartbeats",
            "Heartbeats sent by this supervisor (lease check, renewal, host registry), by result",
            ["result"],
            registry=r,
        )
        for result in ("ok", "failed"):
            self.heartbeats.labels(result)
        self.heartbeat_age = Gauge(
            "derivd_heartbeat_age_seconds",
            "Seconds since this supervisor's last answered heartbeat (-1: none yet)",
            registry=r,
        )
        self.heartbeat_age.set(-1)
        self.lease_lost_kills = Counter(
            "derivd_jobs_killed_lease_lost",
            "Running jobs killed because the heartbeat found their lease gone",
            registry=r,
        )
        self.hosts_alive = Gauge(
            "derivd_hosts_alive",
            "Supervisors in the host registry with a recent heartbeat (all hosts)",
            registry=r,
        )
        self.events = Gauge(
            "derivd_events_recent",
            "Events in archive_events over the recent window (all hosts), by kind",
            ["kind"],
            registry=r,
        )
        # Webhooks, per endpoint (its NAME: a bounded label set), all hosts: see set_webhooks.
        self.webhook_gauges = {
            key: Gauge(f"derivd_webhook_{key}", doc, ["endpoint"], registry=r)
            for key, doc in WEBHOOK_GAUGES.items()
        }

    # -- the interface the supervisor calls ------------------------------------------

    def job_finished(
        self, *, outcome: str, code: str | None, duration_s: float, wait_s: float, backend: str
    ) -> None:
        """One attempt ended: outcome is ready|retry|rejected|lease_lost|released|unknown,
        or for a re-derivation (backfill) rederived|rederive_rejected."""
        self.jobs.labels(outcome, code or "none", backend).inc()
        self.duration.labels(backend, outcome).observe(max(0.0, duration_s))
        self.wait.observe(max(0.0, wait_s))
        if outcome == "lease_lost":
            self.lease_lost.inc()

    def jobs_reported(self, rows: Sequence[Sequence[Any]], *, backend: str) -> None:
        """The outcome rows of a worker's "finished" message (processes.pipe): id,
        outcome, code, duration_s, wait_s."""
        for _id, outcome, code, duration_s, wait_s in rows:
            self.job_finished(
                outcome=str(outcome),
                code=code,
                duration_s=float(duration_s or 0.0),
                wait_s=float(wait_s or 0.0),
                backend=backend,
            )

    def job_timed_out(self) -> None:
        """The supervisor killed a worker past job_timeout."""
        self.timeouts.inc()

    def worker_restarted(self, reason: str) -> None:
        """A worker was replaced: crash | timeout | recycle | reload | lease_lost."""
        self.restarts.labels(reason).inc()

    def heartbeat(self, *, ok: bool) -> None:
        """One heartbeat answered (ok) or not (the database failed or hung)."""
        self.heartbeats.labels("ok" if ok else "failed").inc()

    def set_heartbeat_age(self, age_s: float | None) -> None:
        self.heartbeat_age.set(-1 if age_s is None else age_s)

    def job_killed_lease_lost(self) -> None:
        """A running job was killed: the heartbeat found its lease gone."""
        self.lease_lost_kills.inc()

    def set_hosts(self, *, alive: int) -> None:
        """From the host registry, on the stats timer."""
        self.hosts_alive.set(alive)

    def set_workers(self, *, alive: int, busy: int) -> None:
        """Current fleet state."""
        self.workers_now = (alive, busy)  # one tuple: the dashboard's thread reads it whole
        self.workers_alive.set(alive)
        self.workers_busy.set(busy)

    def set_queue(self, stats: QueueStats) -> None:
        """Queue gauges from the periodic stats query. Every status gets a gauge (0
        included), so a status that empties does not keep its last value."""
        for status in sorted({*STATUSES, *stats.counts}):
            self.rows.labels(status).set(stats.counts.get(status, 0))
        self.oldest.set(stats.oldest_claimable_age_s or 0.0)
        self.expired.set(stats.expired_leases)
        self.rejected_ratio.set(stats.rejected_ratio)
        self.stats_updated.set(time.time())

    def set_event_counts(self, counts: Mapping[str, int]) -> None:
        """Events per kind over the recent window (QueueDB.event_window), on the same timer
        as set_queue. Kinds absent from `counts` drop to 0 rather than keep a stale value."""
        for kind in sorted({*self._known_event_kinds(), *counts}):
            self.events.labels(kind).set(counts.get(kind, 0))

    def set_webhooks(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Per endpoint the database knows (QueueDB.webhook_stats); endpoints gone since
        lose their series rather than keep a stale value."""
        for key, gauge in self.webhook_gauges.items():
            gauge.clear()
            column = WEBHOOK_COLUMNS.get(key, key)
            for row in rows:
                gauge.labels(row["name"]).set(float(row.get(column) or 0))

    def serve(self, listen: str, *, dashboard: Route | None = None, where: str = "startup") -> None:
        """Start the HTTP endpoint on host:port (a daemon thread in the supervisor):
        `/metrics`, and the dashboard at `/` when given (derivd.ops.web).

        Port 0 picks a free port (see `address`). A port that cannot be bound is a
        configuration problem: ConfigError naming [metrics] listen and `where` it was set
        (the config file or environment variable).
        """
        host, port = split_listen(listen, where)
        routes: dict[str, Route] = {"/metrics": self._exposition}
        if dashboard is not None:
            routes["/"] = dashboard
        try:
            self._server = WebServer(host, port, routes)
        except OSError as error:
            reason = error.strerror or str(error)
            raise ConfigError(
                [
                    Problem(
                        where,
                        "metrics",
                        "listen",
                        f"cannot listen on {listen}: {reason}",
                    )
                ]
            ) from None

    def _exposition(self, headers: Mapping[str, str]) -> Response:
        """The scrape, in the format the scraper asks for (text or OpenMetrics)."""
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        return Response(encoder(self.registry), content_type)

    # -- helpers ------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) actually bound by serve(), or None when not serving."""
        return None if self._server is None else self._server.address

    def close(self) -> None:
        """Stop the endpoint (tests, shutdown)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()

    def fileno(self) -> int | None:
        """The listening socket, which a forked child must close (see spawn_worker)."""
        return self._server.fileno() if self._server is not None else None

    def render(self) -> bytes:
        """The exposition text, as a scrape would see it."""
        return generate_latest(self.registry)

    def _known_event_kinds(self) -> tuple[EventKind, ...]:
        return COUNTED_EVENTS


def split_listen(listen: str, where: str = "startup") -> tuple[str, int]:
    """`host:port` (IPv6 as `[::1]:9464`) -> (host, port)."""
    try:
        return split_host_port(listen)
    except ValueError as error:
        raise ConfigError([Problem(where, "metrics", "listen", str(error))]) from None


def listening_line(address: tuple[str, int] | None) -> str:
    """The supervisor's start-up line saying where its dashboard and metrics are."""
    if address is None:
        return "dashboard and /metrics: off (set [metrics] listen = host:port to serve them)"
    host, port = address
    base = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    return f"dashboard: {base}/  metrics: {base}/metrics"
