"""The webhook outbox's statements (sql/queries.sql, "Webhooks"): the endpoints the
database knows, the lease protocol of deliveries, their views, replay and retention. Part
of QueueDB like every other query API."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from derivd.queue.statements import Statements

# The channel derivd_outbox notifies (sql/functions.sql) whenever it inserts deliveries.
DELIVERIES_CHANNEL: Final = "derivd_deliveries"


@dataclass(frozen=True)
class Delivery:
    """One claimed delivery. Its webhook-id was fixed when the event was written: the
    same on every attempt and replay, and no other database's."""

    id: int
    token: uuid.UUID
    attempt: int
    event: str
    file_id: int
    body: str
    age_s: float  # since the event (or its replay): the horizon's clock
    webhook_id: str
    probe: bool = False  # the one attempt of an open circuit


@dataclass(frozen=True)
class Finished:
    """What the fenced end of an attempt did: `kept` (False: the lease was lost), and
    whether the endpoint's circuit opened or closed now, and its pause (seconds)."""

    kept: bool
    opened: bool = False
    closed: bool = False
    pause_s: float | None = None


@dataclass(frozen=True)
class EndpointSync:
    """What a sync changed: endpoints removed now, added or changed, and the undelivered
    deliveries of removed endpoints it ended `failed`."""

    removed: list[str]
    changed: list[str]
    stranded: int


@dataclass(frozen=True)
class DeliveriesLeft:
    """One endpoint's undelivered deliveries (each status counted to 10,000), seconds
    until the first pending one is due, and until its circuit closes (None: closed)."""

    endpoint: str
    waiting: int
    next_due_s: float | None
    paused_s: float | None


@dataclass(frozen=True)
class Circuit:
    """When an endpoint backs off as a whole (fleet-wide): `threshold` failures in a row
    open it for `pause_base` seconds; each failed probe doubles that, to `pause_max`."""

    threshold: int = 5
    pause_base: float = 5.0
    pause_max: float = 60.0


class WebhookQueries(Statements):
    """The outbox's endpoints, the deliveries' lease protocol, their views, replay and
    retention."""

    def sync_webhook_endpoints(self, subscriptions: Sequence[dict[str, Any]]) -> EndpointSync:
        """Make the database's webhook endpoints these ({name, events, tenants}): the
        outbox's subscribers; every other one is removed and its undelivered rows end
        `failed` ("endpoint removed")."""
        row = self._one("webhook_endpoints_sync", {"endpoints": json.dumps(list(subscriptions))})
        if row is None:
            return EndpointSync([], [], 0)
        return EndpointSync(list(row["removed"]), list(row["changed"]), int(row["stranded"]))

    def webhook_endpoints(self) -> list[dict[str, Any]]:
        return self._all("webhook_endpoints")

    def claim_deliveries(
        self, endpoint: str, *, limit: int, lease_s: float, host: str
    ) -> list[Delivery]:
        params = {"endpoint": endpoint, "limit": limit, "lease_s": lease_s, "host": host}
        return [
            Delivery(
                id=r["id"],
                token=r["lease_token"],
                attempt=r["attempts"],
                event=r["event"],
                file_id=r["file_id"],
                body=r["body"],
                age_s=max(0.0, r["age_s"] or 0.0),
                webhook_id=r["webhook_id"],
                probe=r["probe"],
            )
            for r in self._all("deliveries_claim", params)
        ]

    def finish_delivery(
        self,
        delivery: Delivery,
        *,
        status: str,
        delay_s: float = 0.0,
        http_status: int | None = None,
        error: str | None = None,
        circuit: Circuit = Circuit(),
    ) -> Finished:
        """The fenced end of an attempt (not kept: the lease was lost, nothing changed)."""
        params = {
            "id": delivery.id,
            "token": delivery.token,
            "status": status,
            "delay_s": delay_s,
            "http_status": http_status,
            "error": error,
            "ok": status == "delivered",
            "threshold": circuit.threshold,
            "pause_base": circuit.pause_base,
            "pause_max": circuit.pause_max,
        }
        row = self._one("delivery_finish", params)
        if not row or not row["finished"]:
            return Finished(kept=False)
        return Finished(True, row["opened"], row["closed"], row["pause_s"])

    def close_circuit(self, endpoint: str) -> tuple[bool, bool]:
        """Close the endpoint's circuit (`webhooks resume`, a test answered 2xx): (the
        database knows the endpoint, its circuit was open: its backlog is due now)."""
        row = self._one("circuit_close", {"endpoint": endpoint})
        return (bool(row and row["found"]), bool(row and row["was_open"]))

    def webhook_stats(self, *, window_s: float) -> list[dict[str, Any]]:
        return self._all("webhook_stats", {"window_s": window_s})

    def replay_deliveries(
        self,
        *,
        endpoint: str | None = None,
        ids: Sequence[int] | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        failed_only: bool = False,
    ) -> int:
        params = {
            "endpoint": endpoint,
            "ids": list(ids) if ids is not None else None,
            "since": since,
            "until": until,
            "failed_only": failed_only,
        }
        row = self._one("deliveries_replay", params)
        return int(row["replayed"]) if row else 0

    def deliveries_due_within(self, endpoints: Sequence[str], *, within_s: float) -> bool:
        """Whether one of `endpoints` has a delivery leased, or one due within `within_s`
        seconds (its circuit closed by then): what `run --burst` waits for."""
        params = {"endpoints": list(endpoints), "within_s": within_s}
        row = self._one("deliveries_due_within", params)
        return bool(row and row["waiting"])

    def deliveries_left(self, endpoints: Sequence[str]) -> list[DeliveriesLeft]:
        """Per endpoint given: what `run --burst` leaves undelivered."""
        return [
            DeliveriesLeft(r["name"], r["waiting"], r["next_due_s"], r["paused_s"])
            for r in self._all("deliveries_left", {"endpoints": list(endpoints)})
        ]

    def add_test_delivery(self, endpoint: str, body: str) -> int:
        row = self._one("delivery_test", {"endpoint": endpoint, "body": body})
        assert row is not None
        return int(row["id"])

    def delivery(self, delivery_id: int) -> dict[str, Any] | None:
        return self._one("delivery_row", {"id": delivery_id})

    def purge_deliveries(self, *, older_than_days: int, limit: int = 1000) -> dict[str, int]:
        """Retention: finished deliveries of events past `older_than_days` (0: none)."""
        rows = self._all("deliveries_purge", {"days": older_than_days, "limit": limit})
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        return counts
