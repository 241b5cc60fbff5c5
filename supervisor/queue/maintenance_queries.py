"""The background duties and the sweep: exhausted rows, orphans, deletions, retired
variant sets, named leases, event partitions, purges."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import date

from derivd.queue.statements import Statements


class MaintenanceQueries(Statements):
    """The background duties and the sweep: exhausted rows, orphans, deletions, retired"""

    def reject_exhausted(self, *, max_attempts: int, limit: int = 100) -> list[int]:
        """Reject rows whose worker died on their last attempt (each with its event and
        its `file.rejected` webhooks: derivd_file_final)."""
        params = {"max_attempts": max_attempts, "limit": limit}
        return [int(r["id"]) for r in self._all("reject_exhausted", params)]

    def orphans_due(self, *, guard_s: float, limit: int = 500) -> list[str]:
        return [r["key"] for r in self._all("orphans_due", {"guard_s": guard_s, "limit": limit})]

    def forget_orphans(self, keys: Sequence[str]) -> None:
        self._all("forget_orphans", {"keys": list(keys)})

    def deletions_due(self, *, guard_s: float, limit: int = 100) -> list[tuple[int, str | None]]:
        """(id, original key) of deletions due; the key is None for a re-derivation's
        row, whose original is its file's."""
        rows = self._all("deletions_due", {"guard_s": guard_s, "limit": limit})
        return [(r["id"], r["original_key"]) for r in rows]

    def mark_deleted(self, file_id: int) -> bool:
        """The last step of a deletion (with its event and its `file.deleted` webhooks:
        derivd_file_final)."""
        row = self._one("mark_deleted", {"id": file_id})
        return bool(row and row["deleted"])

    def retired_due(self, *, guard_s: float, limit: int = 500) -> list[str]:
        """Keys of replaced variant sets retired longer than `guard_s` ago."""
        rows = self._all("retired_due", {"guard_s": guard_s, "limit": limit})
        return [str(r["key"]) for r in rows]

    def forget_retired(self, keys: Sequence[str]) -> None:
        self._all("forget_retired", {"keys": list(keys)})

    def take_lease(self, name: str, holder: uuid.UUID, *, ttl_s: float) -> bool:
        """Take or renew the cluster-wide lease `name` for `holder` (one statement, so it
        holds through a pooler); False while another holder's lease is unexpired."""
        params = {"name": name, "holder": holder, "ttl_s": ttl_s}
        return self._one("lease_take", params) is not None

    def drop_lease(self, name: str, holder: uuid.UUID) -> bool:
        """Give the lease back; False when it was not (or no longer) this holder's."""
        return bool(self._all("lease_drop", {"name": name, "holder": holder}))

    def create_event_partitions(self, days: int, *, first: date | None = None) -> list[str]:
        rows = self._ddl("event_partitions", {"first": first, "days": days})
        return [str(r["created"]) for r in rows]

    def rehome_default_events(self, *, older_than_days: int) -> list[str]:
        """Empty the DEFAULT partition into day partitions (rows older than
        `older_than_days` are dropped; 0: none). The partitions that received rows."""
        rows = self._ddl("rehome_default_events", {"days": older_than_days})
        return [str(r["part"]) for r in rows]

    def drop_event_partitions(self, *, older_than_days: int) -> list[str]:
        rows = self._ddl("drop_event_partitions", {"days": older_than_days})
        return [str(r["dropped"]) for r in rows]

    def default_events(self) -> bool:
        """Whether the DEFAULT partition holds events (see `rehome_default_events`)."""
        row = self._one("default_events")
        return bool(row and row["present"])

    def purge_deleted(self, *, older_than_days: int, limit: int = 1000) -> list[int]:
        rows = self._all("purge_deleted", {"days": older_than_days, "limit": limit})
        return [int(r["id"]) for r in rows]
