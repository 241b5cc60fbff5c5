"""The worker's side of a lost commit, in one process: a commit-and-claim that fails
(here: the server ends the worker's connection) sends its fenced commit again before
calling any attempt unknown (the daemon's cases at every depth are
tests/test_worker_guarantees.py). Direct only: the fault finds the worker's server
connection by its name."""

from __future__ import annotations

from pathlib import Path

from configs import make_config
from fixtures.work import Recorder
from helpers import sql

from derivd.handlers.base import Handler
from derivd.handlers.registry import create_handler
from derivd.queue.db import QueueDB
from derivd.storage.fs import FsStorage
from derivd.worker import Worker
from derivd.worker_loop import run


class DropsItsConnection:
    """The noop handler, whose first job has the server end the worker's connection
    (pg_terminate_backend): the worker's next statement, its commit-and-claim, fails."""

    def __init__(self, inner: Handler, dsn: str, application_name: str) -> None:
        self.inner = inner
        self.name = inner.name
        self.reads_original = False
        self.dsn = dsn
        self.application_name = application_name
        self.dropped = False

    def derive(self, original: bytes, spec: object) -> object:
        if not self.dropped:
            self.dropped = True
            killed = sql(
                self.dsn,
                "SELECT pg_terminate_backend(pid) AS ok FROM pg_stat_activity"
                " WHERE application_name = %s",
                (self.application_name,),
            )
            assert [r["ok"] for r in killed] == [True]
        return self.inner.derive(original, spec)  # type: ignore[arg-type]


def test_a_failed_commit_and_claim_sends_the_commit_again_before_calling_it_unknown(
    dsn: str, direct_dsn: str, tmp_path: Path
) -> None:
    """Before: the worker called the attempt `unknown`; its row stayed `processing` for a
    lease, was derived again, and on its last attempt ended attempts_exhausted though it
    had succeeded."""
    config = make_config(dsn, fs_root=tmp_path, derive={"backend": "noop"})
    queue = QueueDB.open(dsn, role="derivd-victim")
    (file_id, other) = queue.enqueue([("originals/a", "v"), ("originals/b", "v")])
    noop = create_handler("noop", config.derive_spec())
    handler = DropsItsConnection(noop, direct_dsn, queue.application_name)
    worker = Worker(config, queue=queue, storage=FsStorage(tmp_path), handler=handler)  # type: ignore[arg-type]
    recorder = Recorder()
    worker.hooks = recorder
    try:
        assert run(worker, lambda: False, burst=True) == "drained"
    finally:
        worker.close()
    # The first commit carried the next claim; both went with the connection.
    outcomes = sorted((r.job.id, r.job.attempt, r.outcome) for r in recorder.results)
    assert outcomes == [(file_id, 1, "ready"), (other, 1, "ready")]
    rows = sql(dsn, "SELECT id, status FROM archive_files ORDER BY id")
    assert rows == [{"id": file_id, "status": "ready"}, {"id": other, "status": "ready"}]
    for done in (file_id, other):
        kinds = [r["kind"] for r in sql(dsn, "SELECT kind FROM archive_events WHERE file_id = %s",
                                             (done,))]  # fmt: skip
        assert kinds == ["ready"]
