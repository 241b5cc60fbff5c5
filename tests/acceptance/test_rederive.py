"""Re-derivations (backfill) on the failure side: a swap never
takes a variant set other than the configured one, a re-derivation never shows as a
file (counts, rejected share, an app's query over archive_files), an operator's retry
never dies on one, a file that keeps failing keeps one job row, and the heartbeat never
calls a job lost whose attempt just committed."""

from __future__ import annotations

import dataclasses
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from configs import make_config, write_ini
from fixtures.backfill import apply, config, configured, drain, readable_set, ready_files
from fixtures.work import HOST, make_worker, run_job
from helpers import sql, wait_for

from derivd.config import Config
from derivd.fingerprint import set_problem
from derivd.ops.health import collect
from derivd.queue.db import Finished, QueueDB, StoredVariant
from derivd.storage.base import new_original_key
from derivd.storage.configured import open_storage

pytestmark = pytest.mark.pooler

V1 = "thumb:64"
V2 = "thumb:32, card:48"


def jobs_of(dsn: str) -> list[dict[str, Any]]:
    return sql(dsn, "SELECT * FROM derivd_rederivations ORDER BY file_id")


def break_originals(dsn: str, cfg: Config, files: list[int]) -> None:
    """Point each file at an original whose bytes the fault script calls corrupt: a
    re-derivation of it is rejected (corrupt_content); the file's own set is untouched."""
    storage = open_storage(cfg)
    for f in files:
        key = new_original_key()
        version = storage.put(key, b"corrupt", "text/plain")
        sql(dsn, "UPDATE archive_files SET original_key = %s, original_version = %s"
            " WHERE id = %s", (key, version, f))  # fmt: skip


# -- item 1: the swap takes exactly the configured set -----------------------------------


def test_the_variant_set_rule() -> None:
    wanted = {"thumb.webp": "a", "card.webp": "b"}
    assert set_problem(["thumb.webp", "card.webp"], wanted, rederive=False) is None
    assert set_problem(["card.webp", "thumb.webp"], wanted, rederive=True) is None
    assert set_problem([], wanted, rederive=False) is None  # derives nothing: noop
    assert set_problem([], wanted, rederive=True) == "derived no variant"
    assert set_problem(["thumb.webp"], wanted, rederive=False) == "missing card.webp"
    assert set_problem(["thumb.webp", "card.webp", "x.png"], wanted, rederive=True) == (
        "not configured: x.png"
    )
    assert set_problem(["thumb.webp", "thumb.webp", "card.webp"], wanted, rederive=True) == (
        "twice: thumb.webp"
    )


@pytest.mark.parametrize("backend", ["noop", "faulthandlers:Partial"])
def test_a_backend_that_derives_fewer_variants_never_strips_a_file(
    dsn: str, store: dict[str, Any], queue: QueueDB, backend: str
) -> None:
    """The review's run: backfill --apply, then a drain with a backend that derives
    nothing (noop) or less than the configuration asks: every file keeps its old set,
    readable, and each re-derivation is rejected `processing_failed`; nothing retired."""
    old_cfg = config(dsn, store, V2)
    storage = open_storage(old_cfg)
    files = ready_files(old_cfg, ["ok"] * 3)
    old = {f: readable_set(dsn, storage, f) for f in files}
    keys = {f: queue.file_row(f)["derived_key"] for f in files}  # type: ignore[index]
    new_cfg = make_config(dsn, **store, derive={"backend": backend, "variants": V2})
    assert apply(queue, new_cfg).queued == 3
    drain(new_cfg)
    assert {f: readable_set(dsn, storage, f) for f in files} == old
    assert {f: queue.file_row(f)["derived_key"] for f in files} == keys  # type: ignore[index]
    assert [(j["status"], j["error_code"]) for j in jobs_of(dsn)] == [
        ("rejected", "processing_failed")
    ] * 3
    assert sql(dsn, "SELECT count(*) AS n FROM derivd_retired_objects") == [{"n": 0}]


def test_a_first_commit_of_fewer_variants_is_rejected_and_noop_still_commits(
    dsn: str, tmp_path: Path, queue: QueueDB
) -> None:
    """A first commit takes the configured set, or nothing at all (a backend that
    derives nothing by design: noop measures the queue with it); a partial set is a
    backend fault, final."""
    store = {"fs_root": tmp_path}
    partial = make_config(dsn, **store, derive={"backend": "faulthandlers:Partial",
                                                "variants": V2})  # fmt: skip
    (f,) = ready_files(partial, ["ok"])
    assert queue.statuses([f]) == {f: "rejected"}
    assert queue.file_row(f)["error_code"] == "processing_failed"  # type: ignore[index]
    assert queue.file_variants(f) == []
    noop = make_config(dsn, **store, derive={"backend": "noop", "variants": V2})
    (g,) = ready_files(noop, ["ok"])
    assert queue.statuses([g]) == {g: "ready"} and queue.file_variants(g) == []


def test_the_swap_refuses_a_set_made_for_another_target(
    dsn: str, tmp_path: Path, queue: QueueDB
) -> None:
    """The database holds each run's configured set: a worker still on the old
    configuration (its own check passes) cannot swap its set in for the run's target.
    The job is rejected in the same transaction; the file keeps its set."""
    store = {"fs_root": tmp_path}
    old_cfg, new_cfg = config(dsn, store, V1), config(dsn, store, V2)
    storage = open_storage(old_cfg)
    (f,) = ready_files(old_cfg, ["ok"])
    old = readable_set(dsn, storage, f)
    apply(queue, new_cfg)
    worker = make_worker(old_cfg, dsn)  # not reloaded: derives V1
    [job] = worker.claim_many(1)
    assert run_job(worker, job).outcome == "rederive_rejected"
    worker.close()
    assert readable_set(dsn, storage, f) == old
    [row] = jobs_of(dsn)
    assert (row["status"], row["error_code"]) == ("rejected", "processing_failed")
    events = sql(dsn, "SELECT kind, error_code FROM archive_events WHERE file_id = %s", (f,))
    assert {"kind": "rederive_rejected", "error_code": "processing_failed"} in events


# -- item 7: re-derivations are not files ------------------------------------------------


def test_rederivations_never_show_as_files(dsn: str, tmp_path: Path, queue: QueueDB) -> None:
    """Two files whose re-derivations keep failing, backfilled three times: the queue
    counts two ready files and nothing rejected (the share and the recent rejections
    included, so max_rejected_ratio never trips on a backfill), an app listing
    archive_files sees its two files only, and each file has one job row."""
    store = {"fs_root": tmp_path}
    old_cfg, new_cfg = config(dsn, store, V1), config(dsn, store, V2)
    files = ready_files(old_cfg, ["ok"] * 2)
    break_originals(dsn, old_cfg, files)
    for _ in range(3):
        assert apply(queue, new_cfg).queued == 2
        drain(new_cfg)
    assert [r["id"] for r in sql(dsn, "SELECT id FROM archive_files ORDER BY id")] == files
    stats = queue.queue_stats()
    assert stats.counts == {"ready": 2} and stats.rejected_ratio == 0.0
    limits = dataclasses.replace(new_cfg.status, max_age=0)
    report = collect(queue, limits)
    assert report.recent_rejected == 0 and report.rejected_by_code == {}
    assert [(j["file_id"], j["status"]) for j in jobs_of(dsn)] == [(f, "rejected") for f in files]


def test_retry_rejected_retries_rederivations_without_a_traceback(
    run_cli: Callable[..., subprocess.CompletedProcess[str]],
    dsn: str,
    tmp_path: Path,
    queue: QueueDB,
) -> None:
    """The review's run: a rejected re-derivation, then another backfill (the file has
    a live one again), then `derivd retry --rejected`: no UniqueViolation, the file's
    one job row is queued, and the command says what it did."""
    store = {"fs_root": tmp_path / "store"}
    (tmp_path / "store").mkdir()
    old_cfg, new_cfg = config(dsn, store, V1), config(dsn, store, V2)
    (f,) = ready_files(old_cfg, ["ok"])
    (rejected,) = ready_files(make_config(dsn, **store, derive={"backend": "faulthandlers:Script"}),
                              ["corrupt"])  # fmt: skip
    break_originals(dsn, old_cfg, [f])
    apply(queue, new_cfg)
    drain(new_cfg)
    apply(queue, new_cfg)  # queued again while the first one's row is rejected
    ini = write_ini(tmp_path / "derivd.ini", {
        "database": {"dsn": dsn},
        "storage": {"backend": "fs", "root": str(tmp_path / "store")},
        "derive": {"backend": "faulthandlers:Stamped", "variants": V2},
    })  # fmt: skip
    result = run_cli("-c", str(ini), "retry", "--rejected")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert f"queued again: {rejected}" in result.stdout
    assert [(j["file_id"], j["status"]) for j in jobs_of(dsn)] == [(f, "queued")]
    # With the job rejected again, the retry queues the re-derivation and says so.
    drain(new_cfg)
    result = run_cli("-c", str(ini), "retry", "--rejected")
    assert result.returncode == 0, result.stderr
    assert f"re-derivations queued again: {f}" in result.stdout
    assert [(j["file_id"], j["status"]) for j in jobs_of(dsn)] == [(f, "queued")]


# -- item 7: the heartbeat and a commit that races it ------------------------------------


def _blocked_by(dsn: str, pid: int) -> bool:
    rows = sql(dsn, "SELECT 1 FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (pid,))
    return bool(rows)


@pytest.mark.parametrize("rederive", [False, True])
def test_a_commit_between_the_heartbeats_snapshot_and_its_renewal_is_not_lost(
    dsn: str, tmp_path: Path, queue: QueueDB, rederive: bool
) -> None:
    """With renew = yes the heartbeat reads the held rows and then extends their leases.
    The race made to happen: the job's fenced commit holds the row (its transaction
    open) while the heartbeat starts; the heartbeat waits for the row, the commit ends,
    and the heartbeat's renewal finds the lease gone. It must find the attempt's own
    commit instead: not lost (for a re-derivation too, whose job row the commit ends)."""
    store = {"fs_root": tmp_path}
    cfg = config(dsn, store, V2)
    if rederive:
        ready_files(config(dsn, store, V1), ["ok"])
        apply(queue, cfg)
    else:
        storage = open_storage(cfg)
        key = new_original_key()
        queue.enqueue([(key, storage.put(key, b"ok", "text/plain"))])
    [job] = queue.claim_many(limit=1, lease_s=60, max_attempts=3, host=HOST.host)
    variants = [
        StoredVariant(s.split(".")[0], f"derived/{job.for_file}/{job.token}/{s}", "v",
                      "0" * 64, 1, 1, s.split(".")[1], "image/webp", fp)
        for s, fp in configured(cfg).items()
    ]  # fmt: skip
    answer: list[set[int]] = []
    with QueueDB(psycopg.connect(dsn)) as committing, QueueDB.open(dsn) as beating:
        # Inside an open transaction: the commit holds the job's row until it ends.
        assert committing.commit_many([Finished(job, variants)]) == {job.id}
        (pid,) = committing.conn.execute("SELECT pg_backend_pid()").fetchone() or ()
        thread = threading.Thread(
            target=lambda: answer.append(beating.heartbeat(HOST, [job], renew=True, lease_s=60))
        )
        thread.start()
        wait_for(lambda: _blocked_by(dsn, pid), "the heartbeat to wait for the job's row")
        committing.conn.commit()
        thread.join()
    assert answer == [{job.id}]
