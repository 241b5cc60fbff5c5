"""Backfill under crashes, with the real supervisor: a SIGKILL of the worker, then of
the supervisor, in the middle of re-derivations. Each file stays `ready` with its old
set readable until a later attempt commits the new one; nothing is left unreferenced."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

from configs import make_config
from fixtures.backfill import (
    BACKEND,
    V1,
    V2,
    apply,
    configured,
    job_rows,
    readable_set,
    ready_files,
    sweep,
    unreferenced,
)
from fixtures.daemon import DaemonRun
from helpers import alive, sql, wait_for

from derivd.queue.db import QueueDB
from derivd.storage.configured import open_storage


def test_sigkill_of_the_worker_and_of_the_supervisor_mid_rederivation(
    supervisor: Callable[..., DaemonRun],
    dsn: str,
    fs_root: Path,
    tmp_path: Path,
) -> None:
    store = {"fs_root": fs_root}
    old_cfg = make_config(dsn, **store, derive={"backend": BACKEND, "variants": V1})
    new_cfg = make_config(dsn, **store, derive={"backend": BACKEND, "variants": V2})
    storage = open_storage(new_cfg)
    markers = [tmp_path / "first", tmp_path / "second"]
    for marker in markers:  # made ready at once; their re-derivations will hang once
        marker.touch()
    files = ready_files(old_cfg, [f"hang-once {m}" for m in markers])
    old = {f: readable_set(dsn, storage, f) for f in files}
    for marker in markers:
        marker.unlink()
    with QueueDB.open(dsn) as queue:
        assert apply(queue, new_cfg).queued == 2
    derive = {"backend": BACKEND, "variants": V2}
    # A hanging attempt must outlive the steps below (job_timeout would end it). One job
    # per worker (pipeline 1): a pipelined worker may claim both re-derivations before the
    # other worker's first claim, and the second would wait behind the first's hang.
    slow = {
        "supervisor": {"workers": "2", "pipeline": "1", "job_timeout": "10"},
        "queue": {"lease": "15"},
    }
    sup = supervisor(derive=derive, **slow).start()

    # 1. A worker dies mid re-derivation (hanging in the handler, marker made), while
    # the other worker hangs in the other one.
    wait_for(lambda: all(m.exists() for m in markers), "both under way", detail=sup.log)
    assert {f: readable_set(dsn, storage, f) for f in files} == old
    os.kill(sup.workers()[0], signal.SIGKILL)

    # 2. The supervisor dies while the other one hangs; the first one is done by then
    # (its supervisor gave it back at once, worker_died, and a new worker derived it).
    wait_for(
        lambda: len(job_rows(dsn)) == 1 and job_rows(dsn)[0]["status"] == "processing",
        "one re-derivation done, the other hanging",
        detail=sup.log,
    )
    workers = sup.workers()
    os.kill(sup.pid, signal.SIGKILL)
    sup.wait_exit()
    wait_for(lambda: not any(alive(p) for p in workers), "workers gone with their parent")
    (hanging,) = job_rows(dsn)
    second = hanging["file_id"]
    (first,) = set(files) - {second}
    assert readable_set(dsn, storage, second) == old[second]
    assert readable_set(dsn, storage, first) == configured(new_cfg) != old[first]

    # 3. After its lease, the next supervisor reclaims it and commits the new set.
    wait_for(
        lambda: sql(
            dsn,
            "SELECT 1 FROM derivd_rederivations WHERE file_id = %s AND lease_until < now()",
            (second,),
        ),
        "the dead supervisor's lease to expire",
    )
    sup2 = supervisor(derive=derive, **slow).start()
    wait_for(lambda: job_rows(dsn) == [], "the second re-derivation committed", detail=sup2.log)
    sup2.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert sup2.wait_exit() == 0
    for f in files:
        assert readable_set(dsn, storage, f) == configured(new_cfg)
    with QueueDB.open(dsn) as queue:
        sweep(queue, storage)
        assert unreferenced(queue, storage) == set()
        assert apply(queue, new_cfg).queued == 0
