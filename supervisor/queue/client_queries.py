"""derivd.client: upload APIs, on the caller's own connection."""

from __future__ import annotations

import uuid
from typing import Any

from derivd.priorities import DEFAULT_PRIORITY
from derivd.queue.listener import FINISHED_CHANNEL
from derivd.queue.statements import Statements
from derivd.storage.base import validate_key


class ClientQueries(Statements):
    """derivd.client: upload APIs, on the caller's own connection."""

    def enqueue_one(
        self,
        key: str,
        version: str,
        *,
        priority: int = DEFAULT_PRIORITY,
        tenant: str | None = None,
        external_id: str | None = None,
        metadata: str | None = None,
    ) -> int:
        """One stored original (derivd.client.enqueue); InvalidKey as `enqueue`.
        `metadata`: JSON text."""
        params = {
            "key": validate_key(key),
            "version": version,
            "priority": priority,
            "tenant": tenant,
            "external_id": external_id,
            "metadata": metadata,
        }
        row = self._one("client_enqueue", params)
        assert row is not None  # INSERT … RETURNING always returns its row
        return int(row["id"])

    def app_context_problem(self, external_id: str | None, metadata: str | None) -> str | None:
        """What is wrong with this external id and metadata (JSON text), in one line;
        None: nothing (the rule is the database's: derivd_app_context_problem)."""
        row = self._one("app_context_problem", {"external_id": external_id, "metadata": metadata})
        return None if row is None else row["problem"]

    def delete_file(self, file_id: int, actor: str) -> str | None:
        """derivd.client.delete: the file's status after the deletion; None: unknown id."""
        row = self._one("client_delete", {"id": file_id, "actor": actor})
        return None if row is None else row["status"]

    def register_waiter(self, file_id: int, waiter: uuid.UUID, timeout_s: float) -> None:
        self._all("wait_register", {"id": file_id, "waiter": waiter, "timeout_s": timeout_s})

    def unregister_waiter(self, file_id: int, waiter: uuid.UUID) -> None:
        self._all("wait_unregister", {"id": file_id, "waiter": waiter})

    def forget_stale_waiters(self) -> int:
        """Remove the rows of waiters that died past their deadline; how many."""
        return len(self._all("forget_stale_waiters"))

    def listen_finished(self) -> None:
        self._on_channel("listen", FINISHED_CHANNEL)

    def unlisten_finished(self) -> None:
        self._on_channel("unlisten", FINISHED_CHANNEL)

    def status_of(self, file_id: int) -> str | None:
        """The row's status, or None when no row has this id."""
        row = self._one("client_status", {"id": file_id})
        return None if row is None else str(row["status"])

    def client_result(self, file_id: int) -> dict[str, Any] | None:
        """Status, error code and (for a ready row) every variant; None: unknown id."""
        return self._one("client_result", {"id": file_id})

    def similar_distances(
        self, file_id: int, max_distance: int, limit: int
    ) -> list[tuple[int, int]]:
        """Ids of the other ready files within `max_distance` bits of this file's dhash,
        nearest first, at most `limit` (none for an unknown id, too), each with its
        distance in bits."""
        params = {"id": file_id, "max": max_distance, "limit": limit}
        return [(int(r["id"]), int(r["distance"])) for r in self._all("similar_distances", params)]
