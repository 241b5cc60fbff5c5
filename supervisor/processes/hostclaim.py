"""Starting under a `[supervisor] host_id`: one live supervisor per name.

Two supervisors under one name would share a registry row (each heartbeat overwriting
the other's), claim under one `claimed_by`, and the first clean stop would delete the row
of the one still running. So a supervisor refuses to start (exit 2) while another run's
row under its name is live. The decision is `decide`, a pure function; `claim_host`
reads the row, applies it and registers, fenced on the row it read.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from derivd.logs import event
from derivd.osproc import pid_alive
from derivd.queue.db import HostInfo, QueueDB

log = logging.getLogger("derivd.supervisor")

STALE_HEARTBEATS = 3  # derivd_host_stale (sql/functions.sql): three missed intervals
_MARGIN_S = 0.5  # past the staleness, for the database's and this host's clocks to agree
_ATTEMPTS = 5  # reads and registrations raced by other starting runs: bounded


@dataclass(frozen=True)
class Register:
    """Register, replacing this row (None: there is none)."""

    replacing: Mapping[str, Any] | None


@dataclass(frozen=True)
class Wait:
    """Read the row again after this many seconds."""

    seconds: float


@dataclass(frozen=True)
class Refuse:
    message: str


def decide(
    host: str,
    holder: Mapping[str, Any] | None,
    *,
    my_pid: int,
    alive_here: Callable[[int], bool],
    waited: bool,
) -> Register | Wait | Refuse:
    """What a supervisor about to start under `host` does, given the registry's row
    under that name (a host_holder answer)."""
    if holder is None or not holder["alive"]:
        return Register(holder)  # none, or stale: its run is gone
    pid = int(holder["pid"])
    if pid == my_pid:
        return Register(holder)  # an earlier run in this very pid (a container's pid 1)
    if alive_here(pid) or waited:
        return Refuse(in_use(host, holder))
    # Its pid runs nothing here: this machine's earlier run, killed before its row went
    # stale, or a live run on another machine. Only the former's row goes stale.
    age = float(holder["heartbeat_age_s"])
    return Wait(max(0.0, STALE_HEARTBEATS * float(holder["heartbeat_s"]) - age) + _MARGIN_S)


def in_use(host: str, holder: Mapping[str, Any]) -> str:
    started = holder["started_at"].strftime("%Y-%m-%d %H:%M:%S %Z").strip()
    return (
        f"host_id {host!r} is in use by a live supervisor (pid {holder['pid']}, started "
        f"{started}, last heartbeat {float(holder['heartbeat_age_s']):.0f}s ago): stop it, "
        "or give this one another [supervisor] host_id"
    )


def claim_host(
    queue: QueueDB,
    info: HostInfo,
    *,
    alive_here: Callable[[int], bool] = pid_alive,
    sleep: Callable[[float], None] = time.sleep,
) -> HostInfo | str:
    """Register `info` under its name: the registered HostInfo (with its start, the
    fence of its heartbeats and clean stop), or the one line that refuses."""
    waited = False
    for _ in range(_ATTEMPTS):
        holder = queue.host_holder(info.host)
        decision = decide(
            info.host, holder, my_pid=os.getpid(), alive_here=alive_here, waited=waited
        )
        if isinstance(decision, Refuse):
            return decision.message
        if isinstance(decision, Wait):
            assert holder is not None
            event(
                log,
                "host_id held by a run not on this machine's process list; waiting for its "
                "row to go stale",
                logging.WARNING,
                host=info.host,
                pid=holder["pid"],
                wait_s=round(decision.seconds, 1),
            )
            sleep(decision.seconds)
            waited = True
            continue
        registered = queue.register_host(info, replacing=decision.replacing)
        if registered is not None:
            return registered
    holder = queue.host_holder(info.host)
    return in_use(info.host, holder) if holder else f"host_id {info.host!r}: could not register"
