"""The claim's plans do not depend on the table's statistics.

A worker's connection plans each statement inside the claim once and keeps the plan
(plan_cache_mode = force_generic_plan: sql/functions.sql says why). A plan formed on a
table without statistics (a fresh deployment, a bulk import) or on an empty queue was
kept as it was: every claim read and sorted every due row instead of walking the claim
order's index to its first one, 3x the server CPU per job. Here a fresh connection, as
a worker opens it, claims from tables with no statistics, with statistics, and from a
queue that was empty when it first claimed; auto_explain reports the plan of each
statement inside the claim (nested), as the server ran it. Every ordered pick is an
index scan in that order, each leased row found by its primary key: no statement sorts,
scans a table sequentially or hashes one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from helpers import sql

from derivd.queue.db import QueueDB

ROWS = 2000
SEED_FILES = """
INSERT INTO archive_files (status, original_key, original_version, tenant)
SELECT 'queued', 'originals/' || g, 'v1', CASE WHEN %s THEN 't' || (g %% 5) END
  FROM generate_series(1, %s) AS g
"""
SEED_REDERIVATIONS = """
WITH files AS (
    INSERT INTO archive_files (status, original_key, original_version, finished_at,
                               derived_key, derived_version, sha256, width, height)
    SELECT 'ready', 'originals/' || g, 'v1', now(), 'derived/x', '1', repeat('0', 64), 1, 1
      FROM generate_series(1, %s) AS g
    RETURNING id
)
INSERT INTO derivd_rederivations (file_id, original_key, original_version, priority)
SELECT id, 'originals/x', 'v1', -10 FROM files
"""
AUTO_EXPLAIN = (
    "LOAD 'auto_explain'",
    "SET auto_explain.log_min_duration = 0",
    "SET auto_explain.log_nested_statements = on",
    "SET auto_explain.log_level = notice",
)


@contextmanager
def worker_queue(dsn: str) -> Iterator[tuple[QueueDB, list[str]]]:
    """A connection as a worker opens it (generic plans), whose statements' plans, the
    nested ones included, are collected."""
    plans: list[str] = []
    with QueueDB.open(dsn, role="plan-test", generic_plans=True) as queue:
        queue.conn.add_notice_handler(lambda d: plans.append(d.message_primary or ""))
        for setting in AUTO_EXPLAIN:
            queue.conn.execute(setting)  # type: ignore[arg-type]  # constants
        yield queue, plans


def seed(dsn: str, *, rederivations: bool = False, tenants: bool = False) -> None:
    if rederivations:
        sql(dsn, SEED_REDERIVATIONS, (ROWS,))
    else:
        sql(dsn, SEED_FILES, (tenants, ROWS))


def has_statistics(dsn: str) -> bool:
    return bool(sql(dsn, "SELECT 1 FROM pg_stats WHERE tablename = 'archive_files'"))


def ordered_picks(plans: list[str]) -> list[str]:
    """The plans of the statements that pick rows in an order (the claim's picks)."""
    return [p for p in inside_the_claim(plans) if "ORDER BY" in p]


def nodes(plan: str) -> list[str]:
    return [line.strip().lstrip("-> ") for line in plan.splitlines()]


def sorts(plan: str) -> bool:
    return any(node.startswith("Sort ") for node in nodes(plan))


def inside_the_claim(plans: list[str]) -> list[str]:
    """The plans of the statements inside the claim (not the call itself)."""
    return [p for p in plans if "Query Text: SELECT c.*" not in p]


def statistics_bound(plans: list[str]) -> list[str]:
    """The nodes a plan made from statistics may hold and an index walk never does: a
    sort, a sequential scan of a table, a hash join."""
    return [
        node
        for plan in inside_the_claim(plans)
        for node in nodes(plan)
        if node.startswith(("Sort ", "Seq Scan on ", "Hash Join "))
    ]


def claim(queue: QueueDB, *, tenant_cap: int = 0) -> int:
    jobs = queue.claim_many(limit=1, lease_s=60, max_attempts=3, tenant_cap=tenant_cap)
    return len(jobs)


def called_at_run_time(plans: list[str], names: tuple[str, ...]) -> list[str]:
    """Plan lines (nodes and their conditions, not the query's text) that still call one
    of `names`: a rule the server did not inline."""
    return [
        line
        for plan in inside_the_claim(plans)
        for line in plan.splitlines()
        if ("(cost=" in line or line.strip().startswith(("Filter:", "Index Cond:")))
        and any(f"{name}(" in line for name in names)
    ]


RULES = ("derivd_attempts_left", "derivd_retries", "derivd_lease_end", "derivd_given_back")


@pytest.mark.parametrize("analyzed", [False, True], ids=["no statistics", "analyzed"])
def test_the_ranked_claim_walks_the_claim_order_index(dsn: str, analyzed: bool) -> None:
    seed(dsn)
    if analyzed:
        sql(dsn, "ANALYZE archive_files")
    assert has_statistics(dsn) == analyzed
    with worker_queue(dsn) as (queue, plans):
        for _ in range(3):  # the plans kept for the connection, used again
            assert claim(queue) == 1
    picks = ordered_picks(plans)
    ranked = [p for p in picks if "ORDER BY f.priority DESC, f.fair_rank, f.id" in p]
    assert len(ranked) == 3
    assert all("Index Scan using archive_files_claim_order" in p for p in ranked), ranked[0]
    assert statistics_bound(plans) == []
    # The lease rules the claim applies (sql/functions.sql) are inlined, not called.
    assert called_at_run_time(plans, RULES) == []
    assert any("attempts < " in p for p in picks)


def test_a_queue_empty_at_the_first_claim_keeps_an_index_plan(dsn: str) -> None:
    """The worker connected while the queue was empty (its table analyzed so: no queued
    row in the statistics) and formed its plans then; the rows come afterwards."""
    sql(dsn, "ANALYZE archive_files")
    with worker_queue(dsn) as (queue, plans):
        assert claim(queue) == 0
        seed(dsn)
        assert claim(queue) == 1
    picks = ordered_picks(plans)
    assert picks and statistics_bound(plans) == []
    assert "Index Scan using archive_files_claim_order" in picks[-1]


def test_the_oldest_first_turn_walks_the_claimable_index(dsn: str) -> None:
    seed(dsn)
    assert not has_statistics(dsn)
    sql(dsn, "SELECT setval('derivd_claim_turns', 19)")  # the next claim is the 20th
    with worker_queue(dsn) as (queue, plans):
        assert claim(queue) == 1
    picks = ordered_picks(plans)
    oldest = [p for p in picks if "ORDER BY f.available_at, f.id" in p]
    assert oldest and all("Index Scan using archive_files_claimable" in p for p in oldest)
    assert statistics_bound(plans) == []


def test_the_capped_claim_does_not_sort(dsn: str) -> None:
    seed(dsn, tenants=True)
    assert not has_statistics(dsn)
    with worker_queue(dsn) as (queue, plans):
        for _ in range(3):
            assert claim(queue, tenant_cap=2) == 1
    picks = ordered_picks(plans)
    assert picks and statistics_bound(plans) == []


def test_the_rederivations_claim_walks_its_claim_order_index(dsn: str) -> None:
    seed(dsn, rederivations=True)
    with worker_queue(dsn) as (queue, plans):
        assert claim(queue) == 1
    picks = ordered_picks(plans)
    due = [p for p in picks if "ORDER BY q.priority DESC, q.id" in p]
    assert due and all("derivd_rederivations_claim_order" in p for p in due), due
    assert statistics_bound(plans) == []


def test_a_bulk_insert_ranks_each_row_by_one_index_descent(dsn: str) -> None:
    """The rank trigger (archive_files_fair_rank) plans once per connection too: on a
    queue analyzed while empty, a bulk insert's rows each find their tenant's last rank
    and the frontier through an index, not by scanning and sorting the rows before."""
    sql(dsn, "ANALYZE archive_files")
    with worker_queue(dsn) as (queue, plans):
        queue.conn.execute(SEED_FILES, (True, 50))  # type: ignore[arg-type]  # constant
    ranks = [p for p in plans if "f.fair_rank" in p]
    assert ranks and statistics_bound(plans) == []
    assert sql(dsn, "SELECT count(DISTINCT fair_rank) AS n FROM archive_files")[0]["n"] == 10


def test_auto_explain_reports_a_sort_when_there_is_one(dsn: str) -> None:
    """What the tests above look for is there when a plan sorts."""
    with worker_queue(dsn) as (queue, plans):
        with psycopg.ClientCursor(queue.conn) as cur:
            cur.execute("SELECT 1 FROM archive_files ORDER BY original_key")
    assert plans and all(sorts(p) for p in plans)
    assert any(node.startswith("Seq Scan on ") for node in statistics_bound(plans))
