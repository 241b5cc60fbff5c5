"""One source for statuses, event kinds and error codes: the database's domains.

The domains' constraints (sql/schema.sql) are read back from a migrated database
(pg_get_constraintdef), so a migration that adds a status or a code fails here until
derivd.states says the same; every other Python copy is checked against derivd.states.
"""

from __future__ import annotations

import re
from typing import get_args

import click
from helpers import sql

from derivd import errors, states
from derivd.cli.queue_commands import retry
from derivd.ops import health, metrics, status

# domain constraint name -> the vocabulary it must equal
CONSTRAINTS = {
    "derivd_status_check": states.STATUSES,
    "derivd_error_code_check": states.ERROR_CODES,
    "derivd_event_kind_check": states.EVENT_KINDS,
}
# table CHECK -> the domain its column is cast to
COLUMN_CHECKS = {
    "archive_events_kind_check": "derivd_event_kind",
    "archive_events_error_code_check": "derivd_error_code",
}
# archive_files' rules are one CHECK, a call of this function (migration 0020): the
# casts it makes of each vocabulary column
ROW_CHECK_CASTS = ("r.status::derivd_status", "r.error_code::derivd_error_code")


def constraint_values(dsn: str) -> dict[str, set[str]]:
    """Each domain constraint's quoted literals (`VALUE = ANY (ARRAY['a'::text, ...])`)."""
    rows = sql(
        dsn,
        "SELECT conname, pg_get_constraintdef(oid) AS def FROM pg_constraint "
        "WHERE contype = 'c' AND contypid <> 0 AND conname = ANY(%s)",
        (list(CONSTRAINTS),),
    )
    return {r["conname"]: set(re.findall(r"'([a-z_]+)'", r["def"])) for r in rows}


def test_each_table_check_casts_its_column_to_the_vocabulary_domain(dsn: str) -> None:
    rows = sql(
        dsn,
        "SELECT conname, pg_get_constraintdef(oid) AS def FROM pg_constraint "
        "WHERE contype = 'c' AND conrelid IN ('archive_files'::regclass, "
        "'archive_events'::regclass) AND conname = ANY(%s)",
        (list(COLUMN_CHECKS),),
    )
    found = {r["conname"]: r["def"] for r in rows}
    assert set(found) == set(COLUMN_CHECKS), "a table CHECK was renamed or dropped"
    for name, domain in COLUMN_CHECKS.items():
        assert f"::{domain} IS NOT NULL" in found[name], (name, found[name])


def test_the_file_row_check_casts_its_columns_to_the_vocabulary_domains(dsn: str) -> None:
    (row,) = sql(
        dsn,
        "SELECT pg_get_constraintdef(c.oid) AS def,"
        " pg_get_functiondef('derivd_file_row_holds'::regproc) AS body"
        " FROM pg_constraint AS c"
        " WHERE c.conrelid = 'archive_files'::regclass AND c.contype = 'c'",
    )
    assert "derivd_file_row_holds(archive_files.*)" in row["def"]
    for cast in ROW_CHECK_CASTS:
        assert cast in row["body"], cast


def test_the_python_vocabulary_is_the_databases(dsn: str) -> None:
    found = constraint_values(dsn)
    assert set(found) == set(CONSTRAINTS), "a constraint was renamed or dropped"
    for name, values in CONSTRAINTS.items():
        assert found[name] == set(values), name
        assert len(values) == len(set(values)), f"{name}: a value listed twice"


def test_every_python_copy_agrees_with_derivd_states() -> None:
    assert get_args(errors.ErrorCode) == states.ERROR_CODES
    assert sorted(health.STATUS_ORDER) == sorted(states.STATUSES)  # a permutation
    assert {kind for _label, kind in status.RECENT_EVENTS} <= set(states.EVENT_KINDS)
    assert set(metrics.COUNTED_EVENTS) <= set(states.EVENT_KINDS)
    code = next(p for p in retry.params if p.name == "code")
    assert isinstance(code.type, click.Choice)
    assert tuple(code.type.choices) == states.ERROR_CODES


def test_every_status_gets_a_gauge_and_a_table_row() -> None:
    from derivd.queue.db import QueueStats

    m = metrics.Metrics()
    m.set_queue(QueueStats(counts={}, oldest_claimable_age_s=None, expired_leases=0))
    page = m.render().decode()
    for name in states.STATUSES:
        assert f'derivd_queue_rows{{status="{name}"}} 0.0' in page, name
