"""The prefork supervisor as a real process tree: `derivd -c <ini> run` in a subprocess,
fault-injection handlers from tests/support/faulthandlers.py, waits on the database and the
process table with a deadline (never a bare sleep where an event can be awaited)."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fixtures.cli import run_cli
from fixtures.daemon import DaemonRun, kinds, processing_rows
from helpers import alive, proc_title, wait_for

from derivd.osproc import Pidfile, sd_notify, watchdog_interval

# ----------------------------------------------------------------------------- tests


def test_jobs_run_and_sigterm_stops_cleanly(supervisor: Callable[..., DaemonRun]) -> None:
    sup = supervisor(supervisor={"workers": "2"}).start()
    ids = sup.enqueue("ok", "ok", "sleep 0.2")
    for file_id in ids:
        wait_for(lambda f=file_id: sup.status_is(f, "ready"), f"file {file_id} ready")
    parent_title = proc_title(sup.pid)
    assert parent_title == "derivd: supervisor (2 workers)"
    workers = wait_for(lambda: sup.ready_workers(2), "two ready workers")
    assert all(proc_title(p).startswith("derivd: worker ") for p in workers)
    assert {proc_title(p).split()[2] for p in workers} == {"1", "2"}  # slots
    sup.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert sup.wait_exit() == 0
    assert not any(alive(p) for p in workers)


# A lease no wait of these tests comes near: a job that is back before it ended was
# returned by its supervisor, not reclaimed after its lease.
LONG_LEASE = {"lease": "600"}


def died_events(dsn: str, file_id: int) -> list[tuple[int, Any]]:
    """(attempt, lease token) of each `worker_died` event of the file."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT attempt, lease_token FROM archive_events"
            " WHERE file_id = %s AND kind = 'worker_died' ORDER BY id",
            (file_id,),
        ).fetchall()
    return [(r[0], r[1]) for r in rows]


def claim_token(dsn: str, file_id: int) -> Any:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT lease_token FROM archive_files WHERE id = %s", (file_id,))
        return row.fetchone()[0]  # type: ignore[index]


@pytest.mark.pooler
def test_sigkill_worker_mid_job(supervisor: Callable[..., DaemonRun], tmp_path: Path) -> None:
    """The supervisor returns a dead worker's job at once, fenced by its
    token, the attempt counted, with one `worker_died` event; the lease (600 s) is never
    waited for."""
    sup = supervisor(queue=LONG_LEASE).start()
    marker = tmp_path / "marker"
    [file_id] = sup.enqueue(f"hang-once {marker}")
    victim = wait_for(lambda: sup.worker_on_job(file_id), "a worker on the job")
    # The title says "job N" from the job's start, before the handler runs: killed
    # there, attempt 1 never made the marker and attempt 2 would hang (and time out)
    # in its place. Kill once the handler is really hanging.
    wait_for(marker.exists, "the handler to hang")
    token = claim_token(sup.dsn, file_id)
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    replacement = wait_for(
        lambda: [p for p in (sup.ready_workers() or []) if p != victim], "a replacement worker"
    )[0]
    latency = time.monotonic() - killed_at
    print(f"restart latency (SIGKILL -> replacement ready): {latency * 1000:.0f} ms")
    (tmp_path / "restart_latency_ms").write_text(f"{latency * 1000:.0f}\n")
    assert replacement != victim
    died = wait_for(lambda: died_events(sup.dsn, file_id), "the worker_died event", detail=sup.log)
    assert died == [(1, token)]
    row = wait_for(lambda: sup.status_is(file_id, "ready"), "the job to end ready")
    assert row["attempts"] == 2  # the dead worker's attempt counted
    kinds = [kind for kind, _, _ in sup.events(file_id)]
    assert kinds == ["worker_died", "retry", "ready"]  # returned, not timed out nor lost
    assert died_events(sup.dsn, file_id) == [(1, token)]
    assert "worker died" in sup.log()
    shown = run_cli("-c", str(sup.ini), "show", str(file_id))
    assert shown.returncode == 0 and "worker_died" in shown.stdout, shown.stdout + shown.stderr


@pytest.mark.pooler
def test_sigkill_on_the_last_attempt_rejects_at_once(
    supervisor: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    sup = supervisor(queue={**LONG_LEASE, "max_attempts": "1"}).start()
    marker = tmp_path / "marker"
    [file_id] = sup.enqueue(f"hang-once {marker}")
    victim = wait_for(lambda: sup.worker_on_job(file_id), "a worker on the job")
    wait_for(marker.exists, "the handler to hang")
    os.kill(victim, signal.SIGKILL)
    row = wait_for(lambda: sup.status_is(file_id, "rejected"), "the row rejected", detail=sup.log)
    assert row["error_code"] == "attempts_exhausted"
    assert row["attempts"] == 1
    assert [(k, a) for k, a, _ in sup.events(file_id)] == [("worker_died", 1), ("rejected", 1)]
    assert processing_rows(sup.dsn) == 0


@pytest.mark.pooler
def test_hanging_job_times_out_then_rejected(supervisor: Callable[..., DaemonRun]) -> None:
    # A 30 s lease: if the supervisor did not record the timeout itself the row would
    # stay `processing` far past the test's deadlines.
    sup = supervisor(
        queue={"lease": "30", "max_attempts": "2", "retry_base": "2", "retry_max": "2"},
        supervisor={"job_timeout": "1", "kill_grace": "0.5"},
    ).start()
    [file_id] = sup.enqueue("hang")
    first = wait_for(lambda: sup.worker_on_job(file_id), "a worker on the job")
    row = wait_for(lambda: sup.status_is(file_id, "queued"), "attempt 1 recorded", timeout=20)
    assert row["attempts"] == 1
    events = sup.events(file_id)
    timeouts = [at for kind, attempt, at in events if kind == "timeout" and attempt == 1]
    assert len(timeouts) == 1
    # Backoff without jitter: available 2 s after the failure was recorded.
    assert (row["available_at"] - timeouts[0]).total_seconds() == pytest.approx(2.0, abs=0.01)
    wait_for(lambda: not alive(first), "the hung worker to be gone")
    row = wait_for(lambda: sup.status_is(file_id, "rejected"), "rejection", timeout=30)
    assert row["error_code"] == "resource_limit"
    assert row["attempts"] == 2
    assert [k for k, _, _ in sup.events(file_id)].count("timeout") == 2
    # The supervisor is still up and keeps a worker.
    assert sup.proc.poll() is None  # type: ignore[union-attr]
    wait_for(lambda: sup.ready_workers(1), "a worker after the timeouts")
    assert processing_rows(sup.dsn) == 0


@pytest.mark.pooler
def test_job_that_kills_its_worker_ends_exhausted(supervisor: Callable[..., DaemonRun]) -> None:
    # Each attempt crashes the worker; the parent respawns (with slot backoff) and gives
    # the job back counted each time: the second death rejects it, no lease expiring.
    sup = supervisor(
        queue={**LONG_LEASE, "max_attempts": "2"},
        supervisor={"job_timeout": "1.4", "kill_grace": "1"},
    ).start()
    [file_id] = sup.enqueue("kill")
    row = wait_for(lambda: sup.status_is(file_id, "rejected"), "the row to be rejected")
    assert row["error_code"] == "attempts_exhausted"
    assert row["attempts"] == 2
    assert [a for a, _ in died_events(sup.dsn, file_id)] == [1, 2]
    assert sup.log().count("worker died") == 2
    assert sup.proc.poll() is None  # type: ignore[union-attr]
    wait_for(lambda: sup.ready_workers(1), "a worker after the crashes")


def test_sigterm_lets_running_job_finish(supervisor: Callable[..., DaemonRun]) -> None:
    sup = supervisor(
        supervisor={"job_timeout": "10", "shutdown_grace": "20"}, queue={"lease": "30"}
    ).start()
    [file_id] = sup.enqueue("sleep 2")
    wait_for(lambda: sup.worker_on_job(file_id), "a worker on the job")
    sup.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert sup.wait_exit() == 0
    assert sup.row(file_id)["status"] == "ready"
    assert processing_rows(sup.dsn) == 0


@pytest.mark.pooler
def test_sigterm_past_grace_releases_job(supervisor: Callable[..., DaemonRun]) -> None:
    sup = supervisor(
        supervisor={"job_timeout": "20", "shutdown_grace": "0.5"}, queue={"lease": "60"}
    ).start()
    [file_id] = sup.enqueue("hang")
    wait_for(lambda: sup.worker_on_job(file_id), "a worker on the job")
    sup.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert sup.wait_exit() == 0
    row = sup.row(file_id)
    assert row["status"] == "queued"
    assert row["attempts"] == 0
    assert row["lease_token"] is None
    assert "released" in [k for k, _, _ in sup.events(file_id)]


def test_second_sigterm_escalates(supervisor: Callable[..., DaemonRun]) -> None:
    sup = supervisor(
        supervisor={"job_timeout": "20", "shutdown_grace": "60"}, queue={"lease": "60"}
    ).start()
    [file_id] = sup.enqueue("hang")
    wait_for(lambda: sup.worker_on_job(file_id), "a worker on the job")
    sup.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    wait_for(lambda: "stopping" in proc_title(sup.pid), "the supervisor to start stopping")
    sup.proc.send_signal(signal.SIGINT)  # type: ignore[union-attr]
    # Far below the 60 s grace: the second signal did not wait for it.
    assert sup.wait_exit(timeout=30) == 0
    assert sup.row(file_id)["status"] == "queued"


def test_sigkill_supervisor_takes_children_along(
    supervisor: Callable[..., DaemonRun],
) -> None:
    sup = supervisor(supervisor={"workers": "2"}).start()
    workers = wait_for(lambda: sup.ready_workers(2), "two ready workers")
    sup.proc.kill()  # type: ignore[union-attr]
    assert sup.wait_exit() == -signal.SIGKILL
    wait_for(lambda: not any(alive(p) for p in workers), "every worker to die", timeout=10)
    assert [p for p in workers if alive(p)] == []


def test_unreachable_database_stops_run_in_one_line(
    supervisor: Callable[..., DaemonRun],
) -> None:
    """The schema check at start meets it, before any worker is forked (a worker that
    cannot boot stops the supervisor too: test_unknown_handler_module_is_a_boot_error)."""
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sup = supervisor(
        database={"dsn": f"postgresql://derivd@127.0.0.1:{port}/nothing"},
        supervisor={"workers": "2"},
    ).start()
    code = sup.wait_exit()
    log = sup.log()
    assert code != 0
    lines = [line for line in log.splitlines() if line.startswith("derivd: ")]
    assert len(lines) == 1, log
    assert lines[0].startswith("derivd: database unavailable:"), lines
    assert "Traceback" not in log


def test_unknown_handler_module_is_a_boot_error(supervisor: Callable[..., DaemonRun]) -> None:
    sup = supervisor(derive={"backend": "faulthandlers:NoSuchHandler"}).start()
    assert sup.wait_exit() != 0
    log = sup.log()
    assert "derivd: worker could not start: cannot load handler" in log
    assert "Traceback" not in log


def test_memory_recycle(supervisor: Callable[..., DaemonRun]) -> None:
    sup = supervisor(supervisor={"max_worker_rss_mb": "150"}).start()
    first = wait_for(lambda: sup.ready_workers(1), "a ready worker")[0]
    [file_id] = sup.enqueue("alloc 250")
    wait_for(lambda: sup.status_is(file_id, "ready"), "the big job to end ready")
    wait_for(lambda: not alive(first), "the big worker to be recycled")
    second = wait_for(lambda: sup.ready_workers(1), "a fresh worker")[0]
    assert second != first
    # The log line may land after the replacement is ready: wait for it, do not race it.
    wait_for(
        lambda: "worker recycled" in sup.log() and "reason=rss" in sup.log(),
        "the recycle to be logged with its reason",
        detail=sup.log,
    )
    [small] = sup.enqueue("ok")
    wait_for(lambda: sup.status_is(small, "ready"), "the fresh worker to work")


def test_max_jobs_recycles_worker(supervisor: Callable[..., DaemonRun]) -> None:
    sup = supervisor(supervisor={"max_jobs_per_worker": "1"}).start()
    first = wait_for(lambda: sup.ready_workers(1), "a ready worker")[0]
    ids = sup.enqueue("ok", "ok", "ok")
    for file_id in ids:
        wait_for(lambda f=file_id: sup.status_is(f, "ready"), f"file {file_id} ready")
    wait_for(lambda: not alive(first), "the first worker to be recycled")
    wait_for(lambda: sup.log().count("reason=max_jobs") >= 2, "two recycles to be logged")
    assert [sup.row(i)["attempts"] for i in ids] == [1, 1, 1]  # a recycle burns no attempt
    assert first not in (sup.ready_workers(1) or [])


def test_burst_exits_when_drained(supervisor: Callable[..., DaemonRun]) -> None:
    sup = supervisor(supervisor={"workers": "2"})
    ids = sup.enqueue("ok", "sleep 0.3", "ok", "ok")
    sup.start("--burst")
    assert sup.wait_exit() == 0
    assert [sup.row(i)["status"] for i in ids] == ["ready"] * 4


@pytest.mark.pooler
def test_burst_waits_for_a_retry_due_soon_and_says_what_it_leaves(
    supervisor: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    """`run --burst` exited while a retry was due a moment later, and said nothing: the
    file stayed queued with no daemon to pick it up. Now it waits for retries due within
    BURST_RETRY_WAIT_S; one due later is named on the way out, with when."""
    soon = {"retry_base": "2", "retry_max": "2", "retry_jitter": "no"}
    sup = supervisor(supervisor={"workers": "1"}, queue=soon)
    (file_id,) = sup.enqueue(f"fail-once {tmp_path / 'soon'}")
    sup.start("--burst")
    assert sup.wait_exit() == 0, sup.log()
    row = sup.row(file_id)
    assert (row["status"], row["attempts"]) == ("ready", 2)
    assert "left " not in sup.log()

    later = {"retry_base": "3600", "retry_max": "3600", "retry_jitter": "no"}
    sup = supervisor(supervisor={"workers": "1"}, queue=later)
    (file_id,) = sup.enqueue(f"fail-once {tmp_path / 'later'}")
    sup.start("--burst")
    assert sup.wait_exit() == 0, sup.log()
    assert sup.row(file_id)["status"] == "queued"
    (line,) = [line for line in sup.log().splitlines() if line.startswith("derivd: left ")]
    assert re.fullmatch(
        r"derivd: left 1 queued row\(s\) waiting for a retry delay, the next due in "
        r"(59m\d\ds|1h00m) \(at \d\d:\d\d:\d\d\): run `derivd run --burst` again then, "
        r"or `derivd run`",
        line,
    ), line


def test_sighup_reloads_and_invalid_config_is_kept(
    supervisor: Callable[..., DaemonRun],
) -> None:
    sup = supervisor(supervisor={"workers": "1"}).start()
    old = wait_for(lambda: sup.ready_workers(1), "a ready worker")
    text = sup.ini.read_text()
    sup.ini.write_text(text.replace("workers = 1", "workers = 2"))
    sup.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    new = wait_for(
        lambda: (lambda ps: ps if len(ps) == 2 and not set(ps) & set(old) else None)(
            sup.ready_workers(2) or []
        ),
        "two new workers",
    )
    assert proc_title(sup.pid) == "derivd: supervisor (2 workers)"
    sup.ini.write_text(text.replace("workers = 1", "workers = -1"))
    sup.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    wait_for(lambda: "reload refused" in sup.log(), "the refusal in the log")
    assert sorted(sup.ready_workers(2) or []) == sorted(new)
    [file_id] = sup.enqueue("ok")
    wait_for(lambda: sup.status_is(file_id, "ready"), "work after the refused reload")


def test_supervisor_never_loads_libvips(
    supervisor: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    """The parent must not import pyvips: its memory map has no libvips while a child's
    (vips backend, after a job) does."""
    sup = supervisor(derive={"backend": "vips"}).start()
    worker = wait_for(lambda: sup.ready_workers(1), "a ready vips worker")[0]

    def maps(pid: int) -> str:
        return Path(f"/proc/{pid}/maps").read_text()

    assert "libvips" in maps(worker)
    assert "libvips" not in maps(sup.pid)


def test_pidfile_and_sd_notify(supervisor: Callable[..., DaemonRun], tmp_path: Path) -> None:
    notify = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(notify))
        server.settimeout(30)
        pidfile = tmp_path / "derivd.pid"
        sup = supervisor(supervisor={"pidfile": str(pidfile)})
        sup.start(env_extra={"NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": "400000"})
        messages: list[str] = []
        while not any("READY=1" in m for m in messages) or not any(
            "WATCHDOG=1" in m for m in messages
        ):
            messages.append(server.recv(4096).decode())
        assert pidfile.read_text().strip() == str(sup.pid)
        sup.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        assert sup.wait_exit() == 0
        while not any("STOPPING=1" in m for m in messages):
            messages.append(server.recv(4096).decode())
    assert any(m.startswith("READY=1") and f"MAINPID={sup.pid}" in m for m in messages)
    assert not pidfile.exists()


# ----------------------------------------------------------------------- unit pieces


def test_sd_notify_without_socket_is_a_no_op() -> None:
    assert sd_notify("READY=1", env={}) is False
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "2000000"}) == 1.0
    assert watchdog_interval({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}) is None


def test_pidfile_refuses_a_live_owner(tmp_path: Path) -> None:
    from derivd.osproc import PidfileError

    path = tmp_path / "x.pid"
    path.write_text(f"{os.getppid()}\n")  # a live process that is not us
    with pytest.raises(PidfileError, match="already running"):
        Pidfile(path).create()
    path.write_text("999999999\n")  # stale
    pidfile = Pidfile(path)
    pidfile.create()
    assert path.read_text().strip() == str(os.getpid())
    pidfile.remove()
    assert not path.exists()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


# ------------------------------------------------------------- claim_batch > 1

BATCH = {"queue": {"claim_batch": "5"}}


@pytest.mark.pooler
def test_batch_sigkill_worker_releases_unstarted_and_reclaims_running(
    supervisor: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    sup = supervisor(**BATCH).start()
    marker = tmp_path / "marker"
    first, *rest = sup.enqueue(f"hang-once {marker}", "ok", "ok")
    victim = wait_for(lambda: sup.worker_on_job(first), "a worker on the first job")
    wait_for(marker.exists, "the handler to hang")  # see test_sigkill_worker_mid_job
    os.kill(victim, signal.SIGKILL)
    for file_id in (first, *rest):
        wait_for(lambda f=file_id: sup.status_is(f, "ready"), f"file {file_id} ready")
    # The job that was running when the worker died burned its attempt (returned by the
    # supervisor, worker_died); the ones it held but had not started went back at once,
    # unburned.
    assert sup.row(first)["attempts"] == 2
    assert kinds(sup, first) == ["worker_died", "retry", "ready"]
    for file_id in rest:
        assert sup.row(file_id)["attempts"] == 1
        assert kinds(sup, file_id) == ["released", "ready"]
    assert "worker died" in sup.log()
    assert processing_rows(sup.dsn) == 0


@pytest.mark.pooler
def test_batch_timeout_fails_running_job_and_releases_the_rest(
    supervisor: Callable[..., DaemonRun],
) -> None:
    sup = supervisor(
        queue={"claim_batch": "5", "lease": "30", "retry_base": "30", "retry_max": "30"},
        supervisor={"job_timeout": "1", "kill_grace": "0.5"},
    ).start()
    hung, *rest = sup.enqueue("hang", "ok", "ok", "ok")
    wait_for(lambda: sup.worker_on_job(hung), "a worker on the hanging job")
    row = wait_for(lambda: sup.status_is(hung, "queued"), "the timeout recorded", timeout=20)
    assert row["attempts"] == 1 and row["lease_token"] is None
    assert sorted(kinds(sup, hung)) == ["retry", "timeout"]
    for file_id in rest:
        row = wait_for(lambda f=file_id: sup.status_is(f, "ready"), f"file {file_id} ready")
        assert row["attempts"] == 1  # released by the supervisor, not burned
        assert kinds(sup, file_id) == ["released", "ready"]
    assert "job timed out" in sup.log()


@pytest.mark.pooler
def test_batch_sigterm_releases_unstarted_jobs_at_once(
    supervisor: Callable[..., DaemonRun],
) -> None:
    sup = supervisor(
        queue={"claim_batch": "5", "lease": "30"},
        supervisor={"job_timeout": "10", "shutdown_grace": "20"},
    ).start()
    running, *rest = sup.enqueue("sleep 2", "ok", "ok", "ok")
    wait_for(lambda: sup.worker_on_job(running), "a worker on the first job")
    sup.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert sup.wait_exit() == 0
    assert sup.row(running)["status"] == "ready"
    for file_id in rest:
        row = sup.row(file_id)
        assert (row["status"], row["attempts"], row["lease_token"]) == ("queued", 0, None)
        assert kinds(sup, file_id) == ["released"]
    assert processing_rows(sup.dsn) == 0
