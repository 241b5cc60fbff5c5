"""The dashboard's data: what `derivd status` computes (derivd.ops.health: the same
signals, thresholds and verdict), plus hosts, jobs in flight and the last hour per minute.

Read at most once per `[metrics] interval`, whatever the number of open tabs: requests
within the interval share one snapshot, and one reader thread at most reads the next
(requests never start their own). A request waits for that read at most READ_WAIT_S;
past it, it gets the last snapshot with its age (or "cannot tell" before any), so a slow
database never piles up request threads behind it; once a wait has run out, requests
answer at once from the last reading until a read answers again, and a read that fails
keeps the last reading on the page, with its age and why. Each read opens a short-lived,
bounded connection (derivd.queue.db.connect `bound_s`) and closes it, so the supervisor
holds no extra connection between views and none lingers across a fork.
Every query is bounded: counts as `derivd status` reads them, jobs in
flight through the partial index on processing rows (LIMIT), the hour's events through
the BRIN index on their time, capped at MAX_ROWS, each minute's median duration from at
most MEDIAN_SAMPLE of its jobs, looked up by key.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import psycopg

from derivd.config import Config
from derivd.ops.dashboard_view import MEDIAN_SAMPLE, HostView, InFlight, Minute, Snapshot
from derivd.ops.health import StatusUnavailable, collect, evaluate, notices
from derivd.ops.metrics import Metrics
from derivd.ops.web import Response
from derivd.queue.db import PARENT_STATEMENT_TIMEOUT_S, DatabaseUnavailable, QueueDB
from derivd.redact import one_line

READ_WAIT_S = 2.0  # a request waits this long for a fresh read, then gets the last one
MAX_ROWS = 1_000_000  # the most rows one dashboard query may read
IN_FLIGHT_SHOWN = 100


def local_host(metrics: Metrics, host: str) -> HostView:
    """This supervisor, from its own state (alive and busy workers as last published),
    named as the host registry names it (`[supervisor] host_id`)."""
    alive, busy = metrics.workers_now
    return HostView(
        host=host,
        pid=os.getpid(),
        alive=True,
        workers=alive,
        busy=busy,
        heartbeat_age_s=None,
        this_host=True,
    )


def registry_hosts(rows: Sequence[Mapping[str, Any]], local: HostView) -> tuple[HostView, ...]:
    """The host registry's rows (`derivd status`'s `hosts`) as host views, this
    supervisor marked; without a registry, this supervisor alone."""
    if not rows:
        return (local,)
    return tuple(
        HostView(
            host=str(row["host"]),
            pid=int(row["pid"]),
            alive=bool(row["alive"]),
            workers=int(row["workers"]),
            busy=int(row["busy"]),
            heartbeat_age_s=float(row["heartbeat_age_s"]),
            this_host=(int(row["pid"]), str(row["host"])) == (local.pid, local.host),
        )
        for row in rows
    )


def read_snapshot(queue: QueueDB, config: Config, hosts: tuple[HostView, ...]) -> Snapshot:
    """One look at the queue; StatusUnavailable when the database cannot answer."""
    report = collect(queue, config.status)
    if report.hosts and len(hosts) == 1:  # the host registry, as `derivd status` reads it
        hosts = registry_hosts(report.hosts, hosts[0])
    try:
        rows = queue.in_flight(limit=IN_FLIGHT_SHOWN)
        minutes = queue.finished_per_minute(cap=MAX_ROWS, sample=MEDIAN_SAMPLE)
    except DatabaseUnavailable as error:
        raise StatusUnavailable(str(error)) from None
    except psycopg.Error as error:
        raise StatusUnavailable(f"database error: {one_line(error)}") from None
    return replace(
        Snapshot.taken(config, report),
        alarms=tuple(evaluate(report, config.status)),
        notices=tuple(notices(report, config.status)),
        hosts=hosts,
        in_flight=tuple(
            InFlight(
                r["id"],
                r["attempts"],
                r["age_s"] or 0.0,
                r["lease_left_s"] or 0.0,
                r["claimed_by"] or "",
            )
            for r in rows
        ),
        minutes=tuple(Minute(r["minutes_ago"], r["finished"], r["median_s"]) for r in minutes),
        minutes_capped=sum(r["finished"] for r in minutes) >= MAX_ROWS,
    )


class Dashboard:
    """The `/` route of the supervisor's web endpoint."""

    def __init__(
        self,
        dsn: str,
        config: Callable[[], Config],
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dsn = dsn
        self.config = config  # the supervisor's current one (a reload changes it)
        self.metrics = metrics
        self.clock = clock
        self._lock = threading.Lock()
        self._good: tuple[float, Snapshot] | None = None  # the last answered read, and when
        self._error: str | None = None  # why the latest read failed (None: it answered)
        self._read_at: float | None = None  # when the latest read started
        self._reading: threading.Event | None = None  # set when the read in flight ends
        # The last wait for a read ran out: the database is slow or frozen. Requests then
        # answer at once from the last reading instead of each waiting READ_WAIT_S.
        self._slow = False
        self.reads = 0  # database reads so far (the cache's test counts them)
        self.waits_run_out = 0  # requests whose wait for a read ran out (the tests count)

    def snapshot(self) -> Snapshot:
        """The current snapshot: cached within the interval, else a fresh read if it comes
        within READ_WAIT_S (at once when the last wait ran out), else the last one with
        its age, and why the latest read failed if it did."""
        config = self.config()
        with self._lock:
            now = self.clock()
            if self._read_at is not None and now - self._read_at < config.metrics.interval:
                return self._answer(config, now)
            reading = self._reading
            if reading is None:
                reading = self._reading = threading.Event()
                self._read_at = now
                threading.Thread(
                    target=self._refresh, args=(config, reading), name="derivd-dashboard",
                    daemon=True,
                ).start()  # fmt: skip
            wait = not (self._slow and self._good is not None)
        if wait and not reading.wait(READ_WAIT_S):
            with self._lock:
                self._slow = True
                self.waits_run_out += 1
        with self._lock:
            return self._answer(config, self.clock())

    def _answer(self, config: Config, now: float) -> Snapshot:
        """From the last answered read: as it is while it is current, else with its age
        (a newer read is slow, or failed: then with why)."""
        if self._good is None:
            error = self._error or "the database has not answered yet"
            return replace(Snapshot.taken(config, None), error=error, hosts=self._local(config))
        read_at, snapshot = self._good
        current = self._error is None and self._reading is None
        if current:
            return snapshot
        return replace(snapshot, stale_s=max(0.0, now - read_at), error=self._error)

    def _refresh(self, config: Config, done: threading.Event) -> None:
        try:
            snapshot = self._read(config)
            with self._lock:
                if snapshot.report is not None:
                    self._good, self._error, self._slow = (self.clock(), snapshot), None, False
                else:
                    self._error = snapshot.error or "the database could not answer"
        finally:
            with self._lock:
                self._reading = None
            done.set()

    def _local(self, config: Config) -> tuple[HostView, ...]:
        return (local_host(self.metrics, config.host_id),)

    def _read(self, config: Config) -> Snapshot:
        hosts = self._local(config)
        self.reads += 1
        try:
            with QueueDB.open(
                self.dsn, role="derivd-dashboard", bound_s=PARENT_STATEMENT_TIMEOUT_S
            ) as queue:
                return read_snapshot(queue, config, hosts)
        except (StatusUnavailable, DatabaseUnavailable) as error:
            return replace(Snapshot.taken(config, None), error=str(error), hosts=hosts)

    def route(self, headers: Mapping[str, str]) -> Response:
        from derivd.ops.dashboard_page import render

        snapshot = self.snapshot()
        return Response(
            render(snapshot).encode("utf-8"),
            "text/html; charset=utf-8",
            200 if snapshot.report is not None else 503,
        )
