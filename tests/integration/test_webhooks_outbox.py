"""The transactional outbox (DESIGN.md "Webhooks"): the statement that makes a
file ready, rejected, re-derived or deleted inserts one delivery per subscribed endpoint
in its own transaction; a commit that loses its fence inserts none; without endpoints,
none at all. Through PgBouncer too (`pooler`)."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fixtures.work import claim_one, commit_one
from helpers import sql
from prometheus_client import CollectorRegistry

from derivd.ops.metrics import Metrics
from derivd.ops.sweep import Sweeper
from derivd.queue.db import Finished, Job, QueueDB, StoredVariant, migrate
from derivd.queue.webhook_queries import EndpointSync
from derivd.queue.worker_queries import _commit_row
from derivd.storage.fs import FsStorage

pytestmark = pytest.mark.pooler

ALL = ["file.ready", "file.rejected", "file.rederived", "file.deleted"]
VARIANT = StoredVariant("thumb", "derived/1/t/thumb.webp", "v1", "ab" * 32, 32, 24)


def subscribe(queue: QueueDB, name: str = "app", events: list[str] = ALL,
              tenants: list[str] | None = None) -> None:  # fmt: skip
    queue.sync_webhook_endpoints([{"name": name, "events": events, "tenants": tenants}])


def deliveries(dsn: str) -> list[dict[str, Any]]:
    return sql(dsn, "SELECT endpoint, event, file_id, status, body FROM derivd_deliveries"
                    " ORDER BY id")  # fmt: skip


def queued(queue: QueueDB, tenant: str | None = None) -> int:
    return queue.enqueue_one("originals/a", "v1", tenant=tenant)


def test_a_ready_commit_inserts_one_delivery_per_subscribed_endpoint(
    dsn: str, queue: QueueDB
) -> None:
    queue.sync_webhook_endpoints([
        {"name": "app", "events": ALL, "tenants": None},
        {"name": "audit", "events": ["file.ready"], "tenants": None},
        {"name": "rejects", "events": ["file.rejected"], "tenants": None},
    ])  # fmt: skip
    file_id = queued(queue)
    job = claim_one(queue, lease_s=30, max_attempts=3)
    assert job is not None and commit_one(queue, job, [replace(VARIANT, bytes=812)])
    rows = deliveries(dsn)
    assert sorted(r["endpoint"] for r in rows) == ["app", "audit"]
    body = json.loads(rows[0]["body"])
    assert body["type"] == "file.ready" and body["timestamp"].endswith("Z")
    data = body["data"]
    assert (data["file_id"], data["status"], data["attempts"]) == (file_id, "ready", 1)
    assert data["variants"] == [{"name": "thumb", "format": "webp", "key": VARIANT.key,
                                 "version": "v1", "content_type": "image/webp", "width": 32,
                                 "height": 24, "bytes": 812,
                                 "sha256": VARIANT.sha256}]  # fmt: skip


def old_host_commit(dsn: str, job: Job, variant: StoredVariant) -> list[dict[str, Any]]:
    """The fenced commit as a host of a release before migration 0019 sends it (the
    `commit` query's function, its variants without `bytes`): the outcomes."""
    row = _commit_row(Finished(job, [variant]))
    row["variants"] = [{k: v for k, v in x.items() if k != "bytes"} for x in row["variants"]]
    return sql(dsn, "SELECT id, outcome FROM derivd_commit_outcomes(%s::jsonb)",
               (json.dumps([row]),))  # fmt: skip


def test_a_commit_from_an_older_host_without_bytes_still_commits(dsn: str, queue: QueueDB) -> None:
    subscribe(queue)
    file_id = queued(queue)
    job = claim_one(queue, lease_s=30, max_attempts=3)
    assert job is not None
    assert old_host_commit(dsn, job, VARIANT) == [{"id": file_id, "outcome": "committed"}]
    run = queue.backfill_run("target", {"thumb.webp": "fp2"})
    assert queue.backfill_queue([file_id], priority=-10, run=run["id"]) == [file_id]
    again = claim_one(queue, lease_s=30, max_attempts=3)
    assert again is not None and again.for_file == file_id
    newer = replace(VARIANT, key="derived/1/u/thumb.webp", fingerprint="fp2")
    assert old_host_commit(dsn, again, newer) == [{"id": again.id, "outcome": "committed"}]
    assert [v.bytes for v in queue.file_variants(file_id)] == [None]
    rows = deliveries(dsn)
    assert [r["event"] for r in rows] == ["file.ready", "file.rederived"]
    sizes = [[v["bytes"] for v in json.loads(r["body"])["data"]["variants"]] for r in rows]
    assert sizes == [[None], [None]]


def test_without_endpoints_a_commit_inserts_nothing(dsn: str, queue: QueueDB) -> None:
    queued(queue)
    job = claim_one(queue, lease_s=30, max_attempts=3)
    assert job is not None and commit_one(queue, job, [VARIANT])
    assert deliveries(dsn) == []


def test_a_commit_that_lost_its_fence_inserts_nothing(dsn: str, queue: QueueDB) -> None:
    subscribe(queue)
    queued(queue)
    job = claim_one(queue, lease_s=30, max_attempts=3)
    assert job is not None
    stolen = type(job)(**{**job.__dict__, "token": uuid.uuid4()})
    assert not commit_one(queue, stolen, [VARIANT])
    assert deliveries(dsn) == []


def test_tenant_filter(dsn: str, queue: QueueDB) -> None:
    subscribe(queue, tenants=["acme"])
    for tenant in ("acme", "other", None):
        queued(queue, tenant)
        job = claim_one(queue, lease_s=30, max_attempts=3)
        assert job is not None and commit_one(queue, job, [VARIANT])
    rows = deliveries(dsn)
    assert [json.loads(r["body"])["data"]["tenant"] for r in rows] == ["acme"]


def test_rejections_of_every_kind_announce_file_rejected(dsn: str, queue: QueueDB) -> None:
    subscribe(queue)
    content = queued(queue)
    job = claim_one(queue, lease_s=30, max_attempts=3)
    assert job is not None
    assert queue.fail(job, retry=False, code="corrupt_content", max_attempts=3) == "rejected"
    retried = queued(queue)
    job = claim_one(queue, lease_s=30, max_attempts=3)
    assert job is not None
    assert queue.fail(job, retry=True, code="processing_failed", max_attempts=3) == "queued"
    exhausted = queued(queue)
    sql(dsn, "UPDATE archive_files SET status = 'processing', attempts = 3,"
             " lease_token = gen_random_uuid(), lease_until = now() - interval '1 s'"
             " WHERE id = %s", (exhausted,))  # fmt: skip
    assert queue.reject_exhausted(max_attempts=3) == [exhausted]
    rows = deliveries(dsn)
    assert [(r["event"], r["file_id"]) for r in rows] == [
        ("file.rejected", content), ("file.rejected", exhausted)]  # fmt: skip
    codes = [json.loads(r["body"])["data"]["error_code"] for r in rows]
    assert codes == ["corrupt_content", "attempts_exhausted"]
    assert retried not in [r["file_id"] for r in rows]


def test_a_deletion_announces_file_deleted_when_it_is_done(dsn: str, queue: QueueDB) -> None:
    subscribe(queue)
    file_id = queued(queue)
    assert queue.request_delete([file_id], actor="test") == [file_id]
    assert deliveries(dsn) == []  # deleting is not deleted yet
    assert queue.mark_deleted(file_id)
    assert [(r["event"], r["file_id"]) for r in deliveries(dsn)] == [("file.deleted", file_id)]


def test_a_rederivation_announces_file_rederived_for_the_file(dsn: str, queue: QueueDB) -> None:
    subscribe(queue)
    file_id = queued(queue)
    job = claim_one(queue, lease_s=30, max_attempts=3)
    assert job is not None and commit_one(queue, job, [VARIANT])
    run = queue.backfill_run("target", {"thumb.webp": "fp2"})
    assert queue.backfill_queue([file_id], priority=-10, run=run["id"]) == [file_id]
    again = claim_one(queue, lease_s=30, max_attempts=3)
    assert again is not None and again.for_file == file_id
    newer = StoredVariant("thumb", "derived/1/u/thumb.webp", "v2", "cd" * 32, 32, 24,
                          fingerprint="fp2")  # fmt: skip
    assert commit_one(queue, again, [newer])
    rows = deliveries(dsn)
    assert [(r["event"], r["file_id"]) for r in rows] == [
        ("file.ready", file_id), ("file.rederived", file_id)]  # fmt: skip
    assert json.loads(rows[1]["body"])["data"]["variants"][0]["key"] == newer.key


def test_sync_removes_endpoints_no_longer_configured(dsn: str, queue: QueueDB) -> None:
    subscribe(queue, "old")
    new = [{"name": "new", "events": ALL, "tenants": None}]
    assert queue.sync_webhook_endpoints(new) == EndpointSync(["old"], ["new"], 0)
    # Marked removed (nothing of it to keep: the next round drops its row), never again.
    assert [(e["name"], e["removed_at"] is not None) for e in queue.webhook_endpoints()] == [
        ("new", False), ("old", True)]  # fmt: skip
    assert queue.sync_webhook_endpoints(new) == EndpointSync([], [], 0)
    assert [e["name"] for e in queue.webhook_endpoints()] == ["new"]
    queued(queue)
    job = claim_one(queue, lease_s=30, max_attempts=3)
    assert job is not None and commit_one(queue, job, [VARIANT])
    assert [r["endpoint"] for r in deliveries(dsn)] == ["new"]


def ready_file(queue: QueueDB) -> int:
    file_id = queued(queue)
    job = claim_one(queue, lease_s=30, max_attempts=3)
    assert job is not None and commit_one(queue, job, [VARIANT])
    return file_id


def test_a_removed_endpoints_undelivered_rows_end_failed_and_come_back_with_it(
    dsn: str, queue: QueueDB
) -> None:
    both = [{"name": n, "events": ALL, "tenants": None} for n in ("app", "gone")]
    queue.sync_webhook_endpoints(both)
    ready_file(queue)
    [in_flight] = queue.claim_deliveries("gone", limit=1, lease_s=60, host="h")
    waiting = ready_file(queue)
    synced = queue.sync_webhook_endpoints(both[:1])
    # The pending row ends now; the leased one is its POST's, which cannot requeue it.
    assert synced == EndpointSync(["gone"], [], 1)
    assert queue.finish_delivery(in_flight, status="pending", delay_s=1, error="http 500")
    gone = sql(dsn, "SELECT status, last_error, last_status FROM derivd_deliveries"
                    " WHERE endpoint = 'gone' ORDER BY id")  # fmt: skip
    assert gone == [{"status": "failed", "last_error": "endpoint removed", "last_status": None}] * 2
    [stats] = [r for r in queue.webhook_stats(window_s=3600) if r["name"] == "gone"]
    assert (stats["removed"], stats["backlog"], stats["failed_kept"]) == (True, 0, 2)
    # Nothing more is queued for it, claimed from it, or replayed to it while it is gone.
    ready_file(queue)
    assert [r["endpoint"] for r in deliveries(dsn)].count("gone") == 2
    assert queue.replay_deliveries(endpoint="gone", failed_only=True) == 0
    assert queue.claim_deliveries("gone", limit=10, lease_s=60, host="h") == []
    assert queue.sync_webhook_endpoints(both[:1]) == EndpointSync([], [], 0)  # kept: 2 rows
    # Configured again: replayable, with the same webhook-ids.
    assert queue.sync_webhook_endpoints(both) == EndpointSync([], ["gone"], 0)
    assert queue.replay_deliveries(endpoint="gone", failed_only=True) == 2
    again = queue.claim_deliveries("gone", limit=10, lease_s=60, host="h")
    assert len(again) == 2 and in_flight.id in {d.id for d in again}
    assert waiting in {d.file_id for d in again}


def test_retention_drops_finished_deliveries_of_old_events_and_keeps_undelivered(
    dsn: str, queue: QueueDB, fs_root: Path
) -> None:
    subscribe(queue)
    for _ in range(4):
        queued(queue)
        job = claim_one(queue, lease_s=30, max_attempts=3)
        assert job is not None and commit_one(queue, job, [VARIANT])
    sql(dsn, "UPDATE derivd_deliveries SET created_at = now() - interval '3 days',"
             " status = (ARRAY['delivered', 'failed', 'pending', 'delivered'])[id %% 4 + 1],"
             " finished_at = CASE WHEN id %% 4 <> 2 THEN now() END")  # fmt: skip
    queued(queue)  # one recent, delivered
    job = claim_one(queue, lease_s=30, max_attempts=3)
    assert job is not None and commit_one(queue, job, [VARIANT])
    sql(dsn, "UPDATE derivd_deliveries SET status = 'delivered', finished_at = now()"
             " WHERE created_at > now() - interval '1 day'")  # fmt: skip
    sweeper = Sweeper(queue, FsStorage(fs_root), orphan_guard=3600, delete_guard=0,
                      deliveries_retention_days=2)  # fmt: skip
    report = sweeper.run_once()
    assert report.deliveries_purged == {"delivered": 2, "failed": 1}
    left = sql(dsn, "SELECT status FROM derivd_deliveries ORDER BY id")
    assert sorted(r["status"] for r in left) == ["delivered", "pending"]


def test_the_webhook_gauges_follow_the_endpoints() -> None:
    metrics = Metrics(CollectorRegistry())
    row = {"name": "app", "backlog": 3, "oldest_undelivered_age_s": 12.5, "delivered_recent": 7,
           "failed_recent": 1, "failed_kept": 2, "paused": True, "removed": True}  # fmt: skip
    metrics.set_webhooks([row])
    text = metrics.render().decode()
    assert 'derivd_webhook_backlog{endpoint="app"} 3.0' in text
    assert 'derivd_webhook_removed{endpoint="app"} 1.0' in text
    assert 'derivd_webhook_oldest_undelivered_seconds{endpoint="app"} 12.5' in text
    assert 'derivd_webhook_paused{endpoint="app"} 1.0' in text
    metrics.set_webhooks([])
    assert 'endpoint="app"' not in metrics.render().decode()


def test_the_upgrade_ends_what_the_previous_releases_sync_stranded(
    dsn: str, queue: QueueDB
) -> None:
    subscribe(queue, "old")
    stranded = ready_file(queue)
    # The previous release: no removed_at, and its sync deleted a removed endpoint's row,
    # leaving the endpoint's undelivered rows to nobody.
    sql(dsn, "DELETE FROM derivd_webhook_endpoints")
    sql(dsn, "ALTER TABLE derivd_webhook_endpoints DROP COLUMN removed_at")
    sql(dsn, "DELETE FROM derivd_migrations WHERE name = '0021_webhook_removed'")
    assert migrate(dsn) == ["0021_webhook_removed"]
    assert queue.sync_webhook_endpoints([]) == EndpointSync([], [], 1)
    assert sql(dsn, "SELECT file_id, status, last_error FROM derivd_deliveries") == [
        {"file_id": stranded, "status": "failed", "last_error": "endpoint removed"}]  # fmt: skip
    [stats] = queue.webhook_stats(window_s=3600)
    assert (stats["name"], stats["removed"], stats["failed_kept"]) == ("old", True, 1)
