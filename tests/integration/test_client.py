"""derivd.client on real PostgreSQL: enqueue, wait (the `derivd_finished` notification,
including a file that finished before wait began listening) and result, on caller-owned
connections in autocommit mode and not."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from fixtures.work import claim_one, commit_one

from derivd import client
from derivd.queue.db import QueueDB, StoredVariant

LONG = 60.0


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


def _variants(file_id: int) -> list[StoredVariant]:
    return [
        StoredVariant(
            "large", f"derived/{file_id}/t/large.webp", "v-large", "cd" * 32, 800, 600, bytes=5120
        ),
        # No size recorded: as stored before migration 0019.
        StoredVariant(
            "thumb",
            f"derived/{file_id}/t/thumb.avif",
            "v-thumb",
            "ab" * 32,
            200,
            150,
            "avif",
            "image/avif",
        ),
    ]


def _finish(queue: QueueDB, file_id: int, *, ok: bool = True) -> None:
    """What a worker does: claim the row, then commit it (or reject it)."""
    job = claim_one(queue, lease_s=LONG, max_attempts=3)
    assert job is not None and job.id == file_id
    if ok:
        assert commit_one(queue, job, _variants(file_id))
    else:
        assert queue.fail(job, retry=False, code="corrupt_content", max_attempts=3) == "rejected"


def _row(dsn: str, file_id: int) -> tuple[Any, ...] | None:
    with psycopg.connect(dsn) as other:
        return other.execute(
            "SELECT status, original_key, original_version FROM archive_files WHERE id = %s",
            (file_id,),
        ).fetchone()


def test_enqueue_inserts_a_queued_row(conn: psycopg.Connection[Any], dsn: str) -> None:
    file_id = client.enqueue(conn, "originals/abc", "ver-1")
    assert _row(dsn, file_id) == ("queued", "originals/abc", "ver-1")
    assert client.enqueue(conn, "originals/def", "ver-2") > file_id


@pytest.mark.parametrize("version", [None, "", "   "])
def test_enqueue_refuses_a_missing_version(
    conn: psycopg.Connection[Any], dsn: str, version: Any
) -> None:
    with pytest.raises(client.MissingVersion, match="original_version is required"):
        client.enqueue(conn, "originals/abc", version)
    assert conn.execute("SELECT count(*) FROM archive_files").fetchone() == (0,)


@pytest.mark.parametrize("key", ["../../etc/passwd", "/abs.jpg", "My Photo.jpg", "a\x00b"])
def test_enqueue_refuses_a_key_derivd_could_never_read(
    conn: psycopg.Connection[Any], key: str
) -> None:
    """The stores' own rule (derivd.storage.base.validate_key): such a row would only
    ever end `missing_original`."""
    with pytest.raises(client.InvalidKey, match="key"):
        client.enqueue(conn, key, "ver-1")
    assert conn.execute("SELECT count(*) FROM archive_files").fetchone() == (0,)


def test_the_batch_enqueue_of_derivd_enqueue_applies_the_same_rule(
    queue: QueueDB, conn: psycopg.Connection[Any]
) -> None:
    """`derivd enqueue` (and the demo) queue through QueueDB.enqueue: one refused key
    queues nothing of its batch."""
    with pytest.raises(client.InvalidKey, match="not allowed"):
        queue.enqueue([("originals/fine", "v1"), ("uploads/My Photo.jpg", "v1")])
    assert conn.execute("SELECT count(*) FROM archive_files").fetchone() == (0,)


# The registration any language sends before waiting (docs/integrating.md, "From any
# other language").
REGISTER = (
    "INSERT INTO derivd_waiters (file_id, waiter, until)"
    " VALUES (%s, gen_random_uuid(), now() + interval '1 minute')"
)


def test_the_finished_notification_carries_the_id_only(
    conn: psycopg.Connection[Any], queue: QueueDB
) -> None:
    file_id = client.enqueue(conn, "originals/a", "v")
    conn.execute(REGISTER, (file_id,))
    conn.execute("LISTEN derivd_finished")
    _finish(queue, file_id)
    (note,) = list(conn.notifies(timeout=10, stop_after=1))
    assert (note.channel, note.payload) == ("derivd_finished", str(file_id))


def test_only_files_someone_waits_for_are_announced(
    conn: psycopg.Connection[Any], queue: QueueDB
) -> None:
    """A commit that notifies locks the whole instance until it is flushed, so files no
    one waits for (an API that answered 202) are not announced (migration 0011).
    Notifications arrive in commit order: the awaited file's arriving first proves the
    unawaited one, finished before it, sent none."""
    unawaited = client.enqueue(conn, "originals/a", "v")
    awaited = client.enqueue(conn, "originals/b", "v")
    conn.execute(REGISTER, (awaited,))
    conn.execute("LISTEN derivd_finished")
    _finish(queue, unawaited)
    _finish(queue, awaited, ok=False)
    (note,) = list(conn.notifies(timeout=10, stop_after=1))
    assert note.payload == str(awaited)


def test_wait_removes_its_registration(conn: psycopg.Connection[Any], queue: QueueDB) -> None:
    done = client.enqueue(conn, "originals/a", "v")
    _finish(queue, done)
    pending = client.enqueue(conn, "originals/b", "v")
    assert client.wait(conn, done, timeout=60) == "ready"
    assert client.wait(conn, pending, timeout=0.2) is None
    assert conn.execute("SELECT count(*) FROM derivd_waiters").fetchone() == (0,)


def test_wait_sees_a_finish_that_raced_its_registration(
    dsn: str, queue: QueueDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row is finished by a statement that ran before wait() registered (so it is not
    announced) and committed after wait() read the row: the periodic re-read sees it."""
    monkeypatch.setattr(client, "RECHECK_S", 0.2)
    # Closed only once wait() has returned: closing it under a wait that never ends
    # would block the test instead of failing it.
    conn = psycopg.connect(dsn, autocommit=True)
    with psycopg.connect(dsn) as finisher:
        file_id = client.enqueue(conn, "originals/a", "v")
        job = claim_one(queue, lease_s=LONG, max_attempts=3)
        assert job is not None and job.id == file_id
        assert commit_one(QueueDB(finisher), job, [])  # inside finisher's open transaction
        thread = _when_sleeping(monkeypatch, finisher.commit)
        # An hour's deadline: only the re-read (every 0.2 s here) can end this wait.
        status: list[str | None] = []
        waiting = threading.Thread(
            target=lambda: status.append(client.wait(conn, file_id, timeout=3600)), daemon=True
        )
        waiting.start()
        waiting.join(timeout=60)
        assert status == ["ready"]
        thread.join()
    conn.close()


def test_wait_returns_at_once_when_the_file_finished_before(
    conn: psycopg.Connection[Any], queue: QueueDB
) -> None:
    ready = client.enqueue(conn, "originals/a", "v")
    _finish(queue, ready)
    rejected = client.enqueue(conn, "originals/b", "v")
    _finish(queue, rejected, ok=False)
    # Had wait relied on a notification, it would time out (None) and fail here.
    assert client.wait(conn, ready, timeout=60) == "ready"
    assert client.wait(conn, rejected, timeout=60) == "rejected"


def test_wait_on_an_unknown_id_raises_at_once(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(client.UnknownFile, match="no file with id 424242"):
        client.wait(conn, 424242, timeout=60)
    assert _listening(conn) == []


def test_wait_times_out_with_none(conn: psycopg.Connection[Any]) -> None:
    file_id = client.enqueue(conn, "originals/a", "v")
    assert client.wait(conn, file_id, timeout=0.3) is None
    assert client.wait(conn, file_id, timeout=0) is None
    assert _listening(conn) == []


def _listening(conn: psycopg.Connection[Any]) -> list[str]:
    return [r[0] for r in conn.execute("SELECT pg_listening_channels()")]


def _when_sleeping(monkeypatch: pytest.MonkeyPatch, then: Callable[[], None]) -> threading.Thread:
    """Run `then` (in a thread) once wait() has read a non-final status and goes to sleep
    on its connection: from then on it can only learn of the finish by notification."""
    sleeping = threading.Event()
    real = client._notified

    def notified(conn: psycopg.Connection[Any], file_id: int, timeout: float) -> bool:
        sleeping.set()
        return real(conn, file_id, timeout)

    monkeypatch.setattr(client, "_notified", notified)

    def finisher() -> None:
        sleeping.wait()
        then()

    thread = threading.Thread(target=finisher, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("autocommit", [True, False])
def test_wait_learns_a_later_finish_from_the_notification(
    dsn: str, queue: QueueDB, autocommit: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(dsn, autocommit=autocommit) as conn:
        other = client.enqueue(conn, "originals/other", "v")
        file_id = client.enqueue(conn, "originals/mine", "v")
        if not autocommit:
            conn.commit()

        def finish_both() -> None:
            _finish(queue, other)  # another file's notification must not end the wait
            _finish(queue, file_id, ok=False)

        thread = _when_sleeping(monkeypatch, finish_both)
        assert client.wait(conn, file_id, timeout=60) == "rejected"
        thread.join()
        # The connection is left as found: idle, listening to nothing.
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert _listening(conn) == []


def test_non_autocommit_enqueue_is_the_callers_transaction(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        file_id = client.enqueue(conn, "originals/a", "v")
        assert _row(dsn, file_id) is None, "visible before the caller committed"
        with pytest.raises(client.ConnectionBusy, match="outside any transaction"):
            client.wait(conn, file_id, timeout=60)
        conn.commit()
        assert _row(dsn, file_id) == ("queued", "originals/a", "v")
        assert client.wait(conn, file_id, timeout=0) is None
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        done = client.result(conn, file_id)
        assert (done.status, done.error_code, done.variants) == ("queued", None, ())
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_result_lists_every_variant(conn: psycopg.Connection[Any], queue: QueueDB) -> None:
    file_id = client.enqueue(conn, "originals/a", "v")
    _finish(queue, file_id)
    done = client.result(conn, file_id)
    assert (done.id, done.status, done.error_code) == (file_id, "ready", None)
    assert done.variants == (
        client.Variant(
            "large",
            f"derived/{file_id}/t/large.webp",
            "v-large",
            "webp",
            800,
            600,
            "cd" * 32,
            5120,
        ),
        client.Variant(
            "thumb", f"derived/{file_id}/t/thumb.avif", "v-thumb", "avif", 200, 150, "ab" * 32
        ),
    )


def test_result_of_a_rejected_file_has_its_code(
    conn: psycopg.Connection[Any], queue: QueueDB
) -> None:
    file_id = client.enqueue(conn, "originals/a", "v")
    _finish(queue, file_id, ok=False)
    done = client.result(conn, file_id)
    assert (done.status, done.error_code, done.variants) == ("rejected", "corrupt_content", ())
    with pytest.raises(client.UnknownFile):
        client.result(conn, file_id + 1000)
