"""What a receiver can rely on (DESIGN.md "Webhooks"), against a real receiver that
verifies every request with the `standardwebhooks` library: a webhook-id no other
database sends, one file's events in the order they happened, and an endpoint circuit
that probes one POST at a time, grows its pause with failed probes only, and lets the
backlog flow at once on the first success. Every wait is a liveness bound; the outage's
minute is the database's time, moved forward by the test (no test sleeps through it)."""

from __future__ import annotations

import itertools
import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from configs import write_ini
from fixtures.delivering import SECRET, delivering, endpoint, ready_files, rows, settled
from fixtures.receiver import Received, Receiver, receiving
from helpers import sql, wait_for

from derivd.queue.db import QueueDB, migrate
from derivd.queue.webhook_queries import Circuit

OUTAGE_S = 60.0


def test_two_databases_never_send_the_same_webhook_id(
    dsn: str, queue: QueueDB, pg_cluster: Any, pg_template: str
) -> None:
    """Staging beside production, or a rebuilt database: the first event of each is not
    `msg_1` twice."""
    other = "webhook_ids_other"
    pg_cluster.drop_database(other)
    pg_cluster.create_database(other, template=pg_template)
    try:
        other_dsn = pg_cluster.dsn(other)
        migrate(other_dsn)
        with QueueDB.open(other_dsn) as second, receiving(SECRET) as receiver:
            with delivering(dsn, endpoint(receiver.url)):
                ready_files(queue, 2)
                settled(dsn, count=2)
            with delivering(other_dsn, endpoint(receiver.url)):
                ready_files(second, 2)
                settled(other_dsn, count=2)
    finally:
        pg_cluster.drop_database(other)
    ids = [r.webhook_id for r in receiver.answered()]
    assert len(ids) == 4 and len(set(ids)) == 4, ids
    assert all(r.verified for r in receiver.answered())


def test_a_retry_and_a_replay_keep_the_webhook_id(dsn: str, queue: QueueDB) -> None:
    with (
        receiving(SECRET, script=["500"]) as receiver,
        delivering(dsn, endpoint(receiver.url, retry_horizon=600)),
    ):
        ready_files(queue, 1)
        [row] = settled(dsn)
        assert queue.replay_deliveries(failed_only=False) == 1
        wait_for(lambda: len(receiver.answered("ok")) == 2, "the replay's delivery")
    sent = {r.webhook_id for r in receiver.answered()}
    assert sent == {row["webhook_id"]}, "the first attempt, its retry and the replay"


def _ready_then_deleted(queue: QueueDB) -> int:
    [file_id] = ready_files(queue, 1)
    assert queue.request_delete([file_id], actor="test") == [file_id]
    assert queue.mark_deleted(file_id)
    return file_id


def test_a_files_events_arrive_in_the_order_they_happened(dsn: str, queue: QueueDB) -> None:
    """Receiver down, the file ready then deleted: on recovery `file.ready` arrives (and
    is answered) before `file.deleted` is ever sent, and its sequence is smaller."""
    receiver = Receiver(SECRET).start()
    receiver.stop()  # down; started again on the same port below
    hook = endpoint(receiver.url, retry_horizon=600, retry_base=0.2, circuit_max=0.5)
    with delivering(dsn, hook):
        file_id = _ready_then_deleted(queue)
        wait_for(lambda: any(r["attempts"] >= 2 for r in rows(dsn)), "retries while down")
        attempted = {r["webhook_id"]: r["attempts"] for r in rows(dsn)}
        receiver.start()
        settled(dsn, count=2)
        receiver.stop()
    _, deleted = rows(dsn)
    assert attempted[deleted["webhook_id"]] == 0, "the later event waited its turn"
    got = [(r.payload["type"], r.behaviour) for r in receiver.answered()]
    assert got == [("file.ready", "ok"), ("file.deleted", "ok")]
    first, second = (r.payload["data"] for r in receiver.answered())
    assert first["file_id"] == second["file_id"] == file_id
    assert first["sequence"] < second["sequence"]


def test_one_files_events_are_never_posted_at_once(dsn: str, queue: QueueDB) -> None:
    """Receiver up, both events queued together: the second is sent only after the first
    was answered, whatever the endpoint's concurrency."""
    with receiving(SECRET) as receiver:
        overlaps = _watch_overlaps(receiver, hold_s=0.2)
        with delivering(dsn, endpoint(receiver.url, concurrency=4)):
            for _ in range(3):
                _ready_then_deleted(queue)
            settled(dsn, count=6)
    assert overlaps == []
    by_file: dict[int, list[str]] = {}
    for item in receiver.answered():
        by_file.setdefault(item.payload["data"]["file_id"], []).append(item.payload["type"])
    assert all(kinds == ["file.ready", "file.deleted"] for kinds in by_file.values()), by_file


def _watch_overlaps(receiver: Receiver, *, hold_s: float) -> list[tuple[str, str]]:
    """Hold each request `hold_s` open; record pairs of one file's events in flight at
    once."""
    in_flight: dict[str, int] = {}
    overlaps: list[tuple[str, str]] = []
    lock = threading.Lock()
    record = receiver.record

    def watched(item: Received) -> None:
        file_id = json.loads(item.body)["data"]["file_id"]
        with lock:
            overlaps.extend((item.webhook_id, other) for other, f in in_flight.items()
                            if f == file_id)  # fmt: skip
            in_flight[item.webhook_id] = file_id
        record(item)
        receiver.release.wait(hold_s)  # room to overlap, were it allowed
        with lock:
            in_flight.pop(item.webhook_id, None)

    receiver.record = watched  # type: ignore[method-assign]
    return overlaps


# -- the circuit ---------------------------------------------------------------------


def circuit(dsn: str, name: str = "app") -> dict[str, Any]:
    # The pause the last failed probe set (the opening's: from opened_at, as the POSTs
    # in flight then may fail a moment later).
    [row] = sql(dsn, "SELECT failures, probes, opened_at, probe_token,"
                     " extract(epoch FROM paused_until - CASE WHEN probes = 0 THEN opened_at"
                     " ELSE last_error_at END)::float8 AS pause_s"
                     " FROM derivd_webhook_endpoints WHERE name = %s", (name,))  # fmt: skip
    return row


def skip_the_pause(dsn: str, name: str = "app") -> None:
    """The database's clock moved on to the next probe (the test does not sleep it)."""
    sql(dsn, "UPDATE derivd_webhook_endpoints SET paused_until = now() WHERE name = %s"
             " AND paused_until > now()", (name,))  # fmt: skip


def test_a_minute_long_outage_is_probed_and_its_backlog_flows_on_recovery(
    dsn: str, queue: QueueDB, caplog: pytest.LogCaptureFixture
) -> None:
    """Defaults (retry_base 5 s, circuit_max 60 s), a dead receiver for a minute of the
    circuit's time: the pauses double with failed probes only (not with the POSTs in
    flight when it opened), never past the cap, so the first probe after recovery is due
    within a minute of it; that probe closes the circuit and the whole backlog is due at
    once and delivered; opening and closing are logged."""
    caplog.set_level(logging.INFO, logger="derivd.webhooks")
    with socket.socket() as held:  # refused until the receiver takes the port
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        receiver = Receiver(SECRET, port=port)
        hook = endpoint(receiver.url, retry_horizon=3600, retry_base=5.0, concurrency=4)
        hook_max = hook.circuit_max
        with delivering(dsn, hook):
            ready_files(queue, 12)
            opened = wait_for(lambda: circuit(dsn)["opened_at"] is not None or None,
                              "the circuit to open")  # fmt: skip
            assert opened
            elapsed, pauses = _probe_through(dsn, OUTAGE_S)
            last = circuit(dsn)
            assert last["failures"] > last["probes"] + Circuit().threshold - 1
            held.close()
            receiver.start()  # recovery, at `elapsed` of the circuit's time
            next_probe_in = sum(pauses) - elapsed
            skip_the_pause(dsn)
            found = settled(dsn, count=12)
            receiver.stop()
    base = 5.0
    assert pauses[0] == base
    assert pauses == [min(hook_max, base * 2**k) for k in range(len(pauses))]
    assert 0 < next_probe_in <= OUTAGE_S, "the first delivery within a minute of recovery"
    assert {r["status"] for r in found} == {"delivered"}
    assert circuit(dsn)["opened_at"] is None and circuit(dsn)["failures"] == 0
    assert len(receiver.unique()) == 12
    said = [r.getMessage() for r in caplog.records if r.name == "derivd.webhooks"]
    opened = said.index("webhook circuit opened: one probe at a time")
    assert said.index("webhook circuit closed: the backlog flows") > opened


def _probe_through(dsn: str, outage_s: float) -> tuple[float, list[float]]:
    """Let the probes fail until `outage_s` of the circuit's time has passed: returns that
    time and each pause it set (the opening's, then one per failed probe)."""
    pauses = [round(circuit(dsn)["pause_s"], 3)]
    while sum(pauses) <= outage_s:
        probes = circuit(dsn)["probes"]
        skip_the_pause(dsn)
        row = wait_for(lambda seen=probes: (r := circuit(dsn))["probes"] > seen and r,
                       "the next probe to fail")  # fmt: skip
        assert row["probes"] == probes + 1, "one probe at a time"
        pauses.append(round(row["pause_s"], 3))
    return sum(pauses[:-1]) + 1e-9, pauses


def test_while_open_one_probe_goes_out_at_a_time(dsn: str, queue: QueueDB) -> None:
    with receiving(SECRET, default="500") as receiver:
        starts: list[tuple[float, float]] = []
        record = receiver.record

        def held(item: Received) -> None:
            began = time.time()
            record(item)
            receiver.release.wait(0.3)
            starts.append((began, time.time()))

        receiver.record = held  # type: ignore[method-assign]
        hook = endpoint(receiver.url, retry_horizon=600, retry_base=0.1, circuit_max=0.2,
                        concurrency=4)  # fmt: skip
        with delivering(dsn, hook):
            ready_files(queue, 12)
            wait_for(lambda: circuit(dsn)["probes"] >= 8 or None, "eight failed probes")
            [opened] = sql(dsn, "SELECT extract(epoch FROM opened_at)::float8 AS t"
                                " FROM derivd_webhook_endpoints")  # fmt: skip
    # The POSTs in flight when it opened end within their hold; after that, probes only.
    probes = sorted(s for s in list(starts) if s[0] > opened["t"] + 1.0)
    assert len(probes) >= 2
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(probes)), probes


# -- closing it: a test event, or by hand; where its state shows ---------------------


def _open_with_a_backlog(dsn: str) -> None:
    """An open circuit whose next probe is far off, its backlog's own retries too."""
    sql(dsn, "UPDATE derivd_webhook_endpoints SET failures = 7, probes = 2,"
             " opened_at = now(), paused_until = now() + interval '50 seconds',"
             " last_error = 'connection refused', last_error_at = now()")  # fmt: skip
    sql(dsn, "UPDATE derivd_deliveries SET available_at = now() + interval '1 hour'")


def _cli_ini(tmp_path: Path, dsn: str, url: str) -> Path:
    return write_ini(tmp_path / "derivd.ini", {
        "database": {"dsn": dsn},
        "storage": {"backend": "fs", "root": tmp_path / "objects"},
        "webhook:app": {"url": url, "secret": SECRET},
    })  # fmt: skip


def _due_now(dsn: str) -> bool:
    [row] = sql(dsn, "SELECT bool_and(available_at <= now()) AS due FROM derivd_deliveries")
    return bool(row["due"])


def test_the_circuit_shows_in_list_and_status_and_resume_closes_it(
    dsn: str, queue: QueueDB, tmp_path: Path, run_cli: Any
) -> None:
    path = _cli_ini(tmp_path, dsn, "http://127.0.0.1:9/hooks")
    queue.sync_webhook_endpoints([endpoint("http://x/").subscription()])
    ready_files(queue, 2)
    _open_with_a_backlog(dsn)
    listed = json.loads(run_cli("-c", str(path), "webhooks", "list", "--json").stdout)
    [shown] = listed["endpoints"]
    assert (shown["circuit"], shown["failed_probes"]) == ("open", 2)
    assert 40 < shown["next_probe_s"] <= 50
    status = json.loads(run_cli("-c", str(path), "status", "--json").stdout)
    assert status["webhooks"][0]["circuit"] == "open"
    table = run_cli("-c", str(path), "status").stdout
    assert "open, next probe in" in table
    done = run_cli("-c", str(path), "webhooks", "resume", "app")
    assert done.returncode == 0, done.stderr
    assert "app: circuit closed; its backlog is due now" in done.stdout
    assert circuit(dsn)["opened_at"] is None and _due_now(dsn)
    again = run_cli("-c", str(path), "webhooks", "resume", "app")
    assert "app: circuit already closed" in again.stdout
    assert run_cli("-c", str(path), "webhooks", "resume", "nobody").returncode == 2


def test_a_webhooks_test_answered_2xx_closes_the_circuit(
    dsn: str, queue: QueueDB, tmp_path: Path, run_cli: Any
) -> None:
    with receiving(SECRET) as receiver:
        path = _cli_ini(tmp_path, dsn, receiver.url)
        queue.sync_webhook_endpoints([endpoint(receiver.url).subscription()])
        ready_files(queue, 2)
        _open_with_a_backlog(dsn)
        done = run_cli("-c", str(path), "webhooks", "test", "app")
    assert done.returncode == 0, done.stderr
    assert "app: circuit closed; its backlog is due now" in done.stdout
    assert circuit(dsn)["opened_at"] is None and _due_now(dsn)
    [test_event] = receiver.answered()
    assert test_event.verified and test_event.payload["data"]["test"] is True


def test_a_circuit_an_older_host_ended_the_pause_of_still_probes(dsn: str, queue: QueueDB) -> None:
    """During a rolling upgrade a host of the previous release ends an open circuit's
    pause by a success of its own (paused_until NULL, opened_at left): the next claim
    here is a probe, whose success closes it."""
    with receiving(SECRET) as receiver:
        hook = endpoint(receiver.url, retry_horizon=600)
        queue.sync_webhook_endpoints([hook.subscription()])
        ready_files(queue, 3)
        sql(dsn, "UPDATE derivd_webhook_endpoints SET opened_at = now(), probes = 4")
        with delivering(dsn, hook):
            found = settled(dsn, count=3)
    assert {r["status"] for r in found} == {"delivered"}
    assert circuit(dsn)["opened_at"] is None


def test_a_webhooks_test_stands_without_the_database(tmp_path: Path, run_cli: Any) -> None:
    """Run where the database is out of reach, a test answered 2xx still exits 0 and says
    that the circuit closes at the next successful probe instead."""
    with socket.socket() as held, receiving(SECRET) as receiver:
        held.bind(("127.0.0.1", 0))
        nowhere = f"host=127.0.0.1 port={held.getsockname()[1]} user=derivd connect_timeout=2"
        done = run_cli("-c", str(_cli_ini(tmp_path, nowhere, receiver.url)), "webhooks", "test",
                       "app")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "app: answered 204" in done.stdout
    assert "app: its circuit was not closed from here (" in done.stdout
    assert "Traceback" not in done.stderr
