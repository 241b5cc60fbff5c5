"""The dashboard at `/` of `[metrics] listen` against the database: its numbers (the same
signals and verdict as `derivd status`), its cache, a frozen database. The page and the
endpoint without a database: tests/unit/test_dashboard_page.py; in a browser:
tests/acceptance/test_dashboard_browser.py."""

from __future__ import annotations

import threading

import pytest
from configs import defaults
from fixtures.metrics import seed_queue
from fixtures.pages import Cells
from fixtures.pgproxy import PgProxy
from fixtures.work import claim_one, commit_one
from helpers import sql, wait_for

from derivd.ops.dashboard import Dashboard, read_snapshot
from derivd.ops.dashboard_page import render
from derivd.ops.health import evaluate
from derivd.ops.metrics import Metrics
from derivd.queue.db import QueueDB


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


# --------------------------------------------------------------------------- the endpoint


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
