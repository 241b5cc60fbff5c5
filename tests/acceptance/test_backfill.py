"""`derivd backfill` (docs/traffic.md) on real PostgreSQL (direct and pooled) and both
stores: the dry run's counts, the swap in the fenced commit, and every way a
re-derivation can fail leaving its file `ready` with one complete, readable variant
set, and no object unreferenced once the sweep has run."""

from __future__ import annotations

import dataclasses
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from configs import write_ini
from fixtures.backfill import (
    V1,
    V2,
    apply,
    config,
    configured,
    drain,
    job_rows,
    readable_set,
    ready_files,
    sweep,
    unreferenced,
    variant_set,
)
from fixtures.work import run_job, run_one
from helpers import sql

from derivd.ops.backfill import BackfillRunning, differences, scan
from derivd.ops.dashboard_page import render
from derivd.ops.dashboard_view import Snapshot
from derivd.ops.health import collect
from derivd.ops.status import as_json, render_table
from derivd.ops.sweep import Sweeper
from derivd.queue.db import QueueDB
from derivd.storage.base import new_original_key
from derivd.storage.configured import open_storage
from derivd.worker import Worker

pytestmark = pytest.mark.pooler

# -- the planner (pure) -----------------------------------------------------------------


def test_differences_name_missing_changed_and_extra() -> None:
    wanted = {"thumb.webp": "a", "card.webp": "b", "card.avif": "c"}
    stored = {"thumb.webp": "a", "card.webp": "x", "old.webp": "d", "card.avif": None}
    assert differences(stored, wanted) == {
        "card.webp": "changed",
        "card.avif": "changed",  # made before fingerprints: cannot be shown to match
        "old.webp": "extra",
    }
    assert differences({}, wanted) == dict.fromkeys(wanted, "missing")
    assert differences(wanted, wanted) == {}


def test_the_fingerprint_follows_what_changes_the_bytes(dsn: str, tmp_path: Path) -> None:
    base = configured(config(dsn, {"fs_root": tmp_path}, V1))
    same = configured(config(dsn, {"fs_root": tmp_path}, V1).replace("derive", max_pixels=5))
    changes = ({"quality": 50}, {"effort": 6}, {"backend": "pillow"}, {"shrink_on_load": "safe"})
    for change in changes:
        other = configured(config(dsn, {"fs_root": tmp_path}, V1).replace("derive", **change))
        assert other["thumb.webp"] != base["thumb.webp"], change
    assert same == base  # limits decide whether, not how


# -- the swap ---------------------------------------------------------------------------


def test_backfill_swaps_in_the_configured_set_and_then_has_nothing_to_do(
    dsn: str, store: dict[str, Any], queue: QueueDB
) -> None:
    old_cfg, new_cfg = config(dsn, store, V1), config(dsn, store, V2)
    storage = open_storage(new_cfg)
    files = ready_files(old_cfg, ["ok"] * 3)
    old = {f: readable_set(dsn, storage, f) for f in files}
    plan = scan(queue, configured(new_cfg))
    assert plan.counts == {
        "thumb.webp": {"missing": 0, "changed": 3, "extra": 0},
        "card.webp": {"missing": 3, "changed": 0, "extra": 0},
    }
    assert apply(queue, new_cfg).queued == 3
    # Queued, not yet run: every file still ready with its old set, readable.
    assert {f: readable_set(dsn, storage, f) for f in files} == old
    assert sorted(r["file_id"] for r in job_rows(dsn)) == files
    drain(new_cfg)
    for f in files:
        assert readable_set(dsn, storage, f) == configured(new_cfg)
        kinds = [
            r["kind"] for r in sql(dsn, "SELECT kind FROM archive_events WHERE file_id = %s", (f,))
        ]
        assert kinds.count("rederived") == 1
    assert job_rows(dsn) == []
    assert queue.conn.execute("SELECT count(*) FROM derivd_retired_objects").fetchone() == (3,)
    sweep(queue, storage)
    assert unreferenced(queue, storage) == set()
    assert apply(queue, new_cfg).queued == 0
    assert scan(queue, configured(new_cfg)).differing == 0


def test_the_old_objects_stay_until_delete_guard(
    dsn: str, store: dict[str, Any], queue: QueueDB
) -> None:
    new_cfg = config(dsn, store, V2)
    storage = open_storage(new_cfg)
    (f,) = ready_files(config(dsn, store, V1), ["ok"])
    (old,) = queue.file_variants(f)
    apply(queue, new_cfg)
    drain(new_cfg)
    Sweeper(queue, storage, orphan_guard=0, delete_guard=3600).run_once()
    assert storage.get(old.key, old.version)  # a client that just read the old key
    sweep(queue, storage)
    assert old.key not in set(storage.list_keys("derived/"))


# -- failures leave the old set ---------------------------------------------------------


def test_a_lost_lease_leaves_the_old_set(dsn: str, store: dict[str, Any], queue: QueueDB) -> None:
    new_cfg = config(dsn, store, V2)
    storage = open_storage(new_cfg)
    (f,) = ready_files(config(dsn, store, V1), ["ok"])
    old = readable_set(dsn, storage, f)
    apply(queue, new_cfg)
    worker = Worker.create(new_cfg, dsn)
    [job] = worker.claim_many(1)
    assert job.for_file == f and job.id != f
    queue.conn.execute(
        "UPDATE derivd_rederivations SET lease_until = now() - interval '1 second' WHERE id = %s",
        (job.id,),
    )
    [again] = worker.claim_many(1)  # the expired lease is reclaimed: a new token
    assert run_job(worker, job).outcome == "lease_lost"
    assert readable_set(dsn, storage, f) == old
    assert run_job(worker, again).outcome == "rederived"
    assert readable_set(dsn, storage, f) == configured(new_cfg)
    worker.close()
    sweep(queue, storage)
    assert unreferenced(queue, storage) == set()


def test_a_content_failure_rejects_the_job_not_the_file(
    dsn: str, store: dict[str, Any], queue: QueueDB
) -> None:
    new_cfg = config(dsn, store, V2)
    storage = open_storage(new_cfg)
    (f,) = ready_files(config(dsn, store, V1), ["ok"])
    old = readable_set(dsn, storage, f)
    apply(queue, new_cfg)
    # The re-derivation reads a version of the original that is now broken.
    key = new_original_key()
    version = storage.put(key, b"corrupt", "text/plain")
    sql(dsn, "UPDATE derivd_rederivations SET original_key = %s, original_version = %s"
        " WHERE file_id = %s", (key, version, f))  # fmt: skip
    drain(new_cfg)
    [job] = job_rows(dsn)
    assert job["status"] == "rejected"
    # On the file, and not as a file's rejection (the rejected share counts files).
    events = sql(dsn, "SELECT kind, error_code FROM archive_events WHERE file_id = %s", (f,))
    assert {"kind": "rederive_rejected", "error_code": "corrupt_content"} in events
    assert queue.statuses([f]) == {f: "ready"}
    assert readable_set(dsn, storage, f) == old
    sweep(queue, storage)
    assert unreferenced(queue, storage) == set()


def test_deleting_the_file_mid_rederivation_removes_everything(
    dsn: str, store: dict[str, Any], queue: QueueDB
) -> None:
    new_cfg = config(dsn, store, V2)
    storage = open_storage(new_cfg)
    (f,) = ready_files(config(dsn, store, V1), ["ok"])
    apply(queue, new_cfg)
    worker = Worker.create(new_cfg, dsn)
    [job] = worker.claim_many(1)
    assert queue.request_delete([f], actor="test") == [f]
    assert run_job(worker, job).outcome == "lease_lost"
    worker.close()
    assert queue.statuses([f]) == {f: "deleting"} and job_rows(dsn) == []
    sweep(queue, storage)
    assert queue.statuses([f]) == {f: "deleted"}
    assert set(storage.list_keys("derived/")) == set()
    assert unreferenced(queue, storage) == set()


def test_a_file_deleted_before_its_rederivation_commits_keeps_nothing_new(
    dsn: str, store: dict[str, Any], queue: QueueDB
) -> None:
    """The commit finds its file no longer ready (it went while the job's fence still
    held): nothing is registered, the job row goes, its objects are orphans."""
    new_cfg = config(dsn, store, V2)
    storage = open_storage(new_cfg)
    (f,) = ready_files(config(dsn, store, V1), ["ok"])
    apply(queue, new_cfg)
    worker = Worker.create(new_cfg, dsn)
    [job] = worker.claim_many(1)
    sql(dsn, "UPDATE archive_files SET status = 'deleting' WHERE id = %s", (f,))
    assert run_job(worker, job).outcome == "lease_lost"
    worker.close()
    assert job_rows(dsn) == []
    sweep(queue, storage)
    assert queue.statuses([f]) == {f: "deleted"}
    assert set(storage.list_keys("derived/")) == set()


# -- the run itself ---------------------------------------------------------------------


def test_at_most_max_queued_are_claimable_at_a_time(
    dsn: str, tmp_path: Path, queue: QueueDB
) -> None:
    store = {"fs_root": tmp_path}
    new_cfg = config(dsn, store, V2)
    files = ready_files(config(dsn, store, V1), ["ok"] * 5)
    worker = Worker.create(new_cfg, dsn)
    seen: list[int] = []

    def make_room(_: float) -> None:  # instead of sleeping: a worker takes one
        seen.append(queue.backfill_claimable())
        run_one(worker)

    plan = apply(queue, new_cfg, max_queued=2, sleep=make_room)
    worker.close()
    assert plan.queued == 5 and seen and max(seen) == 2
    drain(new_cfg)
    assert all(variant_set(queue, f) == configured(new_cfg) for f in files)


def test_an_interrupted_run_resumes_after_its_last_page(
    dsn: str, tmp_path: Path, queue: QueueDB
) -> None:
    store = {"fs_root": tmp_path}
    new_cfg = config(dsn, store, V2)
    files = ready_files(config(dsn, store, V1), ["ok"] * 5)
    pages: list[int] = []

    def ctrl_c_after_two_pages(cursor: int, last: int) -> None:
        pages.append(cursor)
        if len(pages) == 3:  # the start, then two pages of 2
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        apply(queue, new_cfg, page=2, progress=ctrl_c_after_two_pages)
    assert len(job_rows(dsn)) == 4
    resumed = apply(queue, new_cfg, page=2)
    assert (resumed.scanned, resumed.queued) == (1, 1)  # only the page after the cursor
    assert sorted(r["file_id"] for r in job_rows(dsn)) == files


def test_a_second_apply_is_refused_while_one_runs(dsn: str, tmp_path: Path, queue: QueueDB) -> None:
    assert queue.take_lease("backfill", uuid.uuid4(), ttl_s=60)
    with pytest.raises(BackfillRunning, match="already running"):
        apply(queue, config(dsn, {"fs_root": tmp_path}, V2))


def test_the_lease_is_renewed_on_pages_with_nothing_to_queue(
    dsn: str, tmp_path: Path, queue: QueueDB
) -> None:
    """A long scan of files that already match keeps the lease: between its pages a
    second --apply cannot take it. Time passing beyond the lease is its row aged."""
    cfg = config(dsn, {"fs_root": tmp_path}, V2)
    ready_files(cfg, ["ok"] * 3)
    taken: list[bool] = []
    with QueueDB.open(dsn) as other:

        def try_then_age(cursor: int, last: int) -> None:
            if cursor < last:  # pages remain: the run must hold the lease
                taken.append(other.take_lease("backfill", uuid.uuid4(), ttl_s=60))
            sql(dsn, "UPDATE derivd_leases SET until = now() - interval '1 second'")

        plan = apply(queue, cfg, page=1, progress=try_then_age)
    assert (plan.scanned, plan.queued) == (3, 0)
    assert taken == [False, False, False]  # before the first page, after pages 1 and 2


# -- the command line -------------------------------------------------------------------


def _ini(tmp_path: Path, dsn: str, **derive: str) -> Path:
    root = tmp_path / "store"
    root.mkdir(exist_ok=True)
    sections: dict[str, dict[str, Any]] = {
        "database": {"dsn": dsn},
        "storage": {"backend": "fs", "root": str(root)},
        "derive": {"backend": "pillow", **derive},
    }
    return write_ini(tmp_path / "derivd.ini", sections)


def test_the_cli_refuses_variants_that_do_not_validate(
    run_cli: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path, dsn: str
) -> None:
    ini = _ini(tmp_path, dsn, variants="card")
    ini.write_text(ini.read_text() + "\n[variant:card]\nsize = banana\n")
    result = run_cli("-c", str(ini), "backfill", "--apply")
    assert result.returncode == 2 and "[variant:card] size" in result.stderr
    assert "Traceback" not in result.stderr
    assert sql(dsn, "SELECT count(*) AS n FROM derivd_backfills") == [{"n": 0}]


def test_the_cli_says_when_another_apply_runs(
    run_cli: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path, dsn: str
) -> None:
    with QueueDB.open(dsn) as q:
        assert q.take_lease("backfill", uuid.uuid4(), ttl_s=60)
    result = run_cli("-c", str(_ini(tmp_path, dsn)), "backfill", "--apply")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "derivd: a backfill --apply is already running (this or another host)"
    )


def test_the_cli_dry_run_prints_counts_per_variant(
    run_cli: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path, dsn: str
) -> None:
    (tmp_path / "s").mkdir()
    ready_files(config(dsn, {"fs_root": tmp_path / "s"}, V1), ["ok"] * 2)
    ini = _ini(tmp_path, dsn, variants=V2)
    result = run_cli("-c", str(ini), "backfill")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].split() == ["thumb.webp", "0", "2", "0"]
    assert lines[2].split() == ["card.webp", "2", "0", "0"]
    assert "2 ready file(s) scanned, 2 to re-derive" in result.stdout
    assert job_rows(dsn) == []


def test_status_and_the_dashboard_show_backfill_progress(
    dsn: str, tmp_path: Path, queue: QueueDB
) -> None:
    store = {"fs_root": tmp_path}
    new_cfg = config(dsn, store, V2)
    ready_files(config(dsn, store, V1), ["ok"] * 3)
    limits = dataclasses.replace(new_cfg.status, max_age=0)  # no shared reading reused
    assert collect(queue, limits).backfill is None
    apply(queue, new_cfg)
    report = collect(queue, limits)
    assert as_json(report, [], limits)["backfill"] == {
        "run": 1, "state": "re-deriving", "planned": 1.0, "scanned": 3, "queued": 3,
        "in_queue": 3, "rejected": 0,
    }  # fmt: skip
    assert "backfill #1: re-deriving, 100% scanned (3 files), 3 queued, 3 in the queue" in (
        render_table(report, [], limits)
    )
    drain(new_cfg)
    report = collect(queue, limits)
    assert report.backfill is not None and report.backfill.state == "done"
    page = render(Snapshot.taken(new_cfg, report))
    assert '<section id="backfill" data-state="done">' in page
