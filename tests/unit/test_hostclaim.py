"""Starting under a host_id (derivd.processes.hostclaim.decide): one live run per name."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from derivd.processes.hostclaim import Refuse, Register, Wait, decide

STARTED = datetime(2026, 12, 2, 14, 0, tzinfo=UTC)


def holder(**fields: Any) -> dict[str, Any]:
    row = {"pid": 70, "alive": True, "heartbeat_s": 10.0, "heartbeat_age_s": 4.0}
    return {"started_at": STARTED, "version": "0.1.0", **row, **fields}


def verdict(row: dict[str, Any] | None, *, alive: bool, waited: bool = False) -> object:
    return decide("web-1", row, my_pid=99, alive_here=lambda _pid: alive, waited=waited)


def test_no_row_or_a_stale_one_is_taken() -> None:
    assert verdict(None, alive=False) == Register(None)
    stale = holder(alive=False)
    assert verdict(stale, alive=True) == Register(stale)


def test_a_live_row_of_a_running_process_refuses() -> None:
    found = verdict(holder(), alive=True)
    assert isinstance(found, Refuse)
    assert found.message == (
        "host_id 'web-1' is in use by a live supervisor (pid 70, started 2026-12-02 "
        "14:00:00 UTC, last heartbeat 4s ago): stop it, or give this one another "
        "[supervisor] host_id"
    )


def test_a_live_row_of_a_dead_pid_is_waited_out_once() -> None:
    """kill -9, then a restart: the row is live for up to three heartbeats. A run on
    another machine keeps it live: after one wait that is a refusal."""
    assert verdict(holder(), alive=False) == Wait(3 * 10.0 - 4.0 + 0.5)
    assert isinstance(verdict(holder(), alive=False, waited=True), Refuse)


def test_a_row_of_this_very_pid_is_an_earlier_run() -> None:
    row = holder(pid=99)
    assert verdict(row, alive=True) == Register(row)
