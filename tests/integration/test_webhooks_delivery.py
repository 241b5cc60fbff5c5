"""Delivery against a real receiver on 127.0.0.1 that verifies every request
with the `standardwebhooks` library: each behaviour of a receiver ends `delivered` or
`failed` as DESIGN.md "Webhooks" says, and nothing hangs (every wait below is a liveness
bound, not a timing check). The delivering loop runs in a thread of the test here; the
supervisor's child runs the same loop (test_webhooks_daemon)."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
from fixtures.delivering import SECRET, delivering, endpoint, ready_files, rows, settled
from fixtures.receiver import Receiver, receiving
from helpers import sql, wait_for

from derivd.queue.db import QueueDB

ALL = ["file.ready", "file.rejected", "file.rederived", "file.deleted"]


def test_delivered_signed_and_deduplicated_by_webhook_id(dsn: str, queue: QueueDB) -> None:
    # The first request is reset after it arrived: its delivery comes again, same id.
    with receiving(SECRET, script=["reset"]) as receiver, delivering(dsn, endpoint(receiver.url)):
        files = ready_files(queue, 3)
        found = settled(dsn, count=3)
    assert {r["status"] for r in found} == {"delivered"}
    assert all(r.verified for r in receiver.answered()), "every signature verifies"
    unique = receiver.unique()
    assert sorted(unique) == sorted(r["webhook_id"] for r in found)
    assert sorted(u.payload["data"]["file_id"] for u in unique.values()) == sorted(files)
    reset = receiver.answered("reset")[0]
    again = [r for r in receiver.answered("ok") if r.webhook_id == reset.webhook_id]
    assert len(again) == 1 and again[0].body == reset.body
    assert again[0].headers["webhook-timestamp"] >= reset.headers["webhook-timestamp"]


def test_a_500_is_retried_until_delivered(dsn: str, queue: QueueDB) -> None:
    with (
        receiving(SECRET, script=["500", "500"]) as receiver,
        delivering(dsn, endpoint(receiver.url, retry_horizon=600)),
    ):
        ready_files(queue, 1)
        [row] = settled(dsn)
    assert (row["status"], row["attempts"]) == ("delivered", 3)


def test_429_retry_after_is_honoured_within_the_horizon(dsn: str, queue: QueueDB) -> None:
    with (
        receiving(SECRET, script=["429"], retry_after="1") as receiver,
        delivering(dsn, endpoint(receiver.url, retry_horizon=600, retry_base=3600)),
    ):
        ready_files(queue, 1)
        [row] = settled(dsn)
    # Backoff alone (base 3600 s) would not have come back within the test's bound.
    assert (row["status"], row["attempts"]) == ("delivered", 2)


def test_a_retry_after_beyond_the_horizon_fails_the_delivery(dsn: str, queue: QueueDB) -> None:
    with (
        receiving(SECRET, default="429", retry_after="3600") as receiver,
        delivering(dsn, endpoint(receiver.url, retry_horizon=600)),
    ):
        ready_files(queue, 1)
        [row] = settled(dsn)
    assert (row["status"], row["attempts"], row["last_status"]) == ("failed", 1, 429)


@pytest.mark.parametrize(
    ("behaviour", "status", "error"),
    [
        ("500", 500, "http 500"),
        ("302", 302, "http 302"),
        ("reset", None, "connection reset"),
        ("slow", None, "timeout"),
        ("trickle", None, "timeout"),
    ],
)
def test_failures_retry_until_the_horizon_then_fail(
    dsn: str, queue: QueueDB, behaviour: str, status: int | None, error: str
) -> None:
    with (
        receiving(SECRET, default=behaviour) as receiver,
        delivering(dsn, endpoint(receiver.url, timeout=0.5)),
    ):
        ready_files(queue, 1)
        [row] = settled(dsn)
    assert (row["status"], row["last_status"], row["last_error"]) == ("failed", status, error)
    assert row["attempts"] >= 1
    assert receiver.answered("followed") == [], "a redirect is never followed"


def test_410_stops_at_once(dsn: str, queue: QueueDB) -> None:
    with (
        receiving(SECRET, default="410") as receiver,
        delivering(dsn, endpoint(receiver.url, retry_horizon=600)),
    ):
        ready_files(queue, 1)
        [row] = settled(dsn)
    assert (row["status"], row["attempts"], row["last_status"]) == ("failed", 1, 410)


def test_a_30_mb_answer_is_read_no_further_than_the_cap(dsn: str, queue: QueueDB) -> None:
    with receiving(SECRET, default="huge") as receiver, delivering(dsn, endpoint(receiver.url)):
        ready_files(queue, 1)
        [row] = settled(dsn)
    assert (row["status"], row["last_status"]) == ("delivered", 200)


def test_a_receiver_that_is_down_fails_past_the_horizon(dsn: str, queue: QueueDB) -> None:
    # A port bound and never listened on: connections are refused, and no other test's
    # receiver can take the port meanwhile (one stopped and its port freed was, under
    # pytest -n 2, sometimes another test's receiver answering 500).
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}/hooks"
        with delivering(dsn, endpoint(url)):
            ready_files(queue, 1)
            [row] = settled(dsn)
    assert (row["status"], row["last_error"]) == ("failed", "connection refused")


def test_a_receiver_back_up_gets_what_it_missed(dsn: str, queue: QueueDB) -> None:
    receiver = Receiver(SECRET).start()
    receiver.stop()
    with delivering(dsn, endpoint(receiver.url, retry_horizon=600, retry_base=0.2)):
        ready_files(queue, 2)
        wait_for(lambda: all(r["attempts"] >= 1 for r in rows(dsn)) and len(rows(dsn)) == 2,
                 "attempts against the dead receiver")  # fmt: skip
        receiver.start()  # same port
        found = settled(dsn, count=2)
        receiver.stop()
    assert {r["status"] for r in found} == {"delivered"}
    assert len(receiver.unique()) == 2


def test_a_failing_endpoint_backs_off_as_a_whole_and_slows_no_other(
    dsn: str, queue: QueueDB
) -> None:
    dead = Receiver(SECRET).start()
    dead.stop()
    with (
        receiving(SECRET) as good,
        delivering(
            dsn,
            endpoint(dead.url, name="dead", retry_horizon=600, retry_base=0.05),
            endpoint(good.url, name="good"),
        ),
    ):
        ready_files(queue, 8)
        settled(dsn, "good", count=8)

        def paused() -> list[dict[str, Any]]:
            return sql(dsn, "SELECT failures, paused_until FROM derivd_webhook_endpoints"
                            " WHERE name = 'dead' AND paused_until > now()")  # fmt: skip

        [circuit] = wait_for(paused, "the dead endpoint's circuit to open")
    assert circuit["failures"] >= 5
    assert len(good.unique()) == 8
    assert {r["status"] for r in rows(dsn, "dead")} == {"pending"}


def test_two_hosts_never_post_one_event_at_the_same_time(dsn: str, queue: QueueDB) -> None:
    """Two deliverers (two hosts) on one outbox: each event is POSTed once, never by
    both at once (the claim's SKIP LOCKED and lease), and all of them are delivered."""
    in_flight: set[str] = set()
    overlaps: list[str] = []
    lock = threading.Lock()
    with receiving(SECRET) as receiver:
        record = receiver.record

        def watched(item: Any) -> None:
            with lock:
                if item.webhook_id in in_flight:
                    overlaps.append(item.webhook_id)
                in_flight.add(item.webhook_id)
            record(item)
            receiver.release.wait(0.05)  # hold the request open a moment: room to overlap
            with lock:
                in_flight.discard(item.webhook_id)

        receiver.record = watched  # type: ignore[method-assign]
        one = endpoint(receiver.url, concurrency=4)
        with delivering(dsn, one), delivering(dsn, one):
            ready_files(queue, 20)
            found = settled(dsn, count=20)
    assert {r["status"] for r in found} == {"delivered"}
    assert overlaps == []
    ids = [r.webhook_id for r in receiver.answered()]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 20
