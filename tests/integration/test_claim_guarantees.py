"""What the claim must never do, on a real
PostgreSQL, direct and through PgBouncer: wait for a tenant's lock (two claims meeting
two tenants in different orders deadlocked, rolling back the commit that shares their
transaction), leave a tenant below its cap unclaimed, cap untenanted rows together, or
take a row past the attempt cap. The worker's side of item 2:
tests/integration/test_worker_commit_again.py."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import psycopg
import pytest
from fixtures.work import commit_one
from helpers import sql

from derivd.priorities import CLAIM_SHARE
from derivd.queue.db import Finished, Job, QueueDB

pytestmark = pytest.mark.pooler

LONG = 60.0


@pytest.fixture
def queue(dsn: str) -> Iterator[QueueDB]:
    q = QueueDB.open(dsn)
    yield q
    q.close()


def claim(queue: QueueDB, *, limit: int = 1, cap: int = 0, max_attempts: int = 3) -> list[Job]:
    return queue.claim_many(limit=limit, lease_s=LONG, max_attempts=max_attempts, tenant_cap=cap)


def enqueue(queue: QueueDB, n: int, *, priority: int = 0, tenant: str | None = None) -> list[int]:
    return queue.enqueue([(f"originals/{i}", "v") for i in range(n)], priority=priority,
                         tenant=tenant)  # fmt: skip


def tenants(dsn: str, jobs: list[Job]) -> list[str | None]:
    rows = sql(
        dsn, "SELECT id, tenant FROM archive_files WHERE id = ANY(%s)", ([j.id for j in jobs],)
    )
    by_id = {r["id"]: r["tenant"] for r in rows}
    return [by_id[j.id] for j in jobs]


def test_the_claim_in_a_commits_statement_sees_that_commit(queue: QueueDB, dsn: str) -> None:
    """The worker's one statement commits, then claims (sql/queries.sql, commit_and_claim):
    under a cap of 1 the commit of tenant a's only row in flight frees its place for a's
    next row in the same statement. A claim run before the commit, or on a snapshot taken
    before it, sees a at its cap and claims nothing."""
    enqueue(queue, 2, tenant="a")
    [first] = claim(queue, cap=1)
    assert claim(queue, cap=1) == []  # a is at its cap
    committed, [second] = queue.commit_and_claim(
        [Finished(first, [])], limit=1, lease_s=LONG, max_attempts=3, tenant_cap=1
    )
    assert set(committed) == {first.id} and second.id != first.id
    rows = sql(dsn, "SELECT id, status FROM archive_files ORDER BY id")
    assert {r["id"]: r["status"] for r in rows} == {first.id: "ready", second.id: "processing"}


# -- item 2: tenant locks are tried, never waited for ------------------------------------


def tenant_lock(conn: psycopg.Connection[object], tenant: str) -> None:
    """Hold `tenant`'s claim lock in `conn`'s open transaction, as a claim in progress does."""
    conn.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended('derivd.tenant:' || %s, 0))", (tenant,)
    )


@pytest.mark.parametrize("turn", ["ranked", "oldest first"])
def test_a_capped_claim_never_waits_for_a_tenant_another_claim_is_counting(
    queue: QueueDB, dsn: str, direct_dsn: str, turn: str
) -> None:
    """Another claim holds tenant a's lock: this one takes tenant b's row at once instead
    of waiting (a waiting claim holding b's lock while the other waits for b is the
    deadlock). A lock wait here fails the claim on lock_timeout."""
    enqueue(queue, 2, tenant="a")
    (b_row,) = enqueue(queue, 1, tenant="b")
    if turn == "oldest first":  # the next claim call is the every-20th turn
        sql(direct_dsn, "SELECT setval('derivd_claim_turns', %s)", (CLAIM_SHARE - 1,))
    with psycopg.connect(direct_dsn) as other, QueueDB.open(direct_dsn) as claimer:
        tenant_lock(other, "a")
        claimer.conn.execute("SET lock_timeout = '5s'")  # a session setting: direct
        jobs = claim(claimer, limit=2, cap=1)
        other.rollback()
    assert [j.id for j in jobs] == [b_row]


def test_a_tenant_whose_lock_is_held_is_claimed_once_it_is_free(
    queue: QueueDB, direct_dsn: str
) -> None:
    (a_row,) = enqueue(queue, 1, tenant="a")
    with psycopg.connect(direct_dsn) as other, QueueDB.open(direct_dsn) as claimer:
        tenant_lock(other, "a")
        claimer.conn.execute("SET lock_timeout = '5s'")
        assert claim(claimer, cap=1) == []
        other.rollback()
    assert [j.id for j in claim(queue, cap=1)] == [a_row]


# -- item 3: no starvation below the cap; NULL is no tenant -----------------------------


def test_a_tenant_at_its_cap_does_not_starve_the_others(queue: QueueDB, dsn: str) -> None:
    """The review's case: A has 1 in flight and 100 queued at priority 10, B 5 queued at
    priority 0, cap 1: every claim call takes B's rows while A is at its cap (it looked at
    4 x lim + 16 candidates, all A's, and returned nothing in 60 calls)."""
    enqueue(queue, 1, priority=10, tenant="A")
    [held] = claim(queue, cap=1)
    enqueue(queue, 100, priority=10, tenant="A")
    b_rows = enqueue(queue, 5, tenant="B")
    claimed = [job for _ in range(2 * CLAIM_SHARE) for job in claim(queue, cap=1)]
    assert [j.id for j in claimed] == b_rows[:1]  # B is at its cap now too
    assert tenants(dsn, [held]) == ["A"]


def test_every_claim_turn_finds_the_row_below_the_cap(queue: QueueDB, dsn: str) -> None:
    """Ranked claims and the every-20th oldest-first turns alike: with A at its cap and
    more of A's rows ahead of B's in both orders, each claim that B's cap allows gets one."""
    enqueue(queue, 1, tenant="A")
    claim(queue, cap=1)
    enqueue(queue, 4 * 1 + 16 + 5, priority=5, tenant="A")
    b_rows = enqueue(queue, CLAIM_SHARE + 1, tenant="B")
    claimed: list[Job] = []
    for _ in range(CLAIM_SHARE + 1):  # every turn, the oldest-first one included
        jobs = claim(queue, cap=1)
        assert len(jobs) == 1 and tenants(dsn, jobs) == ["B"]
        claimed += jobs
        assert commit_one(queue, jobs[0], [])
    assert [j.id for j in claimed] == b_rows


def test_rows_without_a_tenant_are_not_capped_together(queue: QueueDB, dsn: str) -> None:
    """NULL means no tenant (docs/traffic.md): untenanted rows were capped as tenant ''."""
    enqueue(queue, 3)
    enqueue(queue, 3, tenant="a")
    jobs = claim(queue, limit=6, cap=1)
    assert Counter(tenants(dsn, jobs)) == {None: 3, "a": 1}


# -- item 7: no claim past the attempt cap ----------------------------------------------


def test_a_queued_row_past_a_lowered_attempt_cap_is_rejected_not_claimed(
    queue: QueueDB, dsn: str
) -> None:
    """Two failed attempts under max_attempts = 3 leave the row queued with 2; a SIGHUP
    lowers max_attempts to 2: the claim rejects it `attempts_exhausted` (it took it for a
    third attempt) and goes on to the next row."""
    (tired,) = enqueue(queue, 1)
    for _ in range(2):
        [job] = claim(queue)
        queue.fail(job, retry=True, code="processing_failed", max_attempts=3, delay_s=0.0)
    (fresh,) = enqueue(queue, 1)
    jobs = claim(queue, max_attempts=2)
    assert [j.id for j in jobs] == [fresh]
    [row] = sql(
        dsn, "SELECT status, attempts, error_code FROM archive_files WHERE id = %s", (tired,)
    )
    assert row == {"status": "rejected", "attempts": 2, "error_code": "attempts_exhausted"}
    kinds = [r["kind"] for r in sql(dsn, "SELECT kind FROM archive_events WHERE file_id = %s"
                                         " ORDER BY id", (tired,))]  # fmt: skip
    assert kinds == ["retry", "retry", "exhausted"]


def test_a_capped_claim_holds_the_attempt_cap_too(queue: QueueDB, dsn: str) -> None:
    (tired,) = enqueue(queue, 1, tenant="a")
    [job] = claim(queue, cap=1)
    queue.fail(job, retry=True, code="processing_failed", max_attempts=3, delay_s=0.0)
    assert claim(queue, cap=1, max_attempts=1) == []
    [row] = sql(dsn, "SELECT status, attempts FROM archive_files WHERE id = %s", (tired,))
    assert row == {"status": "rejected", "attempts": 1}


def test_a_queued_rederivation_past_a_lowered_attempt_cap_is_rejected_not_claimed(
    queue: QueueDB, dsn: str
) -> None:
    """As a file's: a re-derivation queued with 2 attempts used, claimed under
    max_attempts = 2, is rejected `attempts_exhausted` (the job's rejection: its file
    keeps its set and gets `rederive_rejected`); the next one is claimed."""
    (tired_file, tired), (fresh_file, fresh) = (
        rederivation_of_a_ready_file(dsn, attempts) for attempts in (2, 0)
    )
    jobs = claim(queue, limit=2, max_attempts=2)
    assert [(j.id, j.attempt, j.for_file) for j in jobs] == [(fresh, 1, fresh_file)]
    [row] = sql(
        dsn,
        "SELECT status, attempts, error_code FROM derivd_rederivations WHERE id = %s",
        (tired,),
    )
    assert row == {"status": "rejected", "attempts": 2, "error_code": "attempts_exhausted"}
    events = sql(dsn, "SELECT kind, error_code FROM archive_events WHERE file_id = %s",
                 (tired_file,))  # fmt: skip
    assert events == [{"kind": "rederive_rejected", "error_code": "attempts_exhausted"}]


def rederivation_of_a_ready_file(dsn: str, attempts: int) -> tuple[int, int]:
    """(file id, job id): a ready file and a queued re-derivation of it."""
    [file] = sql(
        dsn,
        "INSERT INTO archive_files (status, original_key, original_version)"
        " VALUES ('ready', 'originals/r', 'v') RETURNING id",
    )
    [job] = sql(
        dsn,
        "INSERT INTO derivd_rederivations (file_id, original_key, original_version,"
        " attempts) VALUES (%s, 'originals/r', 'v', %s) RETURNING id",
        (file["id"], attempts),
    )
    return file["id"], job["id"]
