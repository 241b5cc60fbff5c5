"""The app's contract (DESIGN.md "For upload APIs"): an external id and metadata carried
from every enqueue (client, CLI, plain SQL) to the result, `derivd show` and each webhook,
with the original's bucket, key and version; the bounds the database itself enforces (so
any language meets them); the deletion an app calls; a queued row without a key or
version refused at the INSERT; the migration that gives existing rows their store prefix.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fixtures.work import claim_one, commit_one
from helpers import sql

from derivd import client
from derivd.embedded.pgcluster import EmbeddedCluster
from derivd.queue.db import QueueDB, StoredVariant, migrate
from derivd.storage.base import StoreName

RunCli = Callable[..., subprocess.CompletedProcess[str]]
ALL = ["file.ready", "file.rejected", "file.rederived", "file.deleted"]
INSERT = (
    "INSERT INTO archive_files (status, original_key, original_version, external_id, metadata)"
    " VALUES ('queued', %s, %s, %s, %s::jsonb) RETURNING id"
)


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


def _ready(queue: QueueDB, file_id: int) -> None:
    job = claim_one(queue, lease_s=60.0, max_attempts=3)
    assert job is not None and job.id == file_id
    variant = StoredVariant("thumb", f"app/derived/{file_id}/t/thumb.webp", "v", "ab" * 32, 4, 3)
    assert commit_one(queue, job, [variant])


def test_the_apps_context_reaches_the_result_and_every_webhook(
    conn: psycopg.Connection[Any], dsn: str, queue: QueueDB
) -> None:
    queue.record_store(StoreName("s3", "photos", "app/"))
    queue.sync_webhook_endpoints([{"name": "app", "events": ALL, "tenants": None}])
    metadata = {"album": 7, "caption": "été"}
    file_id = client.enqueue(
        conn, "app/uploads/a.jpg", "v1", external_id="photo-42", metadata=metadata
    )
    _ready(queue, file_id)
    done = client.result(conn, file_id)
    assert (done.external_id, done.metadata, done.bucket) == ("photo-42", metadata, "photos")
    assert (done.original_key, done.original_version) == ("app/uploads/a.jpg", "v1")
    assert client.delete(conn, file_id) == "deleting"
    [ready, deleted] = [json.loads(r["body"])["data"] for r in _deliveries(dsn)]
    for data in (ready, deleted):
        assert data["external_id"] == "photo-42" and data["metadata"] == metadata
        assert data["bucket"] == "photos"
        assert (data["original_key"], data["original_version"]) == ("app/uploads/a.jpg", "v1")
    assert [v["key"] for v in ready["variants"]] == [f"app/derived/{file_id}/t/thumb.webp"]


def _deliveries(dsn: str) -> list[dict[str, Any]]:
    # file.deleted is announced by the sweep when the deletion completes: written here
    # as the sweep's statement does, straight after the request.
    sql(dsn, "UPDATE archive_files SET status = 'deleted' WHERE status = 'deleting'")
    sql(dsn, "SELECT derivd_outbox(id, 'file.deleted') FROM archive_files WHERE status = 'deleted'")
    return sql(dsn, "SELECT body FROM derivd_deliveries ORDER BY id")


@pytest.mark.parametrize(
    ("external_id", "metadata", "problem"),
    [
        ("", None, "external_id must be 1-200 characters, not 0"),
        ("x" * 201, None, "external_id must be 1-200 characters, not 201"),
        ("a\nb", None, "external_id must hold no control characters"),
        (None, ["a"], "metadata must be a JSON object, not a JSON array"),
        (None, {"k": "x" * 5000}, "metadata must be at most 4096 bytes as JSON text"),
    ],
)
def test_out_of_bounds_context_is_refused_by_the_client_and_by_the_database(
    conn: psycopg.Connection[Any], external_id: str | None, metadata: Any, problem: str
) -> None:
    with pytest.raises(client.InvalidContext, match=problem):
        client.enqueue(conn, "uploads/a.jpg", "v1", external_id=external_id, metadata=metadata)
    # The same rule for an INSERT from any language: the row's CHECK, which says why.
    text = None if metadata is None else json.dumps(metadata)
    with pytest.raises(psycopg.errors.CheckViolation) as refused:
        conn.execute(INSERT, ("uploads/a.jpg", "v1", external_id, text))
    assert refused.value.diag.constraint_name == "archive_files_app_context_check"
    assert problem in str(refused.value.diag.message_detail)
    assert conn.execute("SELECT count(*) FROM archive_files").fetchone() == (0,)


def test_metadata_that_is_not_json_is_refused(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(client.InvalidContext, match="metadata is not JSON"):
        client.enqueue(conn, "uploads/a.jpg", "v1", metadata={"at": object()})


@pytest.mark.parametrize(("key", "version"), [("", "v1"), ("uploads/a.jpg", ""), ("k", None)])
def test_an_insert_without_a_key_or_version_is_refused(
    conn: psycopg.Connection[Any], key: str, version: str | None
) -> None:
    with pytest.raises(psycopg.errors.CheckViolation) as refused:
        conn.execute(INSERT, (key, version, None, None))
    assert refused.value.diag.constraint_name == "archive_files_original_key_check"


def test_an_app_deletes_through_one_sql_function(
    conn: psycopg.Connection[Any], queue: QueueDB
) -> None:
    file_id = client.enqueue(conn, "uploads/a.jpg", "v1")
    job = claim_one(queue, lease_s=60.0, max_attempts=3)
    assert job is not None
    assert conn.execute("SELECT derivd_delete_file(%s)", (file_id,)).fetchone() == ("deleting",)
    assert not commit_one(queue, job, [])  # the lease was revoked: the attempt cannot commit
    assert conn.execute("SELECT derivd_delete_file(%s)", (file_id,)).fetchone() == ("deleting",)
    assert conn.execute("SELECT derivd_delete_file(999999)").fetchone() == (None,)
    with pytest.raises(client.UnknownFile):
        client.delete(conn, 999999)
    actors = conn.execute(
        "SELECT actor FROM archive_events WHERE file_id = %s AND kind = 'delete_requested'",
        (file_id,),
    ).fetchall()
    assert actors == [("app",)]


def test_the_cli_enqueues_with_context_and_show_prints_it(
    dsn: str, fs_root: Path, tmp_path: Path, run_cli: RunCli
) -> None:
    env = {
        "DERIVD_DATABASE_DSN": dsn,
        "DERIVD_STORAGE_BACKEND": "fs",
        "DERIVD_STORAGE_ROOT": str(fs_root),
    }
    image = tmp_path / "a.jpg"
    image.write_bytes(b"\xff\xd8\xff")
    bad = run_cli("enqueue", str(image), "--metadata", "[1]", env=env)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "metadata must be a JSON object, not a JSON array" in bad.stderr
    assert not any(fs_root.iterdir())  # refused before anything was uploaded
    done = run_cli(
        "enqueue", "-q", str(image), "--external-id", "p-1", "--metadata", '{"a": 1}', env=env
    )
    assert done.returncode == 0, done.stderr
    file_id = done.stdout.strip()
    shown = run_cli("show", file_id, env=env)
    assert "external id  p-1" in shown.stdout and 'metadata     {"a": 1}' in shown.stdout
    row = json.loads(run_cli("show", "--json", file_id, env=env).stdout)["row"]
    assert (row["external_id"], row["metadata"]) == ("p-1", {"a": 1})


def test_migrating_gives_existing_rows_their_store_prefix(pg_cluster: EmbeddedCluster) -> None:
    """Keys are the store's real keys: rows written before, without the prefix the s3
    store used to add itself, get it; a queued row without a version is rejected."""
    pg_cluster.create_database("rekey")
    dsn = pg_cluster.dsn("rekey")
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE derivd_migrations (name text PRIMARY KEY,"
                         " applied_at timestamptz NOT NULL DEFAULT now())")  # fmt: skip
        _migrate_up_to(dsn, "0024")
        sql(dsn, "INSERT INTO archive_files (status, original_key, original_version,"
                 " derived_key) VALUES ('ready', 'originals/a', 'v', 'derived/1/t/x.webp'),"
                 " ('queued', 'originals/b', NULL, NULL)")  # fmt: skip
        migrate(dsn, StoreName("s3", "photos", "derivd/"))
        rows = sql(dsn, "SELECT original_key, derived_key, status, error_code"
                        " FROM archive_files ORDER BY id")  # fmt: skip
        assert [tuple(r.values()) for r in rows] == [
            ("derivd/originals/a", "derivd/derived/1/t/x.webp", "ready", None),
            ("derivd/originals/b", None, "rejected", "missing_original"),
        ]
        assert sql(dsn, "SELECT backend, bucket FROM derivd_store") == [
            {"backend": "s3", "bucket": "photos"}
        ]
    finally:
        pg_cluster.drop_database("rekey")


def _migrate_up_to(dsn: str, last: str) -> None:
    """The migrations up to `last` only, recorded as `migrate` records them."""
    from derivd.queue.sqlfiles import migrations

    with psycopg.connect(dsn, autocommit=True) as conn:
        for migration in migrations():
            if migration.name[:4] > last:
                break
            conn.execute(migration.sql)  # type: ignore[arg-type]  # package data
            conn.execute("INSERT INTO derivd_migrations (name) VALUES (%s)", (migration.name,))


def test_retry_leaves_a_rejected_row_without_a_version_and_retries_the_rest(
    dsn: str, queue: QueueDB
) -> None:
    rows = sql(dsn, "INSERT INTO archive_files (status, error_code, original_key,"
                    " original_version) VALUES ('rejected', 'missing_original', 'k', NULL),"
                    " ('rejected', 'corrupt_content', 'k', 'v') RETURNING id")  # fmt: skip
    [unreadable, good] = [r["id"] for r in rows]
    assert queue.operator_retry(ids=None, code=None, actor="test") == [good]
    assert queue.statuses([unreadable, good]) == {unreadable: "rejected", good: "queued"}
