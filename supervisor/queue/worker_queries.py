"""The lease protocol as a worker calls it: claim, write-ahead, fenced commit, fail, release."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from derivd.errors import ErrorCode
from derivd.queue.records import (
    Committed,
    Finished,
    Job,
)
from derivd.queue.statements import Statements
from derivd.storage.base import attempt_prefix_format


def _claim_params(
    limit: int,
    lease_s: float,
    max_attempts: int,
    host: str | None,
    tenant_cap: int,
    write_ahead: bool,
    key_prefix: str,
) -> dict[str, Any]:
    """The claim's named parameters, shared by `claim` and `commit_and_claim`."""
    return {
        "limit": limit,
        "lease_s": lease_s,
        "max_attempts": max_attempts,
        "host": host,
        "tenant_cap": tenant_cap,
        "prefix_format": attempt_prefix_format(key_prefix) if write_ahead else None,
    }


def _commit_row(finished: Finished) -> dict[str, Any]:
    job, variants, original = finished.job, finished.variants, finished.original
    primary = variants[0] if variants else None
    return {
        "id": job.id,
        "token": str(job.token),
        "attempt": job.attempt,
        "derived_key": primary.key if primary else None,
        "derived_version": primary.version if primary else None,
        "sha256": primary.sha256 if primary else None,
        "width": primary.width if primary else None,
        "height": primary.height if primary else None,
        "variants": [v.__dict__ for v in variants],
        # Absent keys are NULLs to the commit (derivd_commit_and_claim, sql/functions.sql).
        **({f"original_{k}": v for k, v in asdict(original).items()} if original else {}),
    }


def _committed(rows: list[dict[str, Any]]) -> Committed:
    """The commit's rows (`kind`: committed, rejected; others ignored) as Committed."""
    return Committed(
        (int(r["id"]) for r in rows if r["kind"] == "committed"),
        (int(r["id"]) for r in rows if r["kind"] == "rejected"),
    )


def _jobs(rows: list[dict[str, Any]]) -> list[Job]:
    """Claimed rows as jobs, in claim order (RETURNING has none)."""
    rows.sort(key=lambda r: (r["tier"], r["claimable_since"], r["id"]))
    return [
        Job(
            id=row["id"],
            token=row["lease_token"],
            attempt=row["attempts"],
            original_key=row["original_key"],
            original_version=row["original_version"],
            wait_s=max(0.0, row["wait_s"] or 0.0),
            file_id=row.get("file_id"),
        )
        for row in rows
    ]


# A claim waits at most this long, client-side (`bounded`: the socket is shut down),
# which holds through a pooler whose server froze; the worker then retries after
# [queue] poll_interval on a new connection. Nothing else bounds it: the supervisor's
# job_timeout starts with a job, and a claim is not one yet.
CLAIM_TIMEOUT_S = 10.0


class WorkerQueries(Statements):
    """The lease protocol as a worker calls it: claim, write-ahead, fenced commit, fail, release."""

    claim_bound_s: float | None = CLAIM_TIMEOUT_S  # None: unbounded (bench/bounds.py)

    def not_yet_due(self) -> tuple[int, float | None]:
        """(queued rows not due yet, counted to 10,000; seconds until the first is due,
        None when there is none): what a `run --burst` would leave behind."""
        row = self._one("not_yet_due") or {}
        return int(row.get("waiting") or 0), row.get("next_due_s")

    def claim_many(
        self,
        *,
        limit: int,
        lease_s: float,
        max_attempts: int,
        host: str | None = None,
        tenant_cap: int = 0,
        write_ahead: bool = True,
        key_prefix: str = "",
    ) -> list[Job]:
        """Lease up to `limit` rows in one statement, in claim order; each row gets its
        own token and lease, and records `host` as its holder. `tenant_cap`: at most that
        many rows in flight per tenant (0: no cap). `write_ahead`: register each attempt's
        key prefix (not flushed: `write_ahead_durable`); false for a worker that stores
        no objects. `key_prefix`: the store's (storage.base.attempt_prefix)."""
        params = _claim_params(
            limit, lease_s, max_attempts, host, tenant_cap, write_ahead, key_prefix
        )
        with self._lock:
            jobs = _jobs(self._all("claim", params, bound_s=self.claim_bound_s))
            self._unflushed.update(j.token for j in jobs)
        return jobs

    def write_ahead_durable(self, job: Job) -> bool:
        """Whether the claim's write-ahead prefix of `job` is flushed (see `claim` in
        sql/queries.sql): the PUTs may go without a `register_pending` of their own."""
        with self._lock:
            return job.token not in self._unflushed

    def _flushed(self) -> None:
        """A statement that wrote has ended with its WAL flushed (call under the lock)."""
        self._unflushed.clear()

    def register_pending(self, job: Job, keys: Sequence[str]) -> None:
        with self._lock:
            self._all("register_pending", {"id": job.id, "token": job.token, "keys": list(keys)})
            if keys:
                self._flushed()

    def commit_many(self, results: Sequence[Finished]) -> Committed:
        """Commit several attempts in one durable statement, each fenced on its own
        token, with its variants and analysis. Returns the ids that committed (and the
        re-derivations refused: `Committed.rejected`); every other one lost its lease
        (and got a `lease_lost` event)."""
        if not results:
            return Committed()
        jobs = json.dumps([_commit_row(f) for f in results])
        with self._lock:
            # Each row commits or records its outcome: the statement always writes.
            committed = _committed(self._all("commit", {"jobs": jobs}))
            self._flushed()
        return committed

    def commit_and_claim(
        self,
        results: Sequence[Finished],
        *,
        limit: int,
        lease_s: float,
        max_attempts: int,
        host: str | None = None,
        tenant_cap: int = 0,
        write_ahead: bool = True,
        key_prefix: str = "",
    ) -> tuple[Committed, list[Job]]:
        """`commit_many` and `claim_many` in one durable statement (one round trip, one
        transaction): the ids that committed, and the newly claimed jobs in claim order.
        Every fence is the same as in the two separate calls."""
        params = _claim_params(
            limit, lease_s, max_attempts, host, tenant_cap, write_ahead, key_prefix
        )
        params["jobs"] = json.dumps([_commit_row(f) for f in results])
        with self._lock:
            rows = self._all("commit_and_claim", params, bound_s=self.claim_bound_s)
            if results or rows:  # it wrote, and (durable) waited for its flush
                self._flushed()
        return _committed(rows), _jobs([r for r in rows if r["kind"] == "claimed"])

    def fail(
        self,
        job: Job,
        *,
        retry: bool,
        code: ErrorCode,
        max_attempts: int,
        delay_s: float = 0.0,
        extra_event: str | None = None,
    ) -> str | None:
        """Fenced failure. Returns the row's new status, or None when the lease was lost."""
        row = self._one(
            "fail",
            {
                "id": job.id,
                "token": job.token,
                "attempt": job.attempt,
                "retry": retry,
                "code": code,
                "max_attempts": max_attempts,
                "delay_s": delay_s,
                "extra_event": extra_event,
            },
        )
        return None if row is None else str(row["status"])

    def release(self, job: Job) -> bool:
        """Give the job back without burning its attempt. False: the lease was lost."""
        row = self._one("release", {"id": job.id, "token": job.token, "attempt": job.attempt})
        return bool(row and row["released"])
