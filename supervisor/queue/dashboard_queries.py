"""The dashboard's views: rows in flight, finished per minute."""

from __future__ import annotations

from typing import Any

from derivd.queue.statements import Statements


class DashboardQueries(Statements):
    """The dashboard's views: rows in flight, finished per minute."""

    def in_flight(self, *, limit: int) -> list[dict[str, Any]]:
        """Processing rows (id, attempts, claimed_by, age_s, lease_left_s), oldest lease
        first."""
        return self._all("dashboard_in_flight", {"limit": limit})

    def finished_per_minute(self, *, cap: int, sample: int) -> list[dict[str, Any]]:
        """(minutes_ago, finished, median_s) over the last hour: counts from at most `cap`
        events, each minute's median duration from at most `sample` of its latest jobs."""
        return self._all("dashboard_minutes", {"cap": cap, "sample": sample})
