"""The dashboard at `/` of `[metrics] listen`: its numbers against the database (the same
signals and verdict as `derivd status`), its cache, escaping, and the endpoint's
behaviour for other paths, query strings and HEAD. The browser test is in
tests/test_dashboard_browser.py."""

from __future__ import annotations

import http.client
import re
import threading
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any

import pytest
from fixtures.metrics import seed_queue
from fixtures.pgproxy import PgProxy
from fixtures.work import claim_one, commit_one
from helpers import sql, wait_for

from derivd.config import Config, load_config
from derivd.ops.dashboard import Dashboard, read_snapshot, registry_hosts
from derivd.ops.dashboard_page import chart, render
from derivd.ops.dashboard_view import HostView, Minute, Snapshot
from derivd.ops.metrics import Metrics
from derivd.ops.status import Report, evaluate
from derivd.ops.web import Response
from derivd.queue.db import QueueDB, QueueStats


class Cells(HTMLParser):
    """Every element's attributes by its data-* key, and the text of elements by id."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.attrs_by: dict[tuple[str, str], dict[str, str]] = {}
        self.rows: dict[tuple[str, str], dict[str, str]] = {}  # (data-key, key) -> class: value
        self.ids: dict[str, dict[str, str]] = {}
        self.bars: list[dict[str, str]] = []
        self._row: tuple[str, str] | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "tr":
            keys = [(k, v) for k, v in a.items() if k.startswith("data-")]
            self._row = keys[0] if keys else None
            if self._row:
                self.rows[self._row] = {}
        elif tag == "td" and self._row is not None and "data-value" in a:
            for css in a.get("class", "").split():
                self.rows[self._row][css] = a["data-value"]
        if "id" in a:
            self.ids[a["id"]] = a
        if tag == "rect" and "bar" in a.get("class", ""):
            self.bars.append(a)

    def value(self, key: str, name: str, cell: str = "value") -> float:
        return float(self.rows[(key, name)][cell])


class Tags(HTMLParser):
    """Every tag and attribute name of a document, as a browser's tokenizer sees them."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.names: set[str] = set()
        self.attributes: set[str] = set()
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.names.add(tag)
        self.attributes.update(k for k, _ in attrs)


def defaults(**env: str) -> Config:
    return load_config(None, env=env)


def test_numbers_match_the_database_and_the_status_verdict(dsn: str, queue: QueueDB) -> None:
    seed_queue(queue, ready=4, rejected=2, queued=3, expired=2)
    cfg = defaults(DERIVD_STATUS_MIN_FINISHED="5")
    snap = read_snapshot(queue, cfg, ())
    page = Cells(render(snap))

    rows = sql(dsn, "SELECT status, count(*) n FROM archive_files GROUP BY 1")
    counts = {r["status"]: r["n"] for r in rows}
    for status, n in counts.items():
        assert page.value("data-status", status, "n") == n
    assert page.value("data-status", "deleted", "n") == 0
    expired = sql(
        dsn,
        "SELECT count(*) n FROM archive_files WHERE status='processing' AND lease_until < now()",
    )[0]["n"]
    assert page.value("data-signal", "expired_leases") == expired == 2
    codes = sql(
        dsn,
        "SELECT error_code, count(*) n FROM archive_events WHERE kind IN ('rejected','exhausted') "
        "GROUP BY 1",
    )
    assert {c["error_code"]: c["n"] for c in codes} == {"corrupt_content": 2}
    assert page.value("data-code", "corrupt_content", "n") == 2
    # 6 finished in the window (4 ready, 2 rejected): a 33% rejected share, over 20%.
    assert page.value("data-signal", "recent_rejected_ratio") == pytest.approx(2 / 6)
    assert page.value("data-signal", "lease_lost") == 1
    assert snap.report is not None and evaluate(snap.report, cfg.status)  # as derivd status
    assert page.ids["verdict"]["class"].split()[-1] == "bad"
    # Jobs in flight: the processing rows, oldest lease first.
    processing = sql(
        dsn,
        "SELECT id, claimed_by FROM archive_files WHERE status='processing' ORDER BY lease_until",
    )
    holders = [(r["id"], r["claimed_by"]) for r in processing]
    assert [(j.id, j.holder) for j in snap.in_flight] == holders
    assert {h for _, h in holders} == {"seed-host-0", "seed-host-1"}
    for file_id, holder in holders:  # each row names the host holding it
        assert page.rows[("data-file", str(file_id))]["holder"] == holder
    assert float(page.ids["in-flight-total"]["data-value"]) == len(processing)
    # The hour: every finishing event of the seed, all in the current minute.
    finished = sql(
        dsn,
        "SELECT count(*) n FROM archive_events WHERE kind IN ('ready','rejected','exhausted') "
        "AND at >= now() - interval '1 hour'",
    )[0]["n"]
    assert float(page.ids["finished-hour"]["data-value"]) == finished == 6
    assert sum(int(b["data-finished"]) for b in page.bars) == finished
    assert all(b["data-median"] for b in page.bars)


def test_reads_are_cached_for_the_refresh_interval(dsn: str, queue: QueueDB) -> None:
    seed_queue(queue, ready=1, rejected=0, queued=1)
    # The page's own cache is under test: the readings shared through the database
    # ([status] max_age, real time) are turned off.
    cfg = defaults(DERIVD_METRICS_INTERVAL="10", DERIVD_STATUS_MAX_AGE="0")
    now = [1000.0]
    board = Dashboard(dsn, lambda: cfg, Metrics(), clock=lambda: now[0])
    first = board.snapshot()
    queue.enqueue([("originals/late", "v")])
    for _ in range(12):  # a dozen tabs within the interval: one read
        assert board.snapshot() is first
    assert board.reads == 1
    now[0] += 10.5
    later = board.snapshot()
    assert board.reads == 2
    assert later.report is not None and later.report.counts["queued"] == 2


def test_a_frozen_database_gets_the_last_view_with_its_age_and_one_reader(
    dsn: str, queue: QueueDB
) -> None:
    """Requests never wait on a slow read, nor start reads of their
    own: one reader at a time, the others get the last snapshot and how old it is.
    Once a wait has run out, requests answer at once from the last reading (they used to
    wait READ_WAIT_S each while the read stayed frozen), and a read that fails keeps the
    last view on the page, saying it is stale and why."""
    seed_queue(queue, ready=1, rejected=0, queued=1)
    cfg = defaults(DERIVD_METRICS_INTERVAL="10")
    now = [1000.0]
    proxy = PgProxy(dsn).start()
    try:
        board = Dashboard(proxy.dsn(dsn), lambda: cfg, Metrics(), clock=lambda: now[0])
        first = board.snapshot()
        assert first.report is not None and first.stale_s is None
        proxy.hang()
        now[0] += 30.0
        threads_before = threading.active_count()
        views = [board.snapshot() for _ in range(5)]
        page = board.route({}).body.decode()
        assert board.waits_run_out == 1  # the first request only; the rest at once
        assert board.reads == 2  # one read in flight, not six
        assert threading.active_count() <= threads_before + 2  # the reader and its bound
        assert all(v.report is first.report and v.stale_s == 30.0 for v in views)
        assert "this view is 30s old" in page
        # The frozen read gives up at its bound (10 s): the last view stays, with why.
        wait_for(lambda: board._reading is None, "the frozen read to give up")
        now[0] += 5.0  # within the interval of the read that failed: no new read
        failed = board.snapshot()
        assert board.reads == 2 and board.waits_run_out == 1
        assert failed.report is first.report and failed.stale_s == 35.0
        assert failed.error and "Traceback" not in failed.error
        now[0] += 10.0  # the next interval: a new read, answered at once from the last
        again = board.snapshot()
        assert board.waits_run_out == 1
        assert again.report is first.report and again.stale_s == 45.0
        wait_for(lambda: board.reads == 3, "the next interval's read started")
    finally:
        proxy.stop()


def test_database_down_says_cannot_tell(tmp_path: Any) -> None:
    cfg = defaults()
    board = Dashboard("postgresql://nobody@127.0.0.1:1/none", lambda: cfg, Metrics())
    response = board.route({})
    text = response.body.decode()
    assert response.status == 503
    assert 'id="verdict" class="verdict unknown"' in text
    assert "database unavailable" in text
    assert "Traceback" not in text


def test_this_host_is_named_as_the_registry_names_it() -> None:
    cfg = defaults().replace("supervisor", host_id="edge-7")
    board = Dashboard("postgresql://nobody@127.0.0.1:1/none", lambda: cfg, Metrics())
    snapshot = board._read(cfg)
    assert snapshot.host == "edge-7"
    assert [(h.host, h.this_host) for h in snapshot.hosts] == [("edge-7", True)]


def _report() -> Report:
    stats = QueueStats(counts={"ready": 3}, oldest_claimable_age_s=None, expired_leases=0)
    return Report(
        stats=stats, events={"ready": 3}, rejected_by_code={"<img src=x>": 1}, window_s=3600
    )


def test_everything_is_escaped() -> None:
    cfg = defaults()
    hostile = "<script>alert(1)</script>"
    snap = Snapshot(
        taken_at=0.0,
        host=hostile,
        refresh_s=5,
        job_timeout=60,
        limits=cfg.status,
        report=_report(),
        error=f"database error: {hostile}",
        hosts=(HostView(hostile, 1, True, 2, 1, None, True),),
    )
    text = render(snap)
    assert "<script" not in text and "<img" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "&lt;img src=x&gt;" in text
    # No external anything: no URL other than the SVG namespace.
    assert Tags(text).names.isdisjoint({"script", "img", "link", "iframe", "a", "object"})
    assert Tags(text).attributes.isdisjoint({"src", "href", "action", "onload", "onclick"})
    assert set(re.findall(r"https?://[^\"' ]+", text)) == {"http://www.w3.org/2000/svg"}


def test_chart_has_a_bar_per_minute_with_finishes() -> None:
    svg = chart([Minute(0, 5, 0.2), Minute(59, 1, None), Minute(10, 2, 1.5)], 0.0)
    bars = Cells(svg).bars
    assert sorted(int(b["data-minutes-ago"]) for b in bars) == [0, 10, 59]
    assert sum(int(b["data-finished"]) for b in bars) == 8
    assert svg.count("<polyline") == 1


# --------------------------------------------------------------------------- the endpoint


@pytest.fixture
def endpoint() -> Iterator[tuple[str, int]]:
    calls: list[str] = []

    def page(headers: Any) -> Response:
        calls.append("page")
        return Response(b"<!doctype html><p>hi</p>", "text/html; charset=utf-8")

    metrics = Metrics()
    metrics.serve("127.0.0.1:0", dashboard=page)
    assert metrics.address is not None
    yield metrics.address
    metrics.close()


def _request(address: tuple[str, int], method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(*address, timeout=10)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def test_the_dashboard_is_at_root_and_metrics_stay(endpoint: tuple[str, int]) -> None:
    status, headers, body = _request(endpoint, "GET", "/")
    assert (status, body) == (200, b"<!doctype html><p>hi</p>")
    assert headers["content-type"] == "text/html; charset=utf-8"
    assert "default-src 'none'" in headers["content-security-policy"]
    status, headers, body = _request(endpoint, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert b"derivd_workers_alive" in body


def test_query_strings_are_ignored_and_head_works(endpoint: tuple[str, int]) -> None:
    assert _request(endpoint, "GET", "/?refresh=1&x=<script>")[2] == b"<!doctype html><p>hi</p>"
    status, headers, body = _request(endpoint, "HEAD", "/")
    assert (status, body) == (200, b"")
    assert headers["content-length"] == str(len(b"<!doctype html><p>hi</p>"))
    status, _, body = _request(endpoint, "HEAD", "/metrics?name[]=x")
    assert (status, body) == (200, b"")


@pytest.mark.parametrize(
    "path", ["/nope", "/index.html", "//evil.example/", "/../etc/passwd", "/metrics/x"]
)
def test_other_paths_are_a_plain_404(endpoint: tuple[str, int], path: str) -> None:
    status, headers, body = _request(endpoint, "GET", path)
    assert (status, body) == (404, b"not found\n")
    assert headers["content-type"].startswith("text/plain")


def test_a_failing_page_is_a_plain_500_without_traceback() -> None:
    def broken(headers: Any) -> Response:
        raise RuntimeError("secret detail /etc/derivd.ini")

    metrics = Metrics()
    metrics.serve("127.0.0.1:0", dashboard=broken)
    assert metrics.address is not None
    try:
        status, _, body = _request(metrics.address, "GET", "/")
    finally:
        metrics.close()
    assert status == 500
    assert b"Traceback" not in body and b"secret" not in body and b"RuntimeError" not in body


def test_hosts_come_from_the_registry_when_there_is_one() -> None:
    local = HostView("web-1", 41, True, 2, 1, None, True)
    assert registry_hosts([], local) == (local,)
    rows = [
        {"host": "web-1", "pid": 41, "alive": True, "workers": 2, "busy": 1,
         "heartbeat_age_s": 0.4},
        {"host": "web-2", "pid": 7, "alive": False, "workers": 4, "busy": 0,
         "heartbeat_age_s": 95.0},
    ]  # fmt: skip
    hosts = registry_hosts(rows, local)
    assert [(h.host, h.this_host, h.alive, h.idle) for h in hosts] == [
        ("web-1", True, True, 1),
        ("web-2", False, False, 0),
    ]
    page = Cells(
        render(
            Snapshot(
                taken_at=0.0,
                host="web-1",
                refresh_s=1,
                job_timeout=1,
                limits=defaults().status,
                report=None,
                hosts=hosts,
            )
        )
    )
    assert page.rows[("data-host", "web-2")]["workers"] == "4"
    assert page.rows[("data-host", "web-1")]["busy"] == "1"


def test_a_minutes_median_comes_from_its_latest_jobs_and_its_count_from_all(
    dsn: str, queue: QueueDB
) -> None:
    """The chart's query stays bounded on a busy hour: every event is counted, but only
    `sample` of each minute's latest jobs are looked up for the median duration."""
    ids = queue.enqueue([(f"originals/m{i}", "1") for i in range(5)])
    for file_id in ids:  # committed in this order: the last two are the latest
        job = claim_one(queue, lease_s=60, max_attempts=3)
        assert job is not None and job.id == file_id and commit_one(queue, job, [])
    took = {ids[0]: 100, ids[1]: 100, ids[2]: 100, ids[3]: 10, ids[4]: 20}
    for file_id, seconds in took.items():
        sql(
            dsn,
            "UPDATE archive_files SET claimed_at = (SELECT at FROM archive_events"
            " WHERE file_id = %s AND kind = 'ready') - make_interval(secs => %s) WHERE id = %s",
            (file_id, seconds, file_id),
        )
    (sampled,) = queue.finished_per_minute(cap=1000, sample=2)
    (every,) = queue.finished_per_minute(cap=1000, sample=1000)
    assert sampled["finished"] == every["finished"] == 5
    assert sampled["median_s"] == pytest.approx(15.0)  # of 10 s and 20 s
    assert every["median_s"] == pytest.approx(100.0)


def test_the_page_says_how_old_the_shared_reading_is() -> None:
    """The counts come from the fleet's shared reading, up to [status] max_age old: the
    page said nothing of it."""
    cfg = defaults()
    stats = QueueStats(counts={"ready": 3}, oldest_claimable_age_s=None, expired_leases=0,
                       age_s=12.0)  # fmt: skip
    report = Report(stats=stats, events={}, rejected_by_code={}, window_s=3600, events_age_s=4)
    snap = Snapshot(taken_at=0.0, host="h", refresh_s=5, job_timeout=60, limits=cfg.status,
                    report=report)  # fmt: skip
    text = render(snap)
    assert '<span class="muted" id="reading-age" data-value="12.000">counts read 12s ago' in text
