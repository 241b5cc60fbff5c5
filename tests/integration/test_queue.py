"""The lease protocol on a real PostgreSQL: claim, fence, release, caps, concurrency."""

from __future__ import annotations

import multiprocessing
import time
from collections import Counter

import psycopg
import pytest
from fixtures.work import claim_one, commit_one

from derivd.queue.db import Finished, QueueDB, StoredVariant, migrate
from derivd.queue.sqlfiles import queries

# Each test on `dsn` runs direct and through PgBouncer (transaction mode).
pytestmark = pytest.mark.pooler

LONG = 60.0


def variant(name: str = "preview", key: str = "derived/k.webp") -> StoredVariant:
    return StoredVariant(name, key, "v1", "ab" * 32, 10, 5)


def events(queue: QueueDB, file_id: int) -> list[tuple[str, int | None]]:
    rows = queue.conn.execute(
        "SELECT kind, attempt FROM archive_events WHERE file_id = %s ORDER BY id", (file_id,)
    ).fetchall()
    return [(r[0], r[1]) for r in rows]


def expire_lease(queue: QueueDB, file_id: int) -> None:
    # Move the lease into the past instead of sleeping through it.
    queue.conn.execute(
        "UPDATE archive_files SET lease_until = now() - interval '1 second' WHERE id = %s",
        (file_id,),
    )


def test_migrate_is_idempotent(dsn: str) -> None:
    assert migrate(dsn) == []  # the template already has everything


def test_claim_takes_oldest_due_row_and_counts_the_attempt(queue: QueueDB) -> None:
    first, second = queue.enqueue([("originals/a", "1"), ("originals/b", "2")])
    job = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert job is not None and job.id == first and job.attempt == 1
    row = queue.file_row(first)
    assert row is not None
    assert row["status"] == "processing" and row["lease_token"] == job.token
    assert row["lease_until"] > row["claimed_at"]
    other = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert other is not None and other.id == second and other.token != job.token
    assert claim_one(queue, lease_s=LONG, max_attempts=3) is None


def test_rows_not_yet_available_are_not_claimed(queue: QueueDB) -> None:
    (file_id,) = queue.enqueue([("originals/a", "1")])
    queue.conn.execute(
        "UPDATE archive_files SET available_at = now() + interval '1 hour' WHERE id = %s",
        (file_id,),
    )
    assert claim_one(queue, lease_s=LONG, max_attempts=3) is None


def test_fencing_late_commit_of_expired_attempt_changes_nothing(queue: QueueDB) -> None:
    (file_id,) = queue.enqueue([("originals/a", "1")])
    attempt_a = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert attempt_a is not None
    expire_lease(queue, file_id)
    attempt_b = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert attempt_b is not None and attempt_b.id == file_id and attempt_b.attempt == 2

    assert commit_one(queue, attempt_a, [variant(key="derived/1/A/preview.webp")]) is False
    assert queue.file_row(file_id)["status"] == "processing"  # type: ignore[index]
    assert commit_one(queue, attempt_b, [variant(key="derived/1/B/preview.webp")]) is True

    row = queue.file_row(file_id)
    assert row is not None and row["status"] == "ready"
    assert row["derived_key"] == "derived/1/B/preview.webp"
    assert [v.key for v in queue.file_variants(file_id)] == ["derived/1/B/preview.webp"]
    assert events(queue, file_id) == [("lease_lost", 1), ("ready", 2)]
    # The winner's commit sent again (its first answer lost: Worker._commit_again) is
    # told it committed, and nothing is written twice: a row is committed once.
    assert commit_one(queue, attempt_b, [variant(key="derived/1/B/other.webp")]) is True
    assert queue.file_row(file_id)["derived_key"] == "derived/1/B/preview.webp"  # type: ignore[index]
    assert [v.key for v in queue.file_variants(file_id)] == ["derived/1/B/preview.webp"]
    assert events(queue, file_id) == [("lease_lost", 1), ("ready", 2)]
    # The loser's, after the winner's: still lost.
    assert commit_one(queue, attempt_a, [variant(key="derived/1/A/preview.webp")]) is False


def test_a_noop_commit_sent_again_is_committed_once(queue: QueueDB) -> None:
    (file_id,) = queue.enqueue([("originals/a", "1")])
    job = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert job is not None
    assert commit_one(queue, job, []) is True
    assert commit_one(queue, job, []) is True  # no variants: the attempt number tells
    assert events(queue, file_id) == [("ready", 1)]


def test_fail_and_release_are_fenced(queue: QueueDB) -> None:
    (file_id,) = queue.enqueue([("originals/a", "1")])
    stale = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert stale is not None
    expire_lease(queue, file_id)
    current = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert current is not None
    assert queue.fail(stale, retry=False, code="corrupt_content", max_attempts=3) is None
    assert queue.release(stale) is False
    assert queue.file_row(file_id)["status"] == "processing"  # type: ignore[index]
    assert events(queue, file_id) == [("lease_lost", 1), ("lease_lost", 1)]


def test_a_dead_workers_job_goes_back_counted_then_exhausted(queue: QueueDB) -> None:
    """derivd_worker_died: `worker_died` on the attempt, back to
    `queued` after the delay with the attempt counted; on the last one, rejected
    attempts_exhausted. Fenced: a stale token changes nothing."""
    (file_id,) = queue.enqueue([("originals/a", "1")])
    job = claim_one(queue, lease_s=LONG, max_attempts=2)
    assert job is not None
    assert queue.worker_died(job, max_attempts=2, delay_s=30) == "queued"
    row = queue.file_row(file_id)
    assert row is not None and row["attempts"] == 1 and row["lease_token"] is None
    assert claim_one(queue, lease_s=LONG, max_attempts=2) is None  # delayed 30 s
    queue.conn.execute("UPDATE archive_files SET available_at = now() WHERE id = %s", (file_id,))
    last = claim_one(queue, lease_s=LONG, max_attempts=2)
    assert last is not None and last.attempt == 2
    assert queue.worker_died(job, max_attempts=2, delay_s=0) is None  # attempt 1's token
    assert queue.file_row(file_id)["status"] == "processing"  # type: ignore[index]
    assert queue.worker_died(last, max_attempts=2, delay_s=0) == "rejected"
    row = queue.file_row(file_id)
    assert row is not None and row["error_code"] == "attempts_exhausted"
    assert events(queue, file_id) == [
        ("worker_died", 1), ("retry", 1),
        ("worker_died", 1), ("lease_lost", 1),
        ("worker_died", 2), ("rejected", 2),
    ]  # fmt: skip


def test_permanent_failure_rejects_with_code(queue: QueueDB) -> None:
    (file_id,) = queue.enqueue([("originals/a", "1")])
    job = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert job is not None
    assert queue.fail(job, retry=False, code="corrupt_content", max_attempts=3) == "rejected"
    row = queue.file_row(file_id)
    assert row is not None and row["error_code"] == "corrupt_content"
    assert row["lease_token"] is None


def test_transient_failure_retries_with_delay_then_rejects_at_cap(queue: QueueDB) -> None:
    (file_id,) = queue.enqueue([("originals/a", "1")])
    for attempt in (1, 2):
        job = claim_one(queue, lease_s=LONG, max_attempts=3)
        assert job is not None and job.attempt == attempt
        status = queue.fail(job, retry=True, code="processing_failed", max_attempts=3, delay_s=30)
        assert status == "queued"
        assert claim_one(queue, lease_s=LONG, max_attempts=3) is None  # delayed 30 s
        queue.conn.execute(
            "UPDATE archive_files SET available_at = now() WHERE id = %s", (file_id,)
        )
    job = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert job is not None and job.attempt == 3
    assert queue.fail(job, retry=True, code="processing_failed", max_attempts=3) == "rejected"
    row = queue.file_row(file_id)
    assert row is not None and row["error_code"] == "processing_failed"


def test_release_does_not_burn_an_attempt(queue: QueueDB) -> None:
    (file_id,) = queue.enqueue([("originals/a", "1")])
    job = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert job is not None
    assert queue.release(job) is True
    row = queue.file_row(file_id)
    assert row is not None and row["status"] == "queued" and row["attempts"] == 0
    again = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert again is not None and again.attempt == 1


def test_expired_lease_at_the_cap_is_rejected_not_reclaimed(queue: QueueDB) -> None:
    (file_id,) = queue.enqueue([("originals/a", "1")])
    for _ in range(2):
        assert claim_one(queue, lease_s=LONG, max_attempts=2) is not None
        expire_lease(queue, file_id)
    assert claim_one(queue, lease_s=LONG, max_attempts=2) is None
    assert queue.reject_exhausted(max_attempts=2) == [file_id]
    row = queue.file_row(file_id)
    assert row is not None and row["status"] == "rejected"
    assert row["error_code"] == "attempts_exhausted" and row["attempts"] == 2


def refused(queue: QueueDB, statement: str, *params: object) -> str | None:
    """The name of the CHECK constraint that refuses `statement` (it must refuse)."""
    with pytest.raises(psycopg.errors.CheckViolation) as caught:
        queue.conn.execute(statement, params)
    return caught.value.diag.constraint_name


@pytest.mark.parametrize(
    ("assignment", "constraint"),
    [
        ("status = 'rejected'", "archive_files_rejected_has_code"),  # without a code
        ("error_code = 'corrupt_content'", "archive_files_rejected_has_code"),  # queued
        ("attempts = -1", "archive_files_attempts_check"),
        ("status = 'bogus'", "derivd_status_check"),  # the vocabulary's domain
        ("error_code = 'bogus', status = 'rejected'", "derivd_error_code_check"),
        ("priority = 101", "derivd_priority_check"),
        ("tenant = ''", "derivd_tenant_check"),
        ("original_width = 10", "archive_files_original_check"),  # all or nothing
    ],
)
def test_each_rule_of_the_one_row_check_refuses_under_its_own_name(
    queue: QueueDB, assignment: str, constraint: str
) -> None:
    """Migration 0020 made archive_files' CHECKs one function call: each rule still
    refuses a row that breaks it, under the name it had as a CHECK of its own."""
    (file_id,) = queue.enqueue([("originals/a", "1")])
    statement = f"UPDATE archive_files SET {assignment} WHERE id = %s"
    assert refused(queue, statement, file_id) == constraint


def test_a_lease_token_exists_exactly_while_a_row_is_processing(queue: QueueDB) -> None:
    """The fence is `id + lease_token` (sql/functions.sql): the lease CHECK makes a token
    match mean `status = 'processing'` too. No write can break that equivalence."""
    (file_id,) = queue.enqueue([("originals/a", "1")])
    token = "00000000-0000-4000-8000-000000000001"
    lease = "archive_files_lease_check"
    assert (
        refused(
            queue,  # a token on a queued row
            "UPDATE archive_files SET lease_token = %s, lease_until = now() WHERE id = %s",
            token,
            file_id,
        )
        == lease
    )
    job = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert job is not None
    for leaving in ("ready", "rejected", "queued", "deleting"):  # keeping its token
        assert (
            refused(
                queue,
                "UPDATE archive_files SET status = %s,"
                " error_code = CASE WHEN %s = 'rejected' THEN 'corrupt_content' END WHERE id = %s",
                leaving,
                leaving,
                file_id,
            )
            == lease
        ), leaving
    assert (
        refused(
            queue,  # processing without a token
            "UPDATE archive_files SET lease_token = NULL WHERE id = %s",
            file_id,
        )
        == lease
    )


def test_database_enforces_closed_error_codes_and_states(queue: QueueDB) -> None:
    """Each vocabulary is a domain (migration 0010) that the tables' CHECKs cast to."""
    (file_id,) = queue.enqueue([("originals/a", "1")])
    bad_code = "UPDATE archive_files SET status = 'rejected', error_code = 'oops' WHERE id = %s"
    assert refused(queue, bad_code, file_id) == "derivd_error_code_check"
    bad_status = "UPDATE archive_files SET status = 'done' WHERE id = %s"
    assert refused(queue, bad_status, file_id) == "derivd_status_check"
    event = "INSERT INTO archive_events (file_id, kind, error_code) VALUES (%s, %s, %s)"
    assert refused(queue, event, file_id, "finished", None) == "derivd_event_kind_check"
    assert refused(queue, event, file_id, "rejected", "oops") == "derivd_error_code_check"
    queue.conn.execute(event, (file_id, "rejected", "corrupt_content"))  # in the vocabulary
    job = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert job is not None and queue.release(job)  # leaves a `released` event
    with pytest.raises(psycopg.errors.RaiseException):
        queue.conn.execute("DELETE FROM archive_events")
    with pytest.raises(psycopg.errors.RaiseException):
        queue.conn.execute("TRUNCATE archive_events")


def _claim_all(dsn: str, results: multiprocessing.Queue[list[int]]) -> None:
    claimed: list[int] = []
    with QueueDB.open(dsn) as queue:
        while (job := claim_one(queue, lease_s=LONG, max_attempts=3)) is not None:
            claimed.append(job.id)
    results.put(claimed)


def test_four_processes_never_claim_the_same_row_twice(queue: QueueDB, dsn: str) -> None:
    ids = queue.enqueue([(f"originals/{n}", "1") for n in range(200)])
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[list[int]] = ctx.Queue()
    procs = [ctx.Process(target=_claim_all, args=(dsn, results)) for _ in range(4)]
    for proc in procs:
        proc.start()
    claimed = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    every = [file_id for chunk in claimed for file_id in chunk]
    duplicates = [file_id for file_id, n in Counter(every).items() if n > 1]
    assert duplicates == []
    assert sorted(every) == sorted(ids)


def test_claim_time_comes_from_the_database(queue: QueueDB) -> None:
    (file_id,) = queue.enqueue([("originals/a", "1")])
    before = queue.conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    time.sleep(0.01)
    job = claim_one(queue, lease_s=120, max_attempts=3)
    assert job is not None
    row = queue.file_row(file_id)
    assert row is not None
    lease = (row["lease_until"] - row["claimed_at"]).total_seconds()
    assert lease == pytest.approx(120, abs=0.001)
    assert row["claimed_at"] > before


# ----------------------------------------------------------------- batched claim / commit


def test_batch_claim_gives_each_row_its_own_token_and_lease(queue: QueueDB) -> None:
    ids = queue.enqueue([(f"originals/{n}", "1") for n in range(5)])
    jobs = queue.claim_many(limit=3, lease_s=LONG, max_attempts=3)
    assert [j.id for j in jobs] == ids[:3]  # oldest due rows, in claim order
    assert len({j.token for j in jobs}) == 3
    for job in jobs:
        row = queue.file_row(job.id)
        assert row is not None
        assert (row["status"], row["lease_token"], row["attempts"]) == ("processing", job.token, 1)
        assert row["lease_until"] > row["claimed_at"]
    rest = queue.claim_many(limit=10, lease_s=LONG, max_attempts=3)
    assert [j.id for j in rest] == ids[3:]
    assert queue.claim_many(limit=10, lease_s=LONG, max_attempts=3) == []


def test_batch_claim_takes_expired_leases_first(queue: QueueDB) -> None:
    first, second, third = queue.enqueue([(f"originals/{n}", "1") for n in range(3)])
    [stale] = queue.claim_many(limit=1, lease_s=LONG, max_attempts=3)
    assert stale.id == first
    expire_lease(queue, first)
    jobs = queue.claim_many(limit=2, lease_s=LONG, max_attempts=3)
    assert [(j.id, j.attempt) for j in jobs] == [(first, 2), (second, 1)]
    assert jobs[0].token != stale.token
    row = queue.file_row(third)
    assert row is not None and row["status"] == "queued"


def test_batched_commit_is_fenced_per_row(queue: QueueDB) -> None:
    a, b, c = queue.enqueue([(f"originals/{n}", "1") for n in range(3)])
    jobs = queue.claim_many(limit=3, lease_s=LONG, max_attempts=3)
    assert [j.id for j in jobs] == [a, b, c]
    expire_lease(queue, b)
    [thief] = queue.claim_many(limit=1, lease_s=LONG, max_attempts=3)  # b's lease, stolen
    assert thief.id == b
    committed = queue.commit_many(
        [Finished(job, [variant(key=f"derived/{job.id}/{job.token}/preview.webp")]) for job in jobs]
    )
    assert committed == {a, c}
    for file_id in (a, c):
        row = queue.file_row(file_id)
        assert row is not None and row["status"] == "ready" and row["lease_token"] is None
        assert row["derived_key"].startswith(f"derived/{file_id}/")
        assert events(queue, file_id) == [("ready", 1)]
        assert [v.name for v in queue.file_variants(file_id)] == ["preview"]
    row = queue.file_row(b)
    assert row is not None
    assert (row["status"], row["lease_token"]) == ("processing", thief.token)
    assert events(queue, b) == [("lease_lost", 1)]
    assert queue.file_variants(b) == []
    # The thief's own commit still passes its fence.
    assert queue.commit_many([Finished(thief, [])]) == {b}


def test_commit_and_claim_commits_fenced_and_claims_the_next_rows(queue: QueueDB) -> None:
    a, b, c, d = queue.enqueue([(f"originals/{n}", "1") for n in range(4)])
    first, second = queue.claim_many(limit=2, lease_s=LONG, max_attempts=3)
    assert (first.id, second.id) == (a, b)
    expire_lease(queue, b)
    [thief] = queue.claim_many(limit=1, lease_s=LONG, max_attempts=3)  # b, stolen
    expire_lease(queue, a)  # expired but still ours: the commit must not reclaim it
    committed, claimed = queue.commit_and_claim(
        [
            Finished(first, [variant(key=f"derived/{a}/{first.token}/preview.webp")]),
            Finished(second, []),
        ],
        limit=2,
        lease_s=LONG,
        max_attempts=3,
    )
    assert committed == {a}
    assert [j.id for j in claimed] == [c, d]  # oldest due first, the committed row left alone
    assert len({j.token for j in claimed} | {first.token, thief.token}) == 4
    row = queue.file_row(a)
    assert row is not None and (row["status"], row["lease_token"]) == ("ready", None)
    assert events(queue, a) == [("ready", 1)]
    assert [v.name for v in queue.file_variants(a)] == ["preview"]
    row = queue.file_row(b)  # the thief keeps it: the stale attempt changed nothing
    assert row is not None and (row["status"], row["lease_token"]) == ("processing", thief.token)
    assert events(queue, b) == [("lease_lost", 1)]
    for job in claimed:
        row = queue.file_row(job.id)
        assert row is not None and (row["status"], row["lease_token"]) == ("processing", job.token)
        assert row["attempts"] == job.attempt == 1
    # The new leases fence like any claim: an empty commit_and_claim still commits them.
    committed, claimed = queue.commit_and_claim(
        [Finished(j, []) for j in claimed], limit=1, lease_s=LONG, max_attempts=3
    )
    assert committed == {c, d} and claimed == []


def test_query_blocks_lose_their_description_but_keep_inline_comments() -> None:
    from derivd.queue.sqlfiles import parse_blocks, queries

    blocks = parse_blocks(
        "-- name: one\n-- what it is for\n-- more words\nSELECT 1 -- why\n  FROM t;\n"
        "-- name: two\nSELECT 2;\n"
    )
    assert blocks == {"one": "SELECT 1 -- why\n  FROM t;", "two": "SELECT 2;"}
    assert all(not q.startswith("--") for q in queries().values())
    with pytest.raises(ValueError, match="duplicate"):
        parse_blocks("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")


def test_the_commit_and_the_claim_each_have_one_body_the_others_compose_them(
    queue: QueueDB,
) -> None:
    """One copy of each: derivd_commit_outcomes holds the commit (each id's outcome:
    committed, a re-derivation rejected, lost), derivd_claim (with the tenant
    cap, migration 0014, and the write-ahead prefix) the claim, the expired-lease rule
    written once in it; the worker's `commit_and_claim` composes the two in one
    statement, commit first, and the older signatures (derivd_commit_and_claim and
    derivd_commit included) wrap them, with no statement of their own on the tables."""
    composed = queries()["commit_and_claim"]
    assert composed.index("derivd_commit_outcomes(") < composed.index("derivd_claim(")
    assert "derivd_commit_and_claim" not in composed
    assert "derivd_commit_outcomes(" in queries()["commit"]
    assert "derivd_claim(" in queries()["claim"]
    rows = queue.conn.execute(
        "SELECT proname, pronargs, prosrc FROM pg_proc WHERE proname = ANY(%s)",
        (["derivd_commit_and_claim", "derivd_commit", "derivd_commit_outcomes", "derivd_claim"],),
    ).fetchall()
    body = {(str(name), int(n)): str(src) for name, n, src in rows}
    commit = body.pop(("derivd_commit_outcomes", 1))
    claim = body.pop(("derivd_claim", 6))
    assert "UPDATE archive_files" in commit and "derivd_claim" not in commit
    assert "UPDATE archive_files" in claim and "derivd_commit" not in claim
    assert claim.count("lease_until < now()") == 1
    wrapped = body.pop(("derivd_commit_and_claim", 6))
    assert wrapped.index("derivd_commit_outcomes(") < wrapped.index("derivd_claim(")
    assert set(body) == {
        ("derivd_commit_and_claim", 5),
        ("derivd_commit", 1),
        ("derivd_claim", 4),
        ("derivd_claim", 5),
    }
    for wrapper, src in [(("derivd_commit_and_claim", 6), wrapped), *body.items()]:
        assert "derivd_commit" in src or "derivd_claim(" in src, wrapper
        assert "archive_" not in src, wrapper


def test_commit_alone_and_claim_alone_do_only_their_half(queue: QueueDB) -> None:
    """Through the wrappers: a commit claims nothing, a claim commits nothing."""
    queue.enqueue([(f"originals/{n}", "1") for n in range(3)])
    [job] = queue.claim_many(limit=1, lease_s=LONG, max_attempts=3)
    assert queue.commit_many([Finished(job, [])]) == {job.id}
    counts = queue.conn.execute(
        "SELECT count(*) FILTER (WHERE status = 'processing'),"
        " count(*) FILTER (WHERE status = 'ready') FROM archive_files"
    ).fetchone()
    assert counts == (0, 1)
    assert len(queue.claim_many(limit=5, lease_s=LONG, max_attempts=3)) == 2


def test_a_claim_alone_skips_the_flush_wait_but_with_a_commit_it_is_durable(
    queue: QueueDB,
) -> None:
    """The claim statement alone commits without waiting for its WAL flush; the commit
    of a batch with the claim of the next one is durable (the commit needs it)."""
    queue.enqueue([(f"originals/{n}", "1") for n in range(3)])
    [job] = queue.claim_many(limit=1, lease_s=LONG, max_attempts=3)

    def setting() -> str:
        row = queue.conn.execute("SHOW synchronous_commit").fetchone()
        assert row is not None
        return str(row[0])

    queue.conn.autocommit = False
    try:
        queue.conn.execute("SET LOCAL synchronous_commit = on")  # the test cluster has off
        committed, claimed = queue.commit_and_claim(
            [Finished(job, [])], limit=1, lease_s=LONG, max_attempts=3
        )
        assert committed == {job.id} and len(claimed) == 1
        assert setting() == "on"
        queue.conn.rollback()
        queue.conn.execute("SET LOCAL synchronous_commit = on")
        assert len(queue.claim_many(limit=1, lease_s=LONG, max_attempts=3)) == 1
        assert setting() == "off"
        queue.conn.rollback()
    finally:
        queue.conn.autocommit = True


def test_queue_stats_are_shared_for_max_age_and_estimated_on_a_big_table(
    queue: QueueDB,
) -> None:
    queue.enqueue([("originals/a", "1")])
    assert queue.queue_stats().counts == {"queued": 1}  # max_age 0: computed now, exact
    queue.enqueue([("originals/b", "1")])
    # Another host's result younger than max_age is reused as it is.
    assert queue.queue_stats(max_age_s=3600).counts == {"queued": 1}
    assert queue.queue_stats().counts == {"queued": 2}
    queue.conn.execute(
        "INSERT INTO archive_files (status, original_key, original_version, finished_at)"
        " SELECT 'ready', 'originals/old', '1', now() FROM generate_series(1, 60000)"
    )
    queue.conn.execute("ANALYZE archive_files")
    stats = queue.queue_stats()
    assert stats.estimated == ("ready", "rejected", "deleted")
    assert stats.counts["queued"] == 2  # the live states stay exact
    assert 50_000 < stats.counts["ready"] < 70_000
    assert stats.oldest_claimable_age_s is not None and stats.expired_leases == 0
