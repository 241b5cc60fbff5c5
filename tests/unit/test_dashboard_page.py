"""The dashboard's page and its endpoint without a database: escaping, the chart, the hosts,
the age of the shared reading, and the endpoint's behaviour for other paths, query strings,
HEAD and a failing page. Its numbers against the database: tests/integration/test_dashboard.py."""

from __future__ import annotations

import http.client
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any

import pytest
from configs import defaults
from fixtures.pages import Cells

from derivd.ops.dashboard import Dashboard, registry_hosts
from derivd.ops.dashboard_page import chart, render
from derivd.ops.dashboard_view import HostView, Minute, Snapshot
from derivd.ops.health import Report
from derivd.ops.metrics import Metrics
from derivd.ops.web import Response
from derivd.queue.db import QueueStats


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
