"""Supervisors with a heartbeat, as real process trees: a job whose lease is
revoked is killed at the next heartbeat; with renewal a job may run past its lease."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fixtures.cli import derivd_command
from fixtures.daemon import FAST, DaemonRun
from fixtures.faketime import clock_env, find_libfaketime
from fixtures.pgproxy import PgProxy
from helpers import alive, sql, wait_for

from derivd.config_load import load_config
from derivd.ops.sweep import sweep_once
from derivd.queue.db import HostInfo, QueueDB

pytestmark = pytest.mark.acceptance

Fleet = Callable[..., DaemonRun]


@pytest.fixture
def fleet(tmp_path: Path, dsn: str, fs_root: Path) -> Iterator[Fleet]:
    """Supervisors on one database and one store, each with its own directory and
    `[supervisor] host_id` (the name given)."""
    made: list[DaemonRun] = []

    def make(name: str, *, home_name: str = "", **settings: dict[str, str]) -> DaemonRun:
        merged = {section: dict(values) for section, values in FAST.items()}
        for section, values in settings.items():
            merged.setdefault(section, {}).update(values)
        merged["supervisor"]["host_id"] = name
        home = tmp_path / (home_name or name)
        home.mkdir()
        sup = DaemonRun(home, dsn, fs_root, merged)
        made.append(sup)
        return sup

    make.dsn = dsn  # type: ignore[attr-defined]
    yield make
    for sup in made:
        workers = sup.workers() if sup.proc and sup.proc.poll() is None else []
        if sup.proc is not None and sup.proc.poll() is None:
            os.kill(sup.pid, signal.SIGCONT)
        sup.stop()
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def kinds(sup: DaemonRun, file_id: int) -> list[str]:
    return [kind for kind, _, _ in sup.events(file_id)]


HEARTBEAT_S, KILL_GRACE_S = 0.5, 1.0
# A deletion is seen by the first heartbeat after it (within one interval); the running
# job is killed (TERM, then KILL after kill_grace) and `lease_lost` recorded once it is
# reaped. The bound allows three more intervals, for a supervisor thread scheduled late
# on a loaded machine; job_timeout, the other way this job could end, is 20 s.
KILL_DUE_S = HEARTBEAT_S + KILL_GRACE_S + 3 * HEARTBEAT_S


def test_deleting_a_running_job_kills_it_at_the_next_heartbeat(fleet: Fleet) -> None:
    sup = fleet(
        "host-a",
        queue={"lease": "30", "heartbeat": str(HEARTBEAT_S)},
        supervisor={"job_timeout": "20", "kill_grace": str(KILL_GRACE_S), "workers": "1"},
    ).start()
    [file_id] = sup.enqueue("hang")
    victim = wait_for(lambda: sup.worker_on_job(file_id), "a worker on the job")
    with QueueDB.open(sup.dsn, role="test") as queue:
        assert queue.request_delete([file_id], actor="test") == [file_id]
    wait_for(lambda: not alive(victim), "the worker to be killed", detail=sup.log)
    wait_for(lambda: "lease_lost" in kinds(sup, file_id), "lease_lost recorded")
    (requested, _, deleted_at), (lost, _, lost_at) = sup.events(file_id)
    assert (requested, lost) == ("delete_requested", "lease_lost")
    # Both times are the database's: no test-side polling in the measure.
    seen_after = (lost_at - deleted_at).total_seconds()
    print(f"delete -> lease_lost recorded: {seen_after:.2f}s (heartbeat {HEARTBEAT_S} s)")
    assert seen_after <= KILL_DUE_S
    assert "job killed: lease lost" in sup.log()
    wait_for(lambda: [p for p in (sup.ready_workers() or []) if p != victim], "a replacement")
    row = sup.row(file_id)
    assert (row["status"], row["derived_key"]) == ("deleting", None)
    with QueueDB.open(sup.dsn, role="test") as queue:
        assert queue.file_variants(file_id) == []
    # The deletion completes in the next sweep: the original goes, nothing is left.
    config = load_config(sup.ini).replace("sweep", delete_guard=0.0)
    report = sweep_once(config, sup.dsn)
    assert report.error is None and report.deletions_completed == [file_id]
    assert sup.row(file_id)["status"] == "deleted"
    assert not [p for p in sup.fs_root.rglob("*") if p.is_file() and "derived" in p.parts]


def test_renewal_lets_a_job_run_four_times_its_lease(fleet: Fleet) -> None:
    sup = fleet(
        "host-a",
        queue={"lease": "3", "heartbeat": "0.5", "renew": "yes"},
        supervisor={"job_timeout": "30", "kill_grace": "1", "workers": "1"},
    ).start()
    [file_id] = sup.enqueue("sleep 12")
    row = wait_for(lambda: sup.status_is(file_id, "ready"), "the long job ready", timeout=90)
    assert row["attempts"] == 1
    assert kinds(sup, file_id) == ["ready"]
    assert "job killed: lease lost" not in sup.log()


def status_hosts(sup: DaemonRun) -> dict[str, dict[str, object]]:
    run = subprocess.run(
        [*derivd_command(), "-c", str(sup.ini), "status", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode in (0, 1), run.stderr
    return {h["host"]: h for h in json.loads(run.stdout)["hosts"]}


def test_status_lists_live_and_stale_hosts_and_a_clean_stop_deregisters(fleet: Fleet) -> None:
    fast = {"queue": {"heartbeat": "0.5"}, "supervisor": {"workers": "1"}}
    a, b = fleet("host-a", **fast).start(), fleet("host-b", **fast).start()

    def both() -> dict[str, dict[str, object]] | None:
        hosts = status_hosts(a)
        return hosts if len(hosts) == 2 else None

    def b_stale() -> dict[str, object] | None:
        host = status_hosts(a)["host-b"]
        return None if host["alive"] else host

    hosts = wait_for(both, "two hosts registered")
    assert hosts["host-a"]["pid"] == a.pid and hosts["host-b"]["pid"] == b.pid
    assert all(h["alive"] and h["workers"] == 1 for h in hosts.values())
    assert set(hosts["host-a"]) >= {"host", "pid", "alive", "workers", "busy", "heartbeat_age_s"}
    assert hosts["host-a"]["connections"] == 5  # 1 worker + supervisor (2) + sweep + listen
    b.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
    stale = wait_for(b_stale, "host-b stale (3 heartbeats missed)")
    assert float(stale["heartbeat_age_s"]) >= 1.5  # type: ignore[arg-type]
    table = subprocess.run(
        [*derivd_command(), "-c", str(a.ini), "status"], capture_output=True, text=True, timeout=60
    ).stdout
    assert re.search(r"host-a\s+\d+\s+alive", table) and re.search(r"host-b\s+\d+\s+STALE", table)
    a.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert a.wait_exit() == 0
    assert "host-a" not in status_hosts(a)  # deregistered; host-b stays until pruned


def test_a_second_supervisor_under_a_live_host_id_refuses_to_start(fleet: Fleet) -> None:
    """A second `derivd run` with the same host_id started silently, shared the registry
    row, and its clean stop deleted the row of the one still running. Now it refuses
    (exit 2, one line) while that row is live, and the first keeps its row."""
    fast = {"queue": {"heartbeat": "0.5"}}
    a = fleet("same", **fast).start()
    wait_for(lambda: status_hosts(a).get("same", {}).get("pid") == a.pid, "a registered")
    b = fleet("same", home_name="second", **fast).start()
    assert b.wait_exit() == 2, b.log()
    refusal = [line for line in b.log().splitlines() if line.startswith("derivd: ")]
    assert (
        refusal
        == [
            line
            for line in refusal
            if f"host_id 'same' is in use by a live supervisor (pid {a.pid}" in line
        ]
        and len(refusal) == 1
    ), b.log()
    assert "Traceback" not in b.log()
    row = status_hosts(a)["same"]
    assert row["pid"] == a.pid and row["alive"]
    a.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert a.wait_exit() == 0
    assert "same" not in status_hosts(a)


def test_a_clean_stop_deletes_only_its_own_run_of_the_row(dsn: str) -> None:
    """The fence of a clean stop and of the heartbeat: pid and start. A run whose row was
    taken over (it went stale, another run registered) neither refreshes nor deletes it."""
    with QueueDB.open(dsn, role="test") as queue:
        old = queue.register_host(HostInfo("h", 100, "v", "noop", 1, 0, 10.0))
        assert old is not None and old.started_at is not None
        sql(dsn, "UPDATE derivd_hosts SET last_heartbeat = now() - interval '31 seconds'")
        holder = queue.host_holder("h")
        assert holder is not None and not holder["alive"]
        assert queue.register_host(HostInfo("h", 100, "v", "noop", 1, 0, 10.0)) is None
        new = queue.register_host(HostInfo("h", 100, "v", "noop", 2, 0, 10.0), replacing=holder)
        assert new is not None and new.started_at != old.started_at
        queue.heartbeat(replace(old, busy=1), [], renew=False, lease_s=10.0)
        queue.deregister_host(old.host, old.pid, old.started_at)
        [row] = queue.hosts()
        assert (row["pid"], row["workers"], row["busy"]) == (100, 2, 0)
        queue.deregister_host(new.host, new.pid, new.started_at)
        assert queue.hosts() == []


def logged(sup: DaemonRun, message: str, *, after: float) -> list[dict[str, Any]]:
    """The supervisor's JSON log records of `message` stamped at or after `after`."""
    found = []
    for line in sup.log().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("msg") == message and record["ts"] >= after - 0.001:
                found.append(record)
    return found


@pytest.mark.parametrize("outage", ["hang", "refuse"])
def test_the_loop_never_waits_on_the_database(fleet: Fleet, dsn: str, outage: str) -> None:
    """With the database hanging (accepts, never answers) or refusing: a SIGKILLed worker
    is replaced at once, a hung job is killed at job_timeout, work resumes when the
    database returns, and SIGTERM ends the supervisor within shutdown_grace + kill_grace."""
    proxy = PgProxy(dsn).start()
    try:
        _never_waits(fleet, proxy, outage)
    finally:
        proxy.stop()


def _never_waits(fleet: Fleet, proxy: PgProxy, outage: str) -> None:
    grace, kill_grace = 2.0, 0.5
    sup = fleet(
        "host-a",
        database={"dsn": proxy.dsn(fleet.dsn)},  # type: ignore[attr-defined]
        logging={"level": "debug", "format": "json"},
        queue={"lease": "30", "heartbeat": "0.5", "listen": "yes"},
        supervisor={
            "workers": "2",
            "job_timeout": "3",
            "kill_grace": str(kill_grace),
            "shutdown_grace": str(grace),
        },
    ).start()
    wait_for(lambda: sup.ready_workers(2), "two workers ready", detail=sup.log)
    [hung] = sup.enqueue("hang")
    on_job = wait_for(lambda: sup.worker_on_job(hung), "a worker on the hanging job")
    getattr(proxy, outage)()
    # A SIGKILLed worker is replaced at once, database or not.
    [idle] = [p for p in sup.workers() if p != on_job]
    killed_at = time.time()
    os.kill(idle, signal.SIGKILL)
    # Read from the supervisor's own log (a replacement that cannot reach the database
    # exits at once, too soon to be seen in the process table).
    spawned = wait_for(lambda: logged(sup, "worker spawned", after=killed_at), "a replacement")
    latency = spawned[0]["ts"] - killed_at
    print(f"{outage}: SIGKILL -> replacement forked in {latency * 1000:.0f} ms")
    # Measured 19-111 ms on 2 shared cores at load 10-20 (the target is 100 ms); a loop
    # that waited on the database would take seconds (connect_timeout, a hung statement).
    assert latency <= 0.5
    # The hung job's deadline is enforced while the database is still out.
    wait_for(lambda: not alive(on_job), "the hung job killed at job_timeout", detail=sup.log)
    assert proxy.mode == outage
    # The database returns: the timeout is recorded and new work is done, no restart.
    proxy.resume()
    wait_for(lambda: "timeout" in kinds(sup, hung), "the timeout recorded", detail=sup.log)
    [later] = sup.enqueue("ok")
    wait_for(lambda: sup.status_is(later, "ready"), "work after the outage", detail=sup.log)
    # Out again, SIGTERM: the stop is bounded by the graces, not by the database.
    wait_for(lambda: sup.ready_workers(2), "two workers ready again", detail=sup.log)
    getattr(proxy, outage)()
    stopped_at = time.time()
    sup.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    code = sup.wait_exit(timeout=60)
    took = time.time() - stopped_at
    [done] = logged(sup, "supervisor stopped", after=stopped_at)
    print(
        f"{outage}: SIGTERM -> stopped {done['ts'] - stopped_at:.2f}s, exit {code} after "
        f"{took:.2f}s (grace {grace} + {kill_grace})"
    )
    assert code == 0
    assert done["ts"] - stopped_at <= grace + kill_grace + 0.1
    # The process exit adds the interpreter's teardown: 0.2-0.5 s here, more when the
    # machine is loaded (the bound below only catches a stop that waits on the database).
    assert took <= grace + kill_grace + 3.0


LIBFAKETIME = find_libfaketime()


def kill_host(sup: DaemonRun) -> None:
    """Host death: the supervisor and every process under it, SIGKILLed together."""
    for pid in [sup.pid, *sup.workers()]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert sup.proc is not None
    sup.proc.wait()


def host_clocks(env: dict[str, str]) -> tuple[float, float]:
    """(time.time(), time.monotonic()) as a process started with `env` sees them."""
    run = subprocess.run(
        [sys.executable, "-c", "import time; print(time.time(), time.monotonic())"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    wall, monotonic = run.stdout.split()
    return float(wall), float(monotonic)


@pytest.mark.skipif(LIBFAKETIME is None, reason="libfaketime (Debian: faketime) absent")
@pytest.mark.parametrize("offset", ["-1h", "+1h"])
def test_a_host_clock_an_hour_off_changes_no_lease_decision(fleet: Fleet, offset: str) -> None:
    # The host's clocks are an hour off, with a monotonic clock a real host could have,
    # also on a machine up for less than an hour (see clock_env); the database's clock
    # is right.
    assert LIBFAKETIME is not None
    skew = clock_env(LIBFAKETIME, offset)
    wall, monotonic = host_clocks(skew)
    assert abs(abs(wall - time.time()) - 3600) < 60  # the fake clock works
    assert monotonic > 0
    fast = {
        "queue": {"lease": "3", "heartbeat": "0.5", "renew": "yes"},
        "supervisor": {"job_timeout": "20", "kill_grace": "1", "workers": "1"},
    }
    skewed = fleet("skewed", **fast).start(env_extra=skew)
    # Claims and renews: a job of 2.5 leases on the skewed host alone ends in one attempt.
    [long] = skewed.enqueue("sleep 7.5")
    wait_for(
        lambda: skewed.worker_on_job(long), "the skewed host on the long job", detail=skewed.log
    )
    for _ in range(3):  # the lease stays within one lease of the database's now()
        left = sql(
            skewed.dsn,
            "SELECT extract(epoch FROM lease_until - now())::float8 AS s FROM archive_files "
            "WHERE id = %s AND status = 'processing'",
            (long,),
        )
        assert not left or 0 < left[0]["s"] <= 3.0
        time.sleep(1.5)
    row = wait_for(
        lambda: skewed.status_is(long, "ready"), "the long job", timeout=90, detail=skewed.log
    )
    assert (row["attempts"], kinds(skewed, long)) == (1, ["ready"])
    # Reclaims: a correct host's job, left by its death, is taken over by the skewed
    # one after the lease (database time) and ends ready on its second attempt.
    frozen = [skewed.pid, *skewed.workers()]  # so that the correct host claims the job
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    right = fleet("right", **fast).start()
    try:
        [orphan] = right.enqueue(f"hang-once {right.tmp / 'marker'}")
        wait_for(lambda: right.worker_on_job(orphan), "the correct host on the job")
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    wait_for((right.tmp / "marker").exists, "the handler to hang")
    kill_host(right)
    row = wait_for(lambda: right.status_is(orphan, "ready"), "the job reclaimed", timeout=90)
    [holder] = sql(right.dsn, "SELECT claimed_by FROM archive_files WHERE id = %s", (orphan,))
    assert (row["attempts"], holder["claimed_by"]) == (2, "skewed")
    assert "job killed: lease lost" not in skewed.log()
