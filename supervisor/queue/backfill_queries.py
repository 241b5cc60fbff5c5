"""Backfill: pages of ready files, queued re-derivations, resumable runs."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from derivd.queue.statements import Statements


class BackfillQueries(Statements):
    """Backfill: pages of ready files, queued re-derivations, resumable runs."""

    def backfill_page(
        self, *, after: int, last: int, limit: int
    ) -> list[tuple[int, dict[str, str | None]]]:
        """Ready files with id in (after, last], in id order, with their variant sets."""
        rows = self._all("backfill_page", {"after": after, "last": last, "limit": limit})
        return [(int(r["id"]), dict(r["variants"])) for r in rows]

    def backfill_last_id(self) -> int:
        row = self._one("backfill_last_id")
        return int(row["last_id"]) if row else 0

    def backfill_queue(self, ids: Sequence[int], *, priority: int, run: int) -> list[int]:
        """Queue re-derivations of these ready files for backfill `run`; the files
        actually queued."""
        if not ids:
            return []
        params = {"ids": list(ids), "priority": priority, "run": run}
        rows = self._all("backfill_queue", params)
        return [int(r["id"]) for r in rows]

    def backfill_claimable(self) -> int:
        row = self._one("backfill_claimable")
        return int(row["n"]) if row else 0

    def backfill_run(self, target: str, configured: Mapping[str, str]) -> dict[str, Any]:
        """The unfinished run toward `target` (resumed), else a new one that aims at
        `configured` (its digest is `target`): the only set its re-derivations swap in."""
        row = self._one("backfill_resume", {"target": target})
        if row is None:
            params = {
                "target": target,
                "last_id": self.backfill_last_id(),
                "configured": json.dumps(dict(configured)),
            }
            row = self._one("backfill_start", params)
        assert row is not None  # INSERT … RETURNING always returns its row
        return row

    def backfill_advance(
        self, run_id: int, *, cursor: int, scanned: int, queued: int, done: bool
    ) -> None:
        params = {
            "id": run_id,
            "cursor": cursor,
            "scanned": scanned,
            "queued": queued,
            "done": done,
        }
        self._all("backfill_advance", params)

    def backfill_progress(self) -> dict[str, Any] | None:
        """The latest backfill run with `in_queue` (its re-derivations not done yet)."""
        return self._one("backfill_progress")
