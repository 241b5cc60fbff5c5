"""Priorities and tenants in the claim (migration 0014, docs/traffic.md), on a real
PostgreSQL, direct and through PgBouncer: claim order, the starvation bound, tenants
sharing the claims, the per-tenant cap, and bad input refused."""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from fixtures.work import commit_one

from derivd import client
from derivd.priorities import CLAIM_SHARE
from derivd.queue.db import Job, QueueDB

LONG = 60.0


def claim(queue: QueueDB, *, limit: int = 1, cap: int = 0) -> list[Job]:
    return queue.claim_many(limit=limit, lease_s=LONG, max_attempts=3, tenant_cap=cap)


def claim_ids(queue: QueueDB, calls: int, *, cap: int = 0) -> list[int]:
    """The ids of `calls` successive single-row claims (those that found a row)."""
    return [job.id for _ in range(calls) for job in claim(queue, cap=cap)]


def enqueue(queue: QueueDB, n: int, *, priority: int = 0, tenant: str | None = None) -> list[int]:
    return queue.enqueue([(f"originals/{i}", "v") for i in range(n)], priority=priority,
                         tenant=tenant)  # fmt: skip


def tenant_of(queue: QueueDB, ids: list[int]) -> list[str | None]:
    rows = queue.conn.execute(
        "SELECT id, tenant FROM archive_files WHERE id = ANY(%s)", (ids,)
    ).fetchall()
    by_id = dict(rows)
    return [by_id[i] for i in ids]


@pytest.mark.pooler
def test_higher_priority_is_claimed_first_then_due_time(queue: QueueDB) -> None:
    low = enqueue(queue, 2, priority=-5)
    normal = enqueue(queue, 2)
    high = enqueue(queue, 2, priority=7)
    assert claim_ids(queue, 6) == high + normal + low


@pytest.mark.pooler
def test_an_expired_lease_still_comes_before_any_priority(queue: QueueDB) -> None:
    (old,) = enqueue(queue, 1, priority=-100)
    claim(queue)
    queue.conn.execute(
        "UPDATE archive_files SET lease_until = now() - interval '1 second' WHERE id = %s", (old,)
    )
    enqueue(queue, 3, priority=100)
    [job] = claim(queue)
    assert job.id == old and job.attempt == 2


@pytest.mark.pooler
def test_the_lowest_priority_gets_every_twentieth_claim(queue: QueueDB) -> None:
    """The starvation bound: whatever arrives above it, the oldest due row is taken by
    the CLAIM_SHARE-th claim call (a fleet-wide sequence)."""
    (starved,) = enqueue(queue, 1, priority=-100)
    enqueue(queue, 3 * CLAIM_SHARE, priority=100)
    ids = claim_ids(queue, CLAIM_SHARE)
    assert starved not in ids[:-1]
    assert ids[-1] == starved


@pytest.mark.pooler
def test_a_small_tenant_is_started_after_a_handful_of_claims(queue: QueueDB) -> None:
    """A tenant holding many does not make another wait behind all of them: their rows
    alternate from the moment the second one arrives."""
    enqueue(queue, 200, tenant="big")
    small = enqueue(queue, 5, tenant="small")
    first = claim_ids(queue, 10)
    assert set(small) <= set(first)
    assert Counter(tenant_of(queue, first)) == {"big": 5, "small": 5}


@pytest.mark.pooler
def test_tenants_arriving_later_share_with_the_ones_in_progress(queue: QueueDB) -> None:
    enqueue(queue, 50, tenant="a")
    claim_ids(queue, 10)  # a's queue is under way
    enqueue(queue, 50, tenant="b")
    enqueue(queue, 50)  # no tenant: one more share
    got = tenant_of(queue, claim_ids(queue, 15))
    assert Counter(got) == {"a": 5, "b": 5, None: 5}


@pytest.mark.pooler
def test_sharing_holds_within_a_priority_and_priority_wins_across(queue: QueueDB) -> None:
    enqueue(queue, 20, tenant="a", priority=-10)
    enqueue(queue, 20, tenant="b", priority=-10)
    urgent = enqueue(queue, 2, tenant="a", priority=10)
    ids = claim_ids(queue, 6)
    assert ids[:2] == urgent
    assert Counter(tenant_of(queue, ids[2:])) == {"a": 2, "b": 2}


@pytest.mark.pooler
def test_the_tenant_cap_bounds_jobs_in_flight_per_tenant(queue: QueueDB) -> None:
    enqueue(queue, 10, tenant="a")
    enqueue(queue, 10, tenant="b")
    held = [job for _ in range(6) for job in claim(queue, cap=2)]
    assert Counter(tenant_of(queue, [j.id for j in held])) == {"a": 2, "b": 2}
    assert claim(queue, cap=2) == []  # both at the cap, though 16 rows are due
    done = next(j for j in held if tenant_of(queue, [j.id]) == ["a"])
    assert commit_one(queue, done, [])
    [job] = claim(queue, cap=2)
    assert tenant_of(queue, [job.id]) == ["a"]


@pytest.mark.pooler
def test_the_tenant_cap_holds_within_one_batch(queue: QueueDB) -> None:
    enqueue(queue, 10, tenant="a")
    enqueue(queue, 1, tenant="b")
    jobs = claim(queue, limit=10, cap=3)
    assert Counter(tenant_of(queue, [j.id for j in jobs])) == {"a": 3, "b": 1}


@pytest.mark.pooler
def test_without_a_cap_a_batch_takes_every_due_row(queue: QueueDB) -> None:
    enqueue(queue, 10, tenant="a")
    assert len(claim(queue, limit=10)) == 10


@pytest.mark.pooler
def test_retried_rows_keep_their_place(queue: QueueDB) -> None:
    first, *_ = enqueue(queue, 3, tenant="a")
    [job] = claim(queue)
    queue.fail(job, retry=True, code="processing_failed", max_attempts=3, delay_s=0.0)
    enqueue(queue, 3, tenant="b")
    assert claim_ids(queue, 1) == [first]


@pytest.mark.pooler
def test_a_pending_row_takes_its_place_when_the_upload_api_queues_it(queue: QueueDB) -> None:
    """pending -> queued by an UPDATE (an upload API that inserts first, confirms later):
    the row got its rank at insert, so it is not left behind every later row."""
    enqueue(queue, 10, tenant="a")
    row = queue.conn.execute(
        "INSERT INTO archive_files (status, original_key, original_version, tenant)"
        " VALUES ('pending', 'k', 'v', 'b') RETURNING id"
    ).fetchone()
    assert row is not None
    enqueue(queue, 10, tenant="c")
    queue.conn.execute("UPDATE archive_files SET status = 'queued' WHERE id = %s", (row[0],))
    assert row[0] in claim_ids(queue, 3)


# -- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"priority": 101}, client.InvalidPriority),
        ({"priority": -101}, client.InvalidPriority),
        ({"priority": 1.5}, client.InvalidPriority),
        ({"tenant": "x" * 201}, client.InvalidTenant),
        ({"tenant": "a\nb"}, client.InvalidTenant),
        ({"tenant": ""}, client.InvalidTenant),
    ],
)
def test_the_client_refuses_bad_priority_and_tenant(
    dsn: str, kwargs: dict[str, object], error: type[Exception]
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(error) as caught:
            client.enqueue(conn, "originals/a", "v1", **kwargs)  # type: ignore[arg-type]
        assert "\n" not in str(caught.value)
        assert conn.execute("SELECT count(*) FROM archive_files").fetchone() == (0,)


def test_the_client_accepts_the_documented_extremes(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        a = client.enqueue(conn, "originals/a", "v1", priority=100, tenant="t" * 200)
        b = client.enqueue(conn, "originals/b", "v1", priority=-100, tenant="é ü")
        rows = conn.execute(
            "SELECT priority, tenant FROM archive_files WHERE id IN (%s, %s) ORDER BY id", (a, b)
        ).fetchall()
    assert rows == [(100, "t" * 200), (-100, "é ü")]


@pytest.mark.parametrize(
    ("column", "value", "constraint"),
    [
        ("priority", 500, "derivd_priority_check"),
        ("tenant", "a\tb", "derivd_tenant_check"),
        ("tenant", "x" * 201, "derivd_tenant_check"),
    ],
)
def test_the_database_refuses_what_the_client_would(
    queue: QueueDB, column: str, value: object, constraint: str
) -> None:
    statement = (
        f"INSERT INTO archive_files (status, original_key, original_version, {column}) "
        "VALUES ('queued', 'k', 'v', %s)"
    )
    with pytest.raises(psycopg.errors.CheckViolation) as caught:
        queue.conn.execute(statement, (value,))  # type: ignore[arg-type]
    assert caught.value.diag.constraint_name == constraint


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--priority", "101"], "outside -100..100"),
        (["--tenant", "x" * 201], "at most 200"),
        (["--tenant", "a\x01b"], "control characters"),
    ],
)
def test_the_cli_refuses_bad_priority_and_tenant_in_one_line(
    run_cli: Callable[..., subprocess.CompletedProcess[str]],
    tmp_path: Path,
    option: list[str],
    message: str,
) -> None:
    image = tmp_path / "a.jpg"
    image.write_bytes(b"not read: refused before")
    result = run_cli(
        "enqueue", *option, str(image), env={"DERIVD_DATABASE_DSN": "host=/nonexistent"}
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
