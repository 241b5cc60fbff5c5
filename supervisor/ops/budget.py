"""How many database connections a host holds, by role (docs/operating.md, "Running many hosts").

`derivd status` shows it per host; the same formula sizes PostgreSQL's
`max_connections` (no pooler) or PgBouncer's `max_client_conn` (with one).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConnectionBudget:
    workers: int  # one `dsn` connection per worker, held for the worker's life
    supervisor: int  # two `dsn` connections: its lease lane (heartbeat) and maintenance
    sweep: int  # one `dsn` connection while a sweep pass runs
    listen: int  # one session on `listen_dsn` (or `dsn`) while `[queue] listen = yes`

    @property
    def dsn(self) -> int:
        """Connections to `[database] dsn` (the pooler, when there is one)."""
        return self.workers + self.supervisor + self.sweep

    @property
    def total(self) -> int:
        return self.dsn + self.listen


def connection_budget(
    workers: int, *, listen: bool = True, sweeps: bool = True
) -> ConnectionBudget:
    """The most connections one host opens at once (CLI commands add one each)."""
    return ConnectionBudget(
        workers=workers, supervisor=2, sweep=1 if sweeps else 0, listen=1 if listen else 0
    )
