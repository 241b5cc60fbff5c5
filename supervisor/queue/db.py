"""The queue: `QueueDB`, one worker's (or one command's) handle on the queue tables, and
the names the rest of derivd imports from here.

The queue is split by concern: session.py (connection and session policy), schema.py
(migrate and the schema check), listener.py (LISTEN), records.py (what the queue hands
out), statements.py (the one place that executes SQL), and one query API per caller:
worker_queries.py, host_queries.py (the supervisor), maintenance_queries.py (duties and
the sweep), operator_queries.py, backfill_queries.py, dashboard_queries.py and
client_queries.py (derivd.client). Every query lives in `sql/`.
"""

from __future__ import annotations

from derivd.queue.backfill_queries import BackfillQueries
from derivd.queue.client_queries import ClientQueries
from derivd.queue.cluster_admin import ClusterAdmin
from derivd.queue.dashboard_queries import DashboardQueries
from derivd.queue.host_queries import HostQueries
from derivd.queue.listener import FINISHED_CHANNEL, QUEUED_CHANNEL, QueueListener
from derivd.queue.maintenance_queries import MaintenanceQueries
from derivd.queue.operator_queries import OperatorQueries
from derivd.queue.records import (
    Committed,
    EventWindow,
    Finished,
    HostInfo,
    Job,
    QueueStats,
    StoredVariant,
)
from derivd.queue.schema import (
    NO_SCHEMA,
    SchemaMismatch,
    check_schema,
    check_schema_on,
    in_schema,
    migrate,
    newer_schema,
    schema_problem,
)
from derivd.queue.session import (
    DDL_LOCK_TIMEOUT_S,
    KEEPALIVES,
    PARENT_LOCK_TIMEOUT_S,
    PARENT_STATEMENT_TIMEOUT_S,
    DatabaseUnavailable,
    LockBusy,
    StatementTimeout,
    bounded,
    connect,
    is_pooled,
    open_connection,
)
from derivd.queue.webhook_queries import WebhookQueries
from derivd.queue.worker_queries import WorkerQueries

__all__ = [
    "DDL_LOCK_TIMEOUT_S",
    "FINISHED_CHANNEL",
    "KEEPALIVES",
    "NO_SCHEMA",
    "PARENT_LOCK_TIMEOUT_S",
    "PARENT_STATEMENT_TIMEOUT_S",
    "QUEUED_CHANNEL",
    "ClusterAdmin",
    "Committed",
    "DatabaseUnavailable",
    "EventWindow",
    "Finished",
    "HostInfo",
    "Job",
    "LockBusy",
    "QueueDB",
    "QueueListener",
    "QueueStats",
    "SchemaMismatch",
    "StatementTimeout",
    "StoredVariant",
    "bounded",
    "check_schema",
    "check_schema_on",
    "connect",
    "in_schema",
    "is_pooled",
    "migrate",
    "newer_schema",
    "open_connection",
    "schema_problem",
]


class QueueDB(
    WorkerQueries,
    HostQueries,
    MaintenanceQueries,
    OperatorQueries,
    BackfillQueries,
    DashboardQueries,
    ClientQueries,
    WebhookQueries,
):
    """One worker's (or one command's) handle on the queue tables: every query API of
    derivd.queue on one connection (statements.Statements runs them)."""
