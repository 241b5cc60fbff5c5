"""`derivd retry`, `derivd delete` and `derivd sweep` as an operator runs them: the real
console script against the test database and an fs store."""

from __future__ import annotations

import getpass
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import pytest
from fixtures.work import claim_one, commit_one
from helpers import sql

from derivd.errors import ErrorCode
from derivd.queue.db import QueueDB
from derivd.storage.base import derived_key
from derivd.storage.fs import FsStorage

RunCli = Callable[..., CompletedProcess[str]]
LEASE = 60.0


@pytest.fixture
def cli(run_cli: RunCli, dsn: str, fs_root: Path, tmp_path: Path) -> Callable[..., Any]:
    """Run `derivd ARGS` on the test database and store, from an empty directory (so
    no etc/derivd.ini of the checkout is read)."""
    env = {
        "DERIVD_DATABASE_DSN": dsn,
        "DERIVD_STORAGE_BACKEND": "fs",
        "DERIVD_STORAGE_ROOT": str(fs_root),
    }

    def call(*args: str) -> CompletedProcess[str]:
        result = run_cli(*args, env=env, cwd=tmp_path)
        assert "Traceback" not in result.stderr, result.stderr
        return result

    return call


def expected_actor() -> str:
    return f"cli:{getpass.getuser()}@{socket.gethostname()}"


def new_file(queue: QueueDB, storage: FsStorage) -> int:
    key = f"originals/{uuid.uuid4().hex}"
    (file_id,) = queue.enqueue([(key, storage.put(key, b"original", "image/jpeg"))])
    return file_id


def rejected_file(queue: QueueDB, storage: FsStorage, code: ErrorCode) -> int:
    file_id = new_file(queue, storage)
    job = claim_one(queue, lease_s=LEASE, max_attempts=3)
    assert job is not None and job.id == file_id
    assert queue.fail(job, retry=False, code=code, max_attempts=3) == "rejected"
    return file_id


def ready_file(queue: QueueDB, storage: FsStorage) -> int:
    file_id = new_file(queue, storage)
    job = claim_one(queue, lease_s=LEASE, max_attempts=3)
    assert job is not None and job.id == file_id
    assert commit_one(queue, job, [])
    return file_id


def lines(result: CompletedProcess[str]) -> list[str]:
    return result.stdout.splitlines()


# --------------------------------------------------------------------------- retry


def test_retry_by_id_requeues_rejected_rows_and_names_the_operator(
    cli: Callable[..., CompletedProcess[str]], queue: QueueDB, fs_root: Path
) -> None:
    storage = FsStorage(fs_root)
    rejected = rejected_file(queue, storage, "corrupt_content")
    ready = ready_file(queue, storage)

    result = cli("retry", str(rejected), str(ready), "999999")
    assert result.returncode == 1  # an unknown id is an operator's typo
    assert lines(result) == [
        f"queued again: {rejected}",
        f"not rejected, left alone: {ready} (ready)",
        "unknown: 999999",
    ]
    row = queue.file_row(rejected)
    assert row is not None
    assert (row["status"], row["attempts"], row["error_code"]) == ("queued", 0, None)
    assert queue.file_row(ready)["status"] == "ready"  # type: ignore[index]
    (event,) = sql(
        queue.dsn or "",
        "SELECT actor FROM archive_events WHERE file_id = %s AND kind = 'operator_retry'",
        (rejected,),
    )
    assert event["actor"] == expected_actor()

    # The retried row is an ordinary queued row again: a worker can claim it.
    job = claim_one(queue, lease_s=LEASE, max_attempts=3)
    assert job is not None and (job.id, job.attempt) == (rejected, 1)


def test_retry_all_rejected_of_one_code(
    cli: Callable[..., CompletedProcess[str]], queue: QueueDB, fs_root: Path
) -> None:
    storage = FsStorage(fs_root)
    corrupt = rejected_file(queue, storage, "corrupt_content")
    exhausted = [rejected_file(queue, storage, "attempts_exhausted") for _ in range(2)]

    result = cli("retry", "--rejected", "--code", "attempts_exhausted")
    assert result.returncode == 0
    assert lines(result) == [f"queued again: {' '.join(map(str, exhausted))}"]
    assert queue.file_row(corrupt)["status"] == "rejected"  # type: ignore[index]

    again = cli("retry", "--rejected", "--code", "attempts_exhausted")
    assert (again.returncode, lines(again)) == (0, ["nothing to retry"])

    everything = cli("retry", "--rejected")
    assert lines(everything) == [f"queued again: {corrupt}"]
    statuses = {r["status"] for r in sql(queue.dsn or "", "SELECT status FROM archive_files")}
    assert statuses == {"queued"}


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        ((), "give file ids, or --rejected"),
        (("1", "--rejected"), "not both"),
        (("1", "--code", "corrupt_content"), "use it with --rejected"),
    ],
)
def test_retry_usage_errors_are_one_line(
    cli: Callable[..., CompletedProcess[str]], args: tuple[str, ...], complaint: str
) -> None:
    result = cli("retry", *args)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("derivd: ") and complaint in line


# --------------------------------------------------------------------------- delete + sweep


def test_delete_then_sweep_removes_the_file_and_all_its_objects(
    cli: Callable[..., CompletedProcess[str]], queue: QueueDB, fs_root: Path
) -> None:
    storage = FsStorage(fs_root)
    file_id = new_file(queue, storage)
    job = claim_one(queue, lease_s=LEASE, max_attempts=3)
    assert job is not None
    key = derived_key(file_id, job.token, "thumb")
    queue.register_pending(job, [key])
    storage.put(key, b"webp", "image/webp")
    keep = new_file(queue, storage)  # another file, which must survive

    result = cli("delete", str(file_id), "999999")
    assert result.returncode == 1
    assert lines(result) == [f"accepted (now deleting): {file_id}", "unknown: 999999"]
    # The running attempt lost its right to commit.
    assert commit_one(queue, job, []) is False
    (event,) = sql(
        queue.dsn or "",
        "SELECT actor FROM archive_events WHERE file_id = %s AND kind = 'delete_requested'",
        (file_id,),
    )
    assert event["actor"] == expected_actor()

    again = cli("delete", str(file_id))
    assert (again.returncode, lines(again)) == (0, [f"already deleting: {file_id}"])

    # Within [sweep] delete_guard (300 s by default) nothing is removed yet.
    early = cli("sweep")
    assert early.returncode == 0, early.stderr
    assert lines(early)[-1].startswith("sweep: 0 exhausted, 0 orphan(s), 0 deletion(s)")
    assert len(list(storage.list_keys())) == 3

    swept = cli("sweep", "--delete-guard", "0")
    assert swept.returncode == 0, swept.stderr
    assert f"deleted: {file_id}" in lines(swept)
    assert list(storage.list_keys()) == [queue.file_row(keep)["original_key"]]  # type: ignore[index]
    assert queue.file_row(file_id)["status"] == "deleted"  # type: ignore[index]

    gone = cli("delete", str(file_id))
    assert (gone.returncode, lines(gone)) == (0, [f"already deleted: {file_id}"])


def test_sweep_prints_the_orphans_it_removes(
    cli: Callable[..., CompletedProcess[str]], queue: QueueDB, fs_root: Path
) -> None:
    storage = FsStorage(fs_root)
    new_file(queue, storage)
    job = claim_one(queue, lease_s=LEASE, max_attempts=3)
    assert job is not None
    key = derived_key(job.id, job.token, "preview")
    queue.register_pending(job, [key])
    storage.put(key, b"webp", "image/webp")
    assert queue.fail(job, retry=True, code="processing_failed", max_attempts=3) == "queued"

    kept = cli("sweep")  # [sweep] orphan_guard is an hour by default
    assert "orphan removed" not in kept.stdout
    assert key in set(storage.list_keys())

    swept = cli("sweep", "--orphan-guard", "0")
    assert swept.returncode == 0, swept.stderr
    assert lines(swept) == [
        f"orphan removed: {key}",
        "sweep: 0 exhausted, 1 orphan(s), 0 deletion(s), 1 object version(s) removed",
    ]
    assert key not in set(storage.list_keys())


def test_help_teaches_the_failure_commands(cli: Callable[..., CompletedProcess[str]]) -> None:
    top = cli("--help").stdout
    for command in ("retry", "delete", "sweep"):
        assert f"  {command}" in top
    assert "orphan_guard" in cli("sweep", "--help").stdout
    assert "delete_guard" in cli("delete", "--help").stdout
    assert "--code attempts_exhausted" in cli("retry", "--help").stdout


def test_a_rejected_file_can_be_deleted(
    cli: Callable[..., CompletedProcess[str]], queue: QueueDB, fs_root: Path
) -> None:
    """Found by bench/backfill_chaos.py: `derivd delete` of a rejected file broke the
    row's own CHECK (a rejected row has an error code, any other none), exit 1 with the
    failing row printed. The code stays in the file's events."""
    storage = FsStorage(fs_root)
    file_id = rejected_file(queue, storage, "corrupt_content")
    result = cli("delete", str(file_id))
    assert (result.returncode, lines(result)) == (0, [f"accepted (now deleting): {file_id}"])
    swept = cli("sweep", "--delete-guard", "0")
    assert f"deleted: {file_id}" in lines(swept)
    assert queue.file_row(file_id)["status"] == "deleted"  # type: ignore[index]
    assert list(storage.list_keys()) == []
    codes = sql(
        queue.dsn or "",
        "SELECT error_code FROM archive_events WHERE file_id = %s AND kind = 'rejected'",
        (file_id,),
    )
    assert codes == [{"error_code": "corrupt_content"}]
