"""The metrics without a scrape: one registry per `Metrics`, the duration buckets, a busy
port, the start-up line, and the Grafana dashboard asking only for what is exported.
Scraped over HTTP with a known workload: tests/acceptance/test_metrics.py."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
from fixtures.metrics import Samples, feed_workload

from derivd.config_checks import ConfigError
from derivd.ops.metrics import DURATION_BUCKETS, Metrics, listening_line

DASHBOARD = Path(__file__).resolve().parents[2] / "etc" / "grafana-dashboard.json"


def test_each_metrics_has_its_own_registry() -> None:
    first, second = Metrics(), Metrics()
    first.job_timed_out()
    assert Samples(first.render().decode()).value("derivd_job_timeouts_total") == 1
    assert Samples(second.render().decode()).value("derivd_job_timeouts_total") == 0


def test_a_busy_port_is_one_configuration_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as error:
            Metrics().serve(f"127.0.0.1:{port}", where="prod.ini")
    assert f"prod.ini: [metrics] listen: cannot listen on 127.0.0.1:{port}" in str(error.value)
    assert "\n" not in str(error.value)


def test_duration_buckets_span_milliseconds_to_minutes() -> None:
    assert DURATION_BUCKETS[0] <= 0.01 and DURATION_BUCKETS[-1] >= 120


def _dashboard_metric_names(dashboard: dict[str, object]) -> set[str]:
    text = json.dumps(dashboard)
    return set(re.findall(r"\b(derivd_[a-z_]+)", text))


def test_grafana_dashboard_only_queries_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    m = Metrics()
    feed_workload(m)
    exported = Samples(m.render().decode()).names() | {
        "derivd_queue_rows",
        "derivd_queue_oldest_claimable_age_seconds",
        "derivd_queue_expired_leases",
        "derivd_queue_rejected_ratio",
        "derivd_events_recent",
    }
    used = _dashboard_metric_names(dashboard)
    assert used, "the dashboard queries no derivd metric"
    assert used <= exported, f"unknown metrics in the dashboard: {sorted(used - exported)}"
    # Every signal of the issue has a panel.
    for needed in (
        "derivd_queue_rows",
        "derivd_queue_oldest_claimable_age_seconds",
        "derivd_queue_expired_leases",
        "derivd_queue_rejected_ratio",
        "derivd_jobs_finished_total",
        "derivd_job_duration_seconds_bucket",
        "derivd_queue_wait_seconds_bucket",
        "derivd_lease_lost_total",
        "derivd_job_timeouts_total",
        "derivd_worker_restarts_total",
        "derivd_workers_alive",
        "derivd_workers_busy",
    ):
        assert needed in used, needed
    variables = dashboard["templating"]["list"]  # type: ignore[index]
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in variables)


def test_the_start_up_line_names_the_bound_address() -> None:
    assert listening_line(("::1", 9464)) == (
        "dashboard: http://[::1]:9464/  metrics: http://[::1]:9464/metrics"
    )
    assert listening_line(None).startswith("dashboard and /metrics: off")
