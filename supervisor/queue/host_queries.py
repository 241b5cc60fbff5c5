"""The supervisor's heartbeat and the host registry."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from datetime import datetime
from typing import Any

from derivd.queue.records import (
    HostInfo,
    Job,
)
from derivd.queue.statements import Statements
from derivd.storage.base import StoreName


def _held(job: Job) -> dict[str, Any]:
    """A held job as the heartbeat reads it: id and token, and the file a re-derivation
    serves (the proof of its commit is on the file: derivd_heartbeat)."""
    held: dict[str, Any] = {"id": job.id, "token": str(job.token)}
    if job.for_file != job.id:
        held["file"] = job.for_file
    return held


class HostQueries(Statements):
    """The supervisor's heartbeat and the host registry."""

    def heartbeat(
        self, host: HostInfo, jobs: Sequence[Job], *, renew: bool, lease_s: float
    ) -> set[int]:
        """Check (and with `renew`, extend) the leases of `jobs` and refresh the host's
        registry row, in one call (derivd_heartbeat). Returns the ids that are not lost: whose lease
        still holds, or whose attempt has just ended itself (committed, failed or
        released with its own token) before its worker could report it."""
        return self._host_seen(host, jobs, renew=renew, lease_s=lease_s)

    def host_holder(self, host: str) -> dict[str, Any] | None:
        """The registry row under `host` (pid, version, started_at, heartbeat_s,
        heartbeat_age_s, alive), None when there is none."""
        return self._one("host_holder", {"host": host})

    def record_store(self, store: StoreName) -> None:
        """Where the store is (derivd_store): the bucket results and webhooks name."""
        self._all("store_record", asdict(store))

    def record_variant_set(self, host: HostInfo) -> bool:
        """The registry learns `host`'s variant set (fenced on its run); False: no row."""
        return bool(self._all("host_variant_set", host.__dict__))

    def live_variant_sets(self) -> dict[str, str | None]:
        """host -> the variant set it derives (None: unknown), of every live host."""
        return {r["host"]: r["variant_set"] for r in self._all("live_variant_sets")}

    def register_host(
        self, host: HostInfo, *, replacing: Mapping[str, Any] | None = None
    ) -> HostInfo | None:
        """A supervisor starts: its registry row, idle and started now. It replaces only
        the row `replacing` (a host_holder answer) describes; with another row there (or
        one written since) nothing changes and None comes back. Else `host` with the
        start the registry recorded, the fence of its heartbeats and its clean stop."""
        seen = replacing or {}
        params = {
            **host.__dict__,
            "seen_pid": seen.get("pid"),
            "seen_started_at": seen.get("started_at"),
        }
        row = self._one("register_host", params)
        return None if row is None else replace(host, busy=0, started_at=row["started_at"])

    def _host_seen(
        self, host: HostInfo, jobs: Sequence[Job], *, renew: bool, lease_s: float
    ) -> set[int]:
        params = {
            **host.__dict__,
            "jobs": json.dumps([_held(j) for j in jobs]),
            "renew": renew,
            "lease_s": lease_s,
        }
        return {int(r["id"]) for r in self._all("heartbeat", params)}

    def deregister_host(self, host: str, pid: int, started_at: datetime | None = None) -> None:
        """A clean stop: the row of this pid (and, given, this start) only."""
        self._all("deregister_host", {"host": host, "pid": pid, "started_at": started_at})

    def prune_hosts(self, *, guard_s: float) -> list[str]:
        return [str(r["host"]) for r in self._all("prune_hosts", {"guard_s": guard_s})]

    def hosts(self) -> list[dict[str, Any]]:
        """The host registry, with `alive`, `heartbeat_age_s` and `in_flight` per host."""
        return self._all("hosts")

    def record_lease_lost(self, job: Job) -> bool:
        """A `lease_lost` event for an attempt the supervisor killed (none when the lease
        is this attempt's after all)."""
        params = {"id": job.id, "token": job.token, "attempt": job.attempt}
        return bool(self._all("record_lease_lost", params))

    def worker_died(self, job: Job, *, max_attempts: int, delay_s: float) -> str | None:
        """A dead worker's job, fenced: `worker_died` recorded, the attempt counted, back
        to `queued` after `delay_s` (`rejected` attempts_exhausted on its last attempt).
        Returns the row's new status, or None when the lease was lost already."""
        params = {
            "id": job.id,
            "token": job.token,
            "attempt": job.attempt,
            "max_attempts": max_attempts,
            "delay_s": delay_s,
        }
        row = self._one("worker_died", params)
        return None if row is None else str(row["status"])
