"""Supervisors with a heartbeat, as real process trees (issue 12): a job whose lease is
revoked is killed at the next heartbeat; with renewal a job may run past its lease."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fixtures.cli import derivd_command
from helpers import alive, wait_for
from test_supervisor import FAST, Supervisor

from derivd.config import load_config
from derivd.ops.sweep import sweep_once
from derivd.queue.db import QueueDB

pytestmark = pytest.mark.acceptance

Fleet = Callable[..., Supervisor]


@pytest.fixture
def fleet(tmp_path: Path, dsn: str, fs_root: Path) -> Iterator[Fleet]:
    """Supervisors on one database and one store, each with its own directory and
    `[supervisor] host_id` (the name given)."""
    made: list[Supervisor] = []

    def make(name: str, **settings: dict[str, str]) -> Supervisor:
        merged = {section: dict(values) for section, values in FAST.items()}
        for section, values in settings.items():
            merged.setdefault(section, {}).update(values)
        merged["supervisor"]["host_id"] = name
        home = tmp_path / name
        home.mkdir()
        sup = Supervisor(home, dsn, fs_root, merged)
        made.append(sup)
        return sup

    yield make
    for sup in made:
        workers = sup.workers() if sup.proc and sup.proc.poll() is None else []
        if sup.proc is not None and sup.proc.poll() is None:
            os.kill(sup.pid, signal.SIGCONT)
        sup.stop()
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def kinds(sup: Supervisor, file_id: int) -> list[str]:
    return [kind for kind, _, _ in sup.events(file_id)]


def test_deleting_a_running_job_kills_it_at_the_next_heartbeat(fleet: Fleet) -> None:
    # job_timeout far above the heartbeat: only the heartbeat can end this job early.
    sup = fleet(
        "host-a",
        queue={"lease": "30", "heartbeat": "0.5"},
        supervisor={"job_timeout": "20", "kill_grace": "1", "workers": "1"},
    ).start()
    [file_id] = sup.enqueue("hang")
    victim = wait_for(lambda: sup.worker_on_job(file_id), "a worker on the job")
    deleted_at = time.monotonic()
    with QueueDB.open(sup.dsn, role="test") as queue:
        assert queue.request_delete([file_id], actor="test") == [file_id]
    wait_for(lambda: not alive(victim), "the worker to be killed", detail=sup.log)
    killed_after = time.monotonic() - deleted_at
    print(f"delete -> worker gone: {killed_after:.2f}s (heartbeat 0.5 s, kill_grace 1 s)")
    assert killed_after < 20  # the heartbeat, not job_timeout, ended it
    wait_for(lambda: "lease_lost" in kinds(sup, file_id), "lease_lost recorded")
    assert kinds(sup, file_id) == ["delete_requested", "lease_lost"]
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


def status_hosts(sup: Supervisor) -> dict[str, dict[str, object]]:
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
