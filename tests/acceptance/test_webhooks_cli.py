"""The operator's and the app's view: `derivd status` (table and --json) per
endpoint, `derivd webhooks list|test|replay`, `derivd files` and `derivd similar`: the
views a user had to write SQL for."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from configs import write_ini
from fixtures.receiver import receiving
from fixtures.work import claim_one, commit_one
from helpers import sql

from derivd.handlers.base import Analysis
from derivd.queue.db import QueueDB, StoredVariant

RunCli = Callable[..., subprocess.CompletedProcess[str]]
SECRET = "whsec_" + base64.b64encode(b"derivd cli test secret, 32 bytes").decode()
VARIANT = StoredVariant("thumb", "derived/1/t/thumb.webp", "v1", "ab" * 32, 32, 24)


def ini(tmp_path: Path, dsn: str, url: str = "http://127.0.0.1:9/hooks") -> Path:
    return write_ini(tmp_path / "derivd.ini", {
        "database": {"dsn": dsn},
        "storage": {"backend": "fs", "root": tmp_path / "objects"},
        "webhook:app": {"url": url + "?token=hidden", "secret": SECRET},
    })  # fmt: skip


def analysed(dhash: int) -> Analysis:
    return Analysis(width=10, height=10, format="jpeg", frames=1, has_alpha=False,
                    colour="#102030", placeholder="A" * 24, dhash=dhash)  # fmt: skip


def ready(queue: QueueDB, tenant: str | None = None, dhash: int = 0) -> int:
    file_id = queue.enqueue_one("originals/a", "v1", tenant=tenant)
    job = claim_one(queue, lease_s=30, max_attempts=3)
    assert job is not None and commit_one(queue, job, [VARIANT], analysed(dhash))
    return file_id


def test_status_and_list_show_each_endpoint(
    dsn: str, queue: QueueDB, tmp_path: Path, run_cli: RunCli
) -> None:
    path = ini(tmp_path, dsn)
    queue.sync_webhook_endpoints([{"name": "app", "events": ["file.ready"], "tenants": None}])
    ready(queue)
    ready(queue)
    sql(
        dsn,
        "UPDATE derivd_deliveries SET status = 'failed', finished_at = now(),"
        " last_error = 'http 500' WHERE id = (SELECT min(id) FROM derivd_deliveries)",
    )
    sql(dsn, "UPDATE derivd_webhook_endpoints SET failures = 1, last_error = 'http 500',"
             " last_error_at = now()")  # fmt: skip
    done = run_cli("-c", str(path), "status", "--json")
    [hook] = json.loads(done.stdout)["webhooks"]
    assert (hook["name"], hook["backlog"], hook["failed_recent"], hook["failed_kept"]) == (
        "app", 1, 1, 1)  # fmt: skip
    assert hook["last_error"] == "http 500" and hook["oldest_undelivered_age_s"] >= 0
    table = run_cli("-c", str(path), "status").stdout
    assert "webhooks (delivered/failed" in table and "http 500" in table
    listed = run_cli("-c", str(path), "webhooks", "list")
    assert listed.returncode == 0, listed.stderr
    assert "[webhook:app] http://127.0.0.1:9/hooks?…" in listed.stdout
    assert "hidden" not in listed.stdout and SECRET[6:20] not in listed.stdout

    replayed = run_cli("-c", str(path), "webhooks", "replay", "--failed")
    assert replayed.stdout.strip() == "replayed: 1 deliveries", replayed.stderr
    assert {r["status"] for r in sql(dsn, "SELECT status FROM derivd_deliveries")} == {"pending"}
    assert run_cli("-c", str(path), "webhooks", "replay").returncode == 2


def test_webhooks_test_posts_a_signed_event(dsn: str, tmp_path: Path, run_cli: RunCli) -> None:
    with receiving(SECRET) as receiver:
        path = ini(tmp_path, dsn, receiver.url)
        done = run_cli("-c", str(path), "webhooks", "test", "app")
        assert done.returncode == 0, done.stderr
        assert "answered 204" in done.stdout
        [got] = receiver.answered()
    assert got.verified and got.payload["data"]["file_id"] == 0
    assert run_cli("-c", str(path), "webhooks", "test", "nope").returncode == 2


def test_files_by_status_code_and_tenant_paged(
    dsn: str, queue: QueueDB, tmp_path: Path, run_cli: RunCli
) -> None:
    path = ini(tmp_path, dsn)
    acme = [ready(queue, "acme") for _ in range(3)]
    bad = queue.enqueue_one("originals/b", "v1")
    job = claim_one(queue, lease_s=30, max_attempts=3)
    assert job is not None and job.id == bad
    queue.fail(job, retry=False, code="corrupt_content", max_attempts=3)

    def listed(*args: str) -> dict[str, object]:
        done = run_cli("-c", str(path), "files", "--json", *args)
        assert done.returncode == 0, done.stderr
        parsed: dict[str, object] = json.loads(done.stdout)
        return parsed

    rejected = listed("--status", "rejected", "--code", "corrupt_content")
    assert [f["id"] for f in rejected["files"]] == [bad]  # type: ignore[index, union-attr]
    page = listed("--tenant", "acme", "--limit", "2")
    assert [f["id"] for f in page["files"]] == acme[:0:-1]  # type: ignore[index, union-attr]
    rest = listed("--tenant", "acme", "--limit", "2", "--before", str(page["next_before"]))
    assert [f["id"] for f in rest["files"]] == [acme[0]]  # type: ignore[index, union-attr]
    table = run_cli("-c", str(path), "files", "--status", "rejected").stdout
    assert "corrupt_content" in table and str(bad) in table


def test_similar_prints_the_near_duplicates(
    dsn: str, queue: QueueDB, tmp_path: Path, run_cli: RunCli
) -> None:
    path = ini(tmp_path, dsn)
    first = ready(queue, dhash=0b1111)
    near = ready(queue, dhash=0b0111)
    ready(queue, dhash=-1)  # far
    done = run_cli("-c", str(path), "similar", str(first), "--json")
    assert json.loads(done.stdout)["similar"] == [near], done.stderr
    assert run_cli("-c", str(path), "similar", "999").returncode == 1


def test_the_dashboard_shows_each_endpoint(dsn: str, queue: QueueDB, tmp_path: Path) -> None:
    from derivd.config_load import load_config
    from derivd.ops.dashboard_page import render
    from derivd.ops.dashboard_view import Snapshot
    from derivd.ops.health import collect
    from derivd.ops.webhook_view import endpoint_lines

    config = load_config(ini(tmp_path, dsn), env={})
    queue.sync_webhook_endpoints([{"name": "app", "events": ["file.ready"], "tenants": None}])
    ready(queue)
    page = render(Snapshot.taken(config, collect(queue, config.status)))
    assert '<tr data-endpoint="app">' in page
    assert '<td class="num backlog" data-value="1">' in page
    assert '<td class="state ok" data-circuit="closed">ok</td>' in page
    assert "hidden" not in page and SECRET[6:20] not in page
    queue.sync_webhook_endpoints([])  # removed: its one undelivered row ends failed, kept
    page = render(Snapshot.taken(config, collect(queue, config.status)))
    assert '<td class="num kept" data-value="1">' in page
    assert '<td class="state bad" data-circuit="closed">removed</td>' in page
    assert "removed" in "\n".join(endpoint_lines(queue.webhook_stats(window_s=60), "1m"))


def test_a_webhook_url_with_user_info_is_refused_without_echoing_it(
    dsn: str, tmp_path: Path, run_cli: RunCli
) -> None:
    """A receiver's basic auth in its URL (https://user:password@host/hook) would be
    printed by every view that shows the URL: such an endpoint is refused at load in one
    line naming file, section and key (exit 2), by every command, and no output ever
    echoes the user or the password."""
    path = ini(tmp_path, dsn, "http://hookuser:s3cretpass@127.0.0.1:9/hooks")
    for args in (["webhooks", "list"], ["config", "check"], ["config", "show"], ["run"]):
        done = run_cli("-c", str(path), *args)
        text = done.stdout + done.stderr
        assert done.returncode == 2, (args, text)
        assert f"{path}: [webhook:app] url: must not carry credentials" in text, (args, text)
        assert "s3cretpass" not in text and "hookuser" not in text, (args, text)
