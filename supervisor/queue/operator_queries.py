"""Producers and operators: enqueue, delete, retry, statuses, queue health, one file's
row, variants and events, and `derivd files`' pages."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from derivd.priorities import DEFAULT_PRIORITY
from derivd.queue.records import (
    EventWindow,
    QueueStats,
    StoredVariant,
)
from derivd.queue.statements import Statements
from derivd.storage.base import validate_key


class OperatorQueries(Statements):
    """Producers and operators: enqueue, delete, retry, statuses, queue health, one file's"""

    def enqueue(
        self,
        originals: Sequence[tuple[str, str | None]],
        *,
        priority: int = DEFAULT_PRIORITY,
        tenant: str | None = None,
        external_id: str | None = None,
        metadata: str | None = None,
    ) -> list[int]:
        """Queue stored originals given as (key, version id), at one priority and for
        one tenant, with one external id and metadata (JSON text). Returns the new ids.
        InvalidKey, and nothing queued, when a key is one the stores refuse."""
        if not originals:
            return []
        params = {
            "keys": [validate_key(key) for key, _ in originals],
            "versions": [version for _, version in originals],
            "priority": priority,
            "tenant": tenant,
            "external_id": external_id,
            "metadata": metadata,
        }
        return [r["id"] for r in self._all("enqueue", params)]

    def enqueue_write_ahead(self, keys: Sequence[str], token: uuid.UUID) -> None:
        """Register originals about to be uploaded (under `token`, never a lease) for the
        orphan sweep; `enqueue` of those keys clears them."""
        params = {"keys": [validate_key(key) for key in keys], "token": token}
        self._all("enqueue_write_ahead", params)

    def request_delete(self, ids: Sequence[int], *, actor: str) -> list[int]:
        return [r["id"] for r in self._all("request_delete", {"ids": list(ids), "actor": actor})]

    def statuses(self, ids: Sequence[int]) -> dict[int, str]:
        """The status of each id that exists; unknown ids are absent."""
        rows = self._all("file_statuses", {"ids": list(ids)})
        return {int(r["id"]): str(r["status"]) for r in rows}

    def operator_retry(
        self, *, ids: Sequence[int] | None, code: str | None, actor: str
    ) -> list[int]:
        params = {"ids": list(ids) if ids is not None else None, "code": code, "actor": actor}
        return [r["id"] for r in self._all("operator_retry", params)]

    def rederive_retry(self, *, code: str | None, actor: str) -> list[int]:
        """Queue rejected re-derivations again (of `code` only, when given); the files
        they serve."""
        rows = self._all("rederive_retry", {"code": code, "actor": actor})
        return [int(r["id"]) for r in rows]

    def queue_stats(self, *, max_age_s: float = 0.0) -> QueueStats:
        """Queue health; a result another host computed less than `max_age_s` ago is
        reused (0: compute now)."""
        row = self._one("queue_stats", {"max_age_s": max_age_s}) or {}
        payload: dict[str, Any] = row.get("payload") or {}
        return QueueStats(
            counts={str(k): int(v) for k, v in (payload.get("counts") or {}).items()},
            oldest_claimable_age_s=payload.get("oldest_claimable_age_s"),
            expired_leases=int(payload.get("expired_leases") or 0),
            estimated=tuple(str(s) for s in payload.get("estimated") or ()),
            age_s=float(payload.get("age_s") or 0.0),
        )

    def event_window(self, *, window_s: float, max_age_s: float = 0.0) -> EventWindow:
        """The last `window_s` seconds of events; a result another host (or probe)
        computed less than `max_age_s` ago is reused (0: compute now)."""
        row = self._one("event_window", {"window_s": window_s, "max_age_s": max_age_s}) or {}
        payload: dict[str, Any] = row.get("payload") or {}
        return EventWindow(
            events={str(k): int(v) for k, v in (payload.get("events") or {}).items()},
            rejected_by_code={
                str(k): int(v) for k, v in (payload.get("rejected_by_code") or {}).items()
            },
            age_s=float(payload.get("age_s") or 0.0),
        )

    def file_row(self, file_id: int) -> dict[str, Any] | None:
        return self._one("file_row", {"id": file_id})

    def file_variants(self, file_id: int) -> list[StoredVariant]:
        return [StoredVariant(**r) for r in self._all("file_variants", {"id": file_id})]

    def file_events(self, file_id: int) -> list[dict[str, Any]]:
        """The file's events (at, kind, attempt, error_code, actor, lease_token), oldest
        first."""
        return self._all("file_events", {"id": file_id})

    def files_page(
        self,
        *,
        status: str | None = None,
        code: str | None = None,
        tenant: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        before: int | None = None,
        limit: int = 50,
    ) -> list[dict[str, Any]]:
        """`derivd files`: files newest first, filtered; `before`: the last id of the
        page before (keyset paging)."""
        params = {"status": status, "code": code, "tenant": tenant, "since": since,
                  "until": until, "before": before, "limit": limit}  # fmt: skip
        return self._all("files_page", params)
