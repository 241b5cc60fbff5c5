"""`derivd backfill`: bring every ready file's variant set to the configured one.

The decisions are pure (`differences`, `Plan`); `scan` reads the ready files page by
page and `apply` queues re-derivations (docs/traffic.md): one job row per file that
differs, at a priority below live uploads, never more than `max_queued` of them
claimable, the cursor persisted after each page so a crash or Ctrl-C resumes where it
stopped, and the `backfill` lease (a row of derivd_leases: it holds through a pooler
and frees itself after a crash) so that only one `--apply` runs at a time.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from derivd.fingerprint import target_digest
from derivd.queue.db import QueueDB

LEASE_NAME = "backfill"
LEASE_TTL_S = 60.0  # renewed with every page and every wait for room
PAGE = 500
WAIT_S = 0.5  # between looks at the queue while --max-queued are claimable

Fingerprints = Mapping[str, str | None]  # `name.format` -> fingerprint (None: unknown)


class BackfillRunning(Exception):
    """Another `derivd backfill --apply` holds the lease."""


def fleet_problem(live: Mapping[str, str | None], target: str) -> str | None:
    """Why rolling out the set whose digest is `target` would fail now, or None: live
    hosts (host -> the set they derive, None: unknown, an earlier release) deriving
    another set reject every re-derivation their workers claim (a commit must hold
    exactly the configured set). No live host: None (the jobs wait for hosts)."""
    other = sorted(host for host, digest in live.items() if digest != target)
    if not other:
        return None
    named = ", ".join(other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
    return (
        f"live host(s) {named} derive another variant set than this configuration (or an "
        "unknown one): their workers would reject every re-derivation. Restart them with "
        "this configuration first, or pass --force"
    )


def differences(current: Fingerprints, configured: Mapping[str, str]) -> dict[str, str]:
    """For each variant slot that differs: `missing` (configured, not stored), `changed`
    (stored with another or no fingerprint) or `extra` (stored, not configured)."""
    found: dict[str, str] = {}
    for slot, wanted in configured.items():
        if slot not in current:
            found[slot] = "missing"
        elif current[slot] != wanted:
            found[slot] = "changed"
    for slot in current:
        if slot not in configured:
            found[slot] = "extra"
    return found


@dataclass
class Plan:
    """What a scan found: per variant slot, how many files miss it, have it changed or
    have it extra; how many files were scanned and how many differ (and were queued)."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    scanned: int = 0
    differing: int = 0
    queued: int = 0

    def add(self, diff: Mapping[str, str]) -> None:
        self.scanned += 1
        if diff:
            self.differing += 1
        for slot, kind in diff.items():
            per = self.counts.setdefault(slot, {"missing": 0, "changed": 0, "extra": 0})
            per[kind] += 1

    def lines(self, configured: Mapping[str, str]) -> list[str]:
        """The dry run's table: one line per slot, configured ones first."""
        slots = list(configured) + sorted(s for s in self.counts if s not in configured)
        rows = [f"{'variant':<24} {'missing':>9} {'changed':>9} {'extra':>9}"]
        for slot in slots:
            per = self.counts.get(slot, {})
            rows.append(
                f"{slot:<24} {per.get('missing', 0):>9} {per.get('changed', 0):>9} "
                f"{per.get('extra', 0):>9}"
            )
        rows.append(f"{self.scanned} ready file(s) scanned, {self.differing} to re-derive")
        return rows


def pages(
    queue: QueueDB, *, after: int, last: int, page: int = PAGE
) -> Iterator[list[tuple[int, dict[str, str | None]]]]:
    """Ready files with id in (after, last], a page at a time, in id order."""
    while True:
        rows = queue.backfill_page(after=after, last=last, limit=page)
        if not rows:
            return
        yield rows
        after = rows[-1][0]


def scan(queue: QueueDB, configured: Mapping[str, str], *, page: int = PAGE) -> Plan:
    """The dry run: count the differences, queue nothing."""
    plan = Plan()
    for rows in pages(queue, after=0, last=queue.backfill_last_id(), page=page):
        for _, current in rows:
            plan.add(differences(current, configured))
    return plan


@dataclass
class Apply:
    """One `--apply` run: where it goes and how it reports (`progress(cursor, last)`
    after each page: the file ids planned so far, of the run's range)."""

    queue: QueueDB
    configured: Mapping[str, str]
    priority: int
    max_queued: int
    page: int = PAGE
    progress: Callable[[int, int], None] = lambda cursor, last: None
    sleep: Callable[[float], None] = time.sleep
    holder: uuid.UUID = field(default_factory=uuid.uuid4)

    def run(self) -> Plan:
        """Queue the re-derivations; BackfillRunning when another run holds the lease.
        Returns this run's plan (a resumed run counts from where it resumed)."""
        if not self.queue.take_lease(LEASE_NAME, self.holder, ttl_s=LEASE_TTL_S):
            raise BackfillRunning("a backfill --apply is already running (this or another host)")
        try:
            return self._run()
        finally:
            self.queue.drop_lease(LEASE_NAME, self.holder)

    def _run(self) -> Plan:
        # A run resumes only toward the same configured set.
        run = self.queue.backfill_run(target_digest(self.configured), self.configured)
        plan = Plan()
        cursor, last = int(run["cursor"]), int(run["last_id"])
        self.progress(cursor, last)
        for rows in pages(self.queue, after=cursor, last=last, page=self.page):
            self._renew()
            todo = []
            for file_id, current in rows:
                diff = differences(current, self.configured)
                plan.add(diff)
                if diff:
                    todo.append(file_id)
            queued = self._queue_within_bound(todo, run=int(run["id"]))
            plan.queued += queued
            self.queue.backfill_advance(
                run["id"], cursor=rows[-1][0], scanned=len(rows), queued=queued, done=False
            )
            cursor = rows[-1][0]
            self.progress(cursor, last)
        self.queue.backfill_advance(run["id"], cursor=last, scanned=0, queued=0, done=True)
        self.progress(last, last)
        return plan

    def _queue_within_bound(self, ids: list[int], *, run: int) -> int:
        queued = 0
        while ids:
            room = self.max_queued - self.queue.backfill_claimable()
            if room <= 0:
                self.sleep(WAIT_S)
                self._renew()
                continue
            batch = self.queue.backfill_queue(ids[:room], priority=self.priority, run=run)
            queued += len(batch)
            ids = ids[room:]
        return queued

    def _renew(self) -> None:
        if not self.queue.take_lease(LEASE_NAME, self.holder, ttl_s=LEASE_TTL_S):
            raise BackfillRunning("the backfill lease was taken over by another run")


@dataclass(frozen=True)
class Progress:
    """The latest run as `derivd status` and the dashboard show it: how far its scan is
    (file ids planned through `cursor` of `last_id`), what it queued, how many of those
    are still in the queue (the rest are done: swapped in, or failed) and how many
    re-derivations are rejected (not files: `derivd retry --rejected` queues them again)."""

    run: int
    cursor: int
    last_id: int
    scanned: int
    queued: int
    in_queue: int
    finished: bool
    rejected: int = 0  # re-derivations rejected (their files keep their sets)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Progress:
        return cls(
            run=int(row["id"]),
            cursor=int(row["cursor"]),
            last_id=int(row["last_id"]),
            scanned=int(row["scanned"]),
            queued=int(row["queued"]),
            in_queue=int(row["in_queue"]),
            rejected=int(row.get("rejected") or 0),
            finished=row["finished_at"] is not None,
        )

    @property
    def planned(self) -> float:
        """Share of the run's file ids scanned (1.0 once the scan finished)."""
        if self.finished or self.last_id <= 0:
            return 1.0
        return min(1.0, self.cursor / self.last_id)

    @property
    def state(self) -> str:
        if not self.finished:
            return "scanning"
        return "re-deriving" if self.in_queue else "done"

    def as_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "state": self.state,
            "planned": round(self.planned, 4),
            "scanned": self.scanned,
            "queued": self.queued,
            "in_queue": self.in_queue,
            "rejected": self.rejected,
        }

    def line(self) -> str:
        return (
            f"backfill #{self.run}: {self.state}, {self.planned * 100:.0f}% scanned "
            f"({self.scanned:,} files), {self.queued:,} queued, {self.in_queue:,} in the queue"
            + (f", {self.rejected:,} rejected" if self.rejected else "")
        )
