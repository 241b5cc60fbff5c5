"""`derivd status` as operators and health checks run it: the real CLI on a real queue."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from configs import write_ini
from fixtures.metrics import seed_queue
from fixtures.s3 import free_port
from fixtures.work import claim_one
from helpers import sql

from derivd.ops.status import HEALTHY, UNAVAILABLE, UNHEALTHY
from derivd.queue.db import HostInfo, QueueDB

RunCli = Callable[..., subprocess.CompletedProcess[str]]

# Thresholds the seeded queue below stays within: the default ones, with the rejected
# share judged on it (it has fewer finished jobs than the default minimum).
LENIENT = {"DERIVD_STATUS_MIN_FINISHED": "1", "DERIVD_STATUS_MAX_REJECTED_RATIO": "0.5"}
# Tests that change the queue between two looks read it afresh each time.
FRESH = {"DERIVD_STATUS_MAX_AGE": "0"}


# A supervisor that is running (its registry row, fresh): the seeded queue has claimable
# work, which with no live host is unhealthy ([status] min_hosts).
RUNNING = HostInfo("web-1", 4242, "0.1.0", "vips", 2, 0, 10.0)


@pytest.fixture
def seeded_dsn(dsn: str) -> str:
    with QueueDB.open(dsn) as queue:
        seed_queue(queue, ready=6, rejected=2, queued=3, expired=2)
        queue.register_host(RUNNING)
    return dsn


def status(run_cli: RunCli, dsn: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_cli("status", *args, env={"DERIVD_DATABASE_DSN": dsn, **LENIENT, **env})


def test_json_reports_the_seeded_numbers(run_cli: RunCli, seeded_dsn: str) -> None:
    result = status(run_cli, seeded_dsn, "--json")
    assert result.returncode == HEALTHY, result.stderr
    data = json.loads(result.stdout)
    assert data["healthy"] is True and data["problems"] == []
    assert data["counts"] == {
        "queued": 3,
        "processing": 2,
        "ready": 6,
        "rejected": 2,
        "pending": 0,
        "deleting": 0,
        "deleted": 0,
    }
    assert data["expired_leases"] == 2
    assert data["rejected_ratio"] == pytest.approx(2 / 8)
    assert data["oldest_claimable_age_s"] > 0
    assert data["lease_lost"] == 1 and data["timeouts"] == 0
    assert data["recent_finished"] == 8
    assert data["recent_rejected_ratio"] == pytest.approx(2 / 8)
    assert data["rejected_by_code"] == {"corrupt_content": 2}
    assert data["window_s"] == 3600


@pytest.mark.parametrize(
    ("option", "signal", "env"),
    [
        (("--max-expired-leases", "0"), None, {}),  # 0 turns the check off
        (("--max-oldest-age", "0.001"), "oldest_claimable_age_s", {}),
        (
            ("--max-rejected-ratio", "0.2"),
            "recent_rejected_ratio",
            {"DERIVD_STATUS_FAIL_ON_REJECTED": "yes"},
        ),
    ],
)
def test_crossed_thresholds_exit_unhealthy(
    run_cli: RunCli,
    seeded_dsn: str,
    option: tuple[str, str],
    signal: str | None,
    env: dict[str, str],
) -> None:
    result = status(run_cli, seeded_dsn, "--json", *option, **env)
    data = json.loads(result.stdout)
    if signal is None:
        assert result.returncode == HEALTHY and data["healthy"] is True
    else:
        assert result.returncode == UNHEALTHY, result.stdout
        assert [p["signal"] for p in data["problems"]] == [signal]
        assert data["problems"][0]["hint"]


def test_expired_lease_threshold_from_the_config_file(
    run_cli: RunCli, seeded_dsn: str, tmp_path: Path
) -> None:
    ini = write_ini(tmp_path / "derivd.ini", {"status": {"max_expired_leases": "2"}})
    within = run_cli("-c", str(ini), "status", env={"DERIVD_DATABASE_DSN": seeded_dsn, **LENIENT})
    assert within.returncode == HEALTHY, within.stdout + within.stderr
    with QueueDB.open(seeded_dsn) as queue:
        # One more worker dies mid-job (its lease is already over). max_attempts=1 keeps
        # the claim off the expired rows, which claims would otherwise take first.
        job = claim_one(queue, lease_s=-1.0, max_attempts=1)
        assert job is not None and job.attempt == 1
    crossed = run_cli(
        "-c", str(ini), "status", env={"DERIVD_DATABASE_DSN": seeded_dsn, **LENIENT, **FRESH}
    )
    assert crossed.returncode == UNHEALTHY
    assert "UNHEALTHY expired_leases: 3 > 2" in crossed.stdout
    assert "raise [queue] lease" in crossed.stdout


def test_rejected_share_is_not_judged_on_a_few_jobs(run_cli: RunCli, seeded_dsn: str) -> None:
    # 2 of 8 rejected is over 20%, but 8 finished jobs are fewer than min_finished.
    result = run_cli(
        "status", "--json", "--max-rejected-ratio", "0.2", env={"DERIVD_DATABASE_DSN": seeded_dsn}
    )
    assert result.returncode == HEALTHY, result.stdout
    assert json.loads(result.stdout)["thresholds"]["min_finished"] == 20


def test_table_shows_every_signal(run_cli: RunCli, seeded_dsn: str) -> None:
    result = status(run_cli, seeded_dsn)
    assert result.returncode == HEALTHY, result.stderr
    out = result.stdout
    for line in (
        "  queued               3",
        "  ready                6",
        "  rejected             2",
    ):
        assert line in out, out
    assert "expired leases" in out and "lease lost 1" in out
    assert "rejected by code (last 1h00m): corrupt_content 2" in out
    assert "rejected share (all rows)        25.0%" in out
    assert out.rstrip().endswith("health: ok")


def test_watch_refreshes_and_keeps_the_last_verdict(run_cli: RunCli, seeded_dsn: str) -> None:
    result = status(run_cli, seeded_dsn, "--watch", "--json", "--interval", "0.1", "--count", "3")
    assert result.returncode == HEALTHY, result.stderr
    frames = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(frames) == 3 and all(f["counts"]["ready"] == 6 for f in frames)


def test_counts_and_recent_events_are_shared_for_max_age(run_cli: RunCli, seeded_dsn: str) -> None:
    """A health probe every few seconds reads what the last reader (a supervisor, another
    probe) computed less than `[status] max_age` ago; 0 computes each time."""
    first = json.loads(status(run_cli, seeded_dsn, "--json").stdout)
    with QueueDB.open(seeded_dsn) as queue:
        job = claim_one(queue, lease_s=60.0, max_attempts=3)
        assert job is not None
        assert queue.fail(job, retry=False, code="corrupt_content", max_attempts=3) == "rejected"
    cached = json.loads(status(run_cli, seeded_dsn, "--json").stdout)
    fresh = json.loads(status(run_cli, seeded_dsn, "--json", DERIVD_STATUS_MAX_AGE="0").stdout)
    assert cached["counts"] == first["counts"] and cached["events"] == first["events"]
    assert fresh["counts"]["rejected"] == first["counts"]["rejected"] + 1
    assert fresh["events"]["rejected"] == first["events"]["rejected"] + 1
    assert fresh["rejected_by_code"]["corrupt_content"] == 3


def test_a_shared_reading_says_how_old_it_is(run_cli: RunCli, seeded_dsn: str) -> None:
    """The counts another host computed up to [status] max_age ago were shown as if read
    now; now the table's first line and the JSON say how old they are."""
    now = json.loads(status(run_cli, seeded_dsn, "--json").stdout)
    assert now["reading_age_s"] == 0
    sql = "UPDATE derivd_stats_cache SET computed_at = now() - interval '12 seconds'"
    with psycopg.connect(seeded_dsn) as conn:
        conn.execute(sql)  # computed by "another host", 12 s ago
    shared = {"DERIVD_STATUS_MAX_AGE": "3600"}  # however slow this machine, reused
    aged = json.loads(status(run_cli, seeded_dsn, "--json", **shared).stdout)
    assert aged["reading_age_s"] >= 12, aged["reading_age_s"]
    assert aged["counts"] == now["counts"]
    table = status(run_cli, seeded_dsn, **shared).stdout.splitlines()[0]
    assert re.search(r"\(counts read \d+s ago by the fleet \(\[status\] max_age\)\)$", table)


def test_no_live_host_while_work_is_claimable_is_unhealthy(
    run_cli: RunCli, seeded_dsn: str
) -> None:
    with QueueDB.open(seeded_dsn) as queue:
        queue.deregister_host(RUNNING.host, RUNNING.pid)  # a clean stop
    table = status(run_cli, seeded_dsn)
    assert table.returncode == UNHEALTHY, table.stdout
    assert "hosts: none running" in table.stdout
    assert "no supervisor has run" not in table.stdout
    assert "UNHEALTHY live_hosts: 0 < 1 while work is claimable" in table.stdout
    data = json.loads(status(run_cli, seeded_dsn, "--json").stdout)
    assert [p["signal"] for p in data["problems"]] == ["live_hosts"]
    assert (data["live_hosts"], data["thresholds"]["min_hosts"]) == (0, 1)
    # 0 turns the check off, from the command line or the settings.
    assert status(run_cli, seeded_dsn, "--min-hosts", "0").returncode == HEALTHY
    assert status(run_cli, seeded_dsn, DERIVD_STATUS_MIN_HOSTS="0").returncode == HEALTHY


def test_a_stale_host_is_not_a_live_one(run_cli: RunCli, seeded_dsn: str) -> None:
    with psycopg.connect(seeded_dsn, autocommit=True) as conn:
        conn.execute("UPDATE derivd_hosts SET last_heartbeat = now() - interval '31 seconds'")
    result = status(run_cli, seeded_dsn, "--json")
    assert result.returncode == UNHEALTHY
    data = json.loads(result.stdout)
    assert [h["alive"] for h in data["hosts"]] == [False]
    assert [p["signal"] for p in data["problems"]] == ["live_hosts"]


def test_no_live_host_is_healthy_while_nothing_is_claimable(run_cli: RunCli, dsn: str) -> None:
    with QueueDB.open(dsn) as queue:
        seed_queue(queue, ready=2, rejected=0, queued=0)
    result = status(run_cli, dsn)
    assert result.returncode == HEALTHY, result.stdout
    assert "(judged while work is claimable)" in result.stdout


def test_unreachable_database_is_one_line_and_its_own_exit_status(run_cli: RunCli) -> None:
    dsn = f"host=127.0.0.1 port={free_port()} dbname=derivd user=derivd connect_timeout=3"
    result = run_cli("status", env={"DERIVD_DATABASE_DSN": dsn})
    assert result.returncode == UNAVAILABLE != UNHEALTHY
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("derivd: database unavailable"), lines


def test_database_without_schema_says_to_migrate(run_cli: RunCli, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE archive_files CASCADE")
    result = run_cli("status", env={"DERIVD_DATABASE_DSN": dsn})
    assert result.returncode == UNAVAILABLE
    assert (
        result.stderr.strip() == "derivd: the database has no derivd schema; run `derivd migrate`"
    )


def test_each_host_shows_its_connection_budget() -> None:
    from datetime import UTC, datetime

    from derivd.ops.status import _host_lines, host_json

    row = {
        "host": "web-1",
        "pid": 42,
        "alive": True,
        "workers": 8,
        "busy": 3,
        "heartbeat_age_s": 1.25,
        "in_flight": 3,
        "version": "0.1.0",
        "backend": "vips",
        "started_at": datetime(2026, 12, 1, tzinfo=UTC),
    }
    assert host_json(row)["connections"] == 12  # 8 workers + supervisor (2) + sweep + listen
    table = "\n".join(_host_lines([row]))
    assert "conns" in table
    assert table.splitlines()[2].split()[-1] == "12"


@pytest.mark.pooler
def test_a_pooled_listen_path_and_default_events_are_warned_of(
    run_cli: RunCli, dsn: str, direct_dsn: str
) -> None:
    """What degrades the fleet without making it unhealthy is
    shown, and the exit status stays 0."""
    with QueueDB.open(dsn) as queue:
        queue.conn.execute(
            "INSERT INTO archive_events (file_id, kind, at)"
            " VALUES (1, 'ready', now() + interval '20 days')"
        )
    result = status(run_cli, dsn)
    assert result.returncode == 0, result.stderr
    assert "WARNING archive_events_default holds events" in result.stdout
    pooled = (
        "WARNING wake-ups fall back to polling: [database] dsn goes through a connection pooler"
    )
    assert (pooled in result.stdout) == (dsn != direct_dsn)
    direct = status(run_cli, dsn, "--json", DERIVD_DATABASE_LISTEN_DSN=direct_dsn)
    assert not any("polling" in w for w in json.loads(direct.stdout)["warnings"])


def test_a_quarter_rejected_is_reported_beside_a_healthy_verdict(
    run_cli: RunCli, seeded_dsn: str
) -> None:
    """Users' bad uploads are not the service's health: 2 of 8 rejected, over the 20 %
    limit, is a notice (exit 0), unhealthy only with [status] fail_on_rejected."""
    limits = {"DERIVD_STATUS_MAX_REJECTED_RATIO": "0.2"}
    result = status(run_cli, seeded_dsn, "--json", **limits)
    assert result.returncode == HEALTHY, result.stdout
    data = json.loads(result.stdout)
    assert data["healthy"] is True and data["problems"] == []
    assert [n["signal"] for n in data["notices"]] == ["recent_rejected_ratio"]
    table = status(run_cli, seeded_dsn, **limits).stdout
    assert "NOTICE recent_rejected_ratio: 25.0% > 20.0%" in table and "health: ok" in table
    failing = status(run_cli, seeded_dsn, "--json", **limits, DERIVD_STATUS_FAIL_ON_REJECTED="yes")
    assert failing.returncode == UNHEALTHY
    assert [p["signal"] for p in json.loads(failing.stdout)["problems"]] == [
        "recent_rejected_ratio"
    ]


def test_a_dead_endpoint_with_a_backlog_is_unhealthy(run_cli: RunCli, seeded_dsn: str) -> None:
    """Its events waiting 20 minutes, its circuit open for 10: both past their limits."""
    sql(seeded_dsn, "INSERT INTO derivd_webhook_endpoints (name, events, failures, probes,"
                    " opened_at, paused_until, last_error, last_error_at) VALUES ('app',"
                    " '{file.ready}', 30, 9, now() - interval '10 minutes',"
                    " now() + interval '40 seconds', 'connection refused', now())")  # fmt: skip
    sql(seeded_dsn, "INSERT INTO derivd_deliveries (endpoint, event, file_id, body, created_at)"
                    " SELECT 'app', 'file.ready', id, '{}', now() - interval '20 minutes'"
                    " FROM archive_files WHERE status = 'ready'")  # fmt: skip
    result = status(run_cli, seeded_dsn, "--json")
    assert result.returncode == UNHEALTHY, result.stdout
    problems = json.loads(result.stdout)["problems"]
    assert [(p["signal"], p["endpoint"]) for p in problems] == [
        ("webhook_oldest_undelivered_age_s", "app"),
        ("webhook_circuit_open_s", "app"),
    ]
    table = status(run_cli, seeded_dsn).stdout
    assert re.search(r"UNHEALTHY webhook_circuit_open_s: app: 10m\d\ds > 5m00s", table), table
    assert "connection refused" in table
    off = {"DERIVD_STATUS_MAX_WEBHOOK_AGE": "0", "DERIVD_STATUS_MAX_WEBHOOK_OPEN": "0"}
    assert status(run_cli, seeded_dsn, **off).returncode == HEALTHY
