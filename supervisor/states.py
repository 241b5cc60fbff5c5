"""The queue's vocabulary: row statuses, event kinds and error codes, once in Python.

The database is the authority: the domains of sql/schema.sql (derivd_status,
derivd_error_code, derivd_event_kind; migration 0014 added `rederived`, 0015
`claimed`, 0016 `worker_died`, 0017 `rederive_rejected`), to which the tables' CHECK
constraints cast their columns. These literals are their one Python copy; every other
module imports from here, and tests/test_states.py reads the domains' constraints back
from a migrated database (pg_get_constraintdef) and fails when the two disagree.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

Status = Literal["pending", "queued", "processing", "ready", "rejected", "deleting", "deleted"]
EventKind = Literal[
    "ready",
    "retry",
    "rejected",
    "lease_lost",
    "timeout",
    "released",
    "exhausted",
    "delete_requested",
    "deleted",
    "operator_retry",
    "rederived",
    "claimed",
    "worker_died",
    "rederive_rejected",
]
ErrorCode = Literal[
    "unsupported_content",
    "corrupt_content",
    "resource_limit",
    "missing_original",
    "attempts_exhausted",
    "processing_failed",
]

STATUSES: Final[tuple[Status, ...]] = get_args(Status)
EVENT_KINDS: Final[tuple[EventKind, ...]] = get_args(EventKind)
ERROR_CODES: Final[tuple[ErrorCode, ...]] = get_args(ErrorCode)
