"""The metrics endpoint, scraped over HTTP: a known workload in, exact numbers out.

The supervisor owns a `Metrics`; here one runs in-process and is fed the way the
supervisor feeds it (job results from children, fleet state, the queue stats of a real
database seeded through QueueDB). The last test scrapes a real `derivd run` supervisor.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fixtures.cli import derivd_command
from fixtures.metrics import Samples, feed_workload, scrape, seed_queue
from fixtures.s3 import free_port
from fixtures.work import claim_one
from helpers import stop_process
from PIL import Image

from derivd.ops.metrics import Metrics
from derivd.queue.db import QueueDB


@pytest.fixture
def metrics() -> Iterator[Metrics]:
    m = Metrics()
    m.serve("127.0.0.1:0")
    yield m
    m.close()


def url_of(metrics: Metrics) -> str:
    assert metrics.address is not None
    host, port = metrics.address
    return f"http://{host}:{port}/metrics"


def test_scrape_shows_the_exact_workload_and_queue_state(metrics: Metrics, dsn: str) -> None:
    with QueueDB.open(dsn) as queue:
        seeded = seed_queue(queue, ready=5, rejected=2, queued=3, expired=2)
        stats = queue.queue_stats()
        events = queue.event_window(window_s=3600).events
    feed_workload(metrics)
    metrics.set_queue(stats)
    metrics.set_event_counts(events)

    s = scrape(url_of(metrics))

    jobs = "derivd_jobs_finished_total"
    assert s.value(jobs, outcome="ready", code="none", backend="vips") == 3
    assert s.value(jobs, outcome="rejected", code="corrupt_content", backend="vips") == 1
    assert s.value(jobs, outcome="retry", code="processing_failed", backend="pillow") == 1
    assert s.value(jobs, outcome="lease_lost", code="none", backend="vips") == 1
    assert s.value("derivd_lease_lost_total") == 1
    assert s.value("derivd_job_timeouts_total") == 2
    assert s.value("derivd_worker_restarts_total", reason="crash") == 1
    assert s.value("derivd_worker_restarts_total", reason="recycle") == 2
    assert s.value("derivd_worker_restarts_total", reason="timeout") == 0
    assert s.value("derivd_workers_alive") == 4
    assert s.value("derivd_workers_busy") == 3

    ready = {"backend": "vips", "outcome": "ready"}
    duration = "derivd_job_duration_seconds"
    assert s.value(f"{duration}_bucket", le="0.1", **ready) == 0
    assert s.value(f"{duration}_bucket", le="0.25", **ready) == 1
    assert s.value(f"{duration}_bucket", le="0.5", **ready) == 2
    assert s.value(f"{duration}_bucket", le="2.5", **ready) == 2
    assert s.value(f"{duration}_bucket", le="5.0", **ready) == 3
    assert s.value(f"{duration}_count", **ready) == 3
    assert s.value(f"{duration}_sum", **ready) == pytest.approx(4.5)
    assert s.value(f"{duration}_bucket", le="120.0", backend="vips", outcome="lease_lost") == 1
    wait = "derivd_queue_wait_seconds"
    assert s.value(f"{wait}_count") == 6
    assert s.value(f"{wait}_bucket", le="0.01") == 2  # 0.004 and 0.0
    assert s.value(f"{wait}_bucket", le="30.0") == 5
    assert s.value(f"{wait}_bucket", le="60.0") == 6
    assert s.value(f"{wait}_sum") == pytest.approx(45.204)

    rows = "derivd_queue_rows"
    assert s.value(rows, status="ready") == seeded.ready == 5
    assert s.value(rows, status="rejected") == seeded.rejected == 2
    assert s.value(rows, status="queued") == seeded.queued == 3
    assert s.value(rows, status="processing") == seeded.expired == 2
    assert s.value(rows, status="pending") == 0 and s.value(rows, status="deleted") == 0
    assert s.value("derivd_queue_expired_leases") == 2
    assert s.value("derivd_queue_rejected_ratio") == pytest.approx(2 / 7)
    assert stats.oldest_claimable_age_s is not None and stats.oldest_claimable_age_s > 0
    assert s.value("derivd_queue_oldest_claimable_age_seconds") == stats.oldest_claimable_age_s
    assert s.value("derivd_queue_stats_updated_timestamp_seconds") > 0
    recent = "derivd_events_recent"
    assert s.value(recent, kind="lease_lost") == 1
    assert s.value(recent, kind="ready") == 5
    assert s.value(recent, kind="rejected") == 2
    assert s.value(recent, kind="timeout") == 0


def test_queue_gauges_follow_the_latest_stats(metrics: Metrics, dsn: str) -> None:
    with QueueDB.open(dsn) as queue:
        queue.enqueue([("originals/a", "1"), ("originals/b", "2")])
        metrics.set_queue(queue.queue_stats())
        assert scrape(url_of(metrics)).value("derivd_queue_rows", status="queued") == 2
        for _ in range(2):
            job = claim_one(queue, lease_s=60, max_attempts=3)
            assert job is not None
            queue.fail(job, retry=False, code="unsupported_content", max_attempts=3)
        metrics.set_queue(queue.queue_stats())
    s = scrape(url_of(metrics))
    # A status that emptied reads 0, not its last value; nothing claimable reads 0.
    assert s.value("derivd_queue_rows", status="queued") == 0
    assert s.value("derivd_queue_rows", status="rejected") == 2
    assert s.value("derivd_queue_oldest_claimable_age_seconds") == 0
    assert s.value("derivd_queue_rejected_ratio") == 1.0


# --------------------------------------------------------------------------- end to end


def _scrape_when(url: str, ready: Callable[[Samples], bool], what: str) -> Samples:
    """Scrape until `ready(samples)` (the supervisor refreshes its queue gauges on a
    timer); fail naming `what` at a generous liveness deadline."""
    deadline = time.monotonic() + 60
    while True:
        try:
            samples = scrape(url)
            if ready(samples):
                return samples
        except (OSError, KeyError):
            pass  # not listening yet, or the series does not exist yet
        if time.monotonic() > deadline:
            pytest.fail(f"the metrics endpoint never showed {what}")
        time.sleep(0.1)


@pytest.mark.acceptance
def test_running_supervisor_serves_its_metrics(
    run_cli: Callable[..., subprocess.CompletedProcess[str]], dsn: str, tmp_path: Path
) -> None:
    originals = tmp_path / "in"
    originals.mkdir()
    for n in range(3):
        Image.new("RGB", (64 + n, 48), (n * 60, 10, 200)).save(originals / f"{n}.png")
    (originals / "bad.jpg").write_text("not an image")
    listen = f"127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        "DERIVD_DATABASE_DSN": dsn,
        "DERIVD_STORAGE_BACKEND": "fs",
        "DERIVD_STORAGE_ROOT": str(tmp_path / "store"),
        "DERIVD_DERIVE_BACKEND": "pillow",
        "DERIVD_SUPERVISOR_WORKERS": "2",
        "DERIVD_QUEUE_POLL_INTERVAL": "0.2",
        "DERIVD_METRICS_LISTEN": listen,
        # The queue gauges come from a query every [metrics] interval (15 s by default):
        # the scrape below waits for the first one after the drain.
        "DERIVD_METRICS_INTERVAL": "0.5",
    }
    queued = run_cli("enqueue", str(originals), env=env)
    assert queued.returncode == 0, queued.stderr
    log = (tmp_path / "derivd.log").open("wb")
    proc = subprocess.Popen(
        [*derivd_command(), "run"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        url = f"http://{listen}/metrics"
        s = _scrape_when(
            url,
            lambda s: (
                s.value("derivd_queue_rows", status="ready") == 3
                and s.value("derivd_queue_rows", status="rejected") == 1
                and s.value("derivd_workers_alive") == 2
            ),
            "3 ready and 1 rejected rows with 2 workers alive",
        )
        jobs = "derivd_jobs_finished_total"
        assert s.value(jobs, outcome="ready", code="none", backend="pillow") == 3
        assert s.value(jobs, outcome="rejected", code="unsupported_content", backend="pillow") == 1
        assert s.value("derivd_job_duration_seconds_count", backend="pillow", outcome="ready") == 3
        assert s.value("derivd_queue_wait_seconds_count") == 4
        assert s.value("derivd_queue_rows", status="queued") == 0
        assert s.value("derivd_queue_rejected_ratio") == pytest.approx(0.25)
        assert s.value("derivd_lease_lost_total") == 0
        assert s.value("derivd_worker_restarts_total", reason="crash") == 0
    finally:
        code = stop_process(proc)
        log.close()
    assert code == 0, (tmp_path / "derivd.log").read_text()
    # One start-up line says where to look (the port is the one asked for).
    text = (tmp_path / "derivd.log").read_text()
    assert text.count(f"dashboard: http://{listen}/  metrics: http://{listen}/metrics") == 1
