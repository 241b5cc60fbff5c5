"""The lease protocol under the pipelined worker (`[supervisor] pipeline = 2`): `derivd
run` with one worker holding two jobs at different stages, caught there with events (a
gate file the fault handler waits for, the fault proxy holding the PUTs), never with
sleeps. Real PostgreSQL, moto's S3 server behind the fault proxy, the fs store."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from configs import make_config
from fixtures.daemon import FAST, DaemonRun, kinds, processing_rows
from fixtures.faultproxy import FaultProxy
from fixtures.s3 import TEST_REGION, MotoServer
from fixtures.work import Recorder, make_worker
from helpers import enqueue_scripts, sql, wait_for

from derivd.queue.db import Job, QueueDB
from derivd.storage.base import new_original_key
from derivd.storage.s3 import S3Storage
from derivd.worker_loop import run

PIPELINED = {"supervisor": {"pipeline": "2"}}


class S3Supervisor(DaemonRun):
    """A `derivd run` whose store is moto's S3 through the fault proxy; originals go to
    moto directly, so the proxy's faults meet the worker only."""

    def __init__(self, base: DaemonRun, direct: S3Storage) -> None:
        self.__dict__.update(base.__dict__)
        self.s3 = direct
        self.base = base

    def start(self, *args: str, env_extra: dict[str, str] | None = None) -> DaemonRun:
        super().start(*args, env_extra=env_extra)
        # The fixture that made `base` stops what it started: this process too (a copy
        # that kept its own `proc` left daemons running after their test).
        self.base.proc = self.proc
        return self

    def enqueue(self, *scripts: str) -> list[int]:
        return enqueue_scripts(self.dsn, self.s3, scripts)


@pytest.fixture
def pipelined(tmp_path: Path, dsn: str, fs_root: Path) -> Iterator[Callable[..., DaemonRun]]:
    made: list[DaemonRun] = []

    def make(**settings: dict[str, str]) -> DaemonRun:
        merged = {name: dict(values) for name, values in FAST.items()}
        for extra in (PIPELINED, settings):
            for name, values in extra.items():
                merged.setdefault(name, {}).update(values)
        sup = DaemonRun(tmp_path, dsn, fs_root, merged)
        made.append(sup)
        return sup

    yield make
    for sup in made:
        workers = sup.workers() if sup.proc and sup.proc.poll() is None else []
        sup.stop()
        for pid in workers:
            if os.path.exists(f"/proc/{pid}"):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def on_s3(
    pipelined: Callable[..., DaemonRun],
    s3_server: MotoServer,
    faulty_s3: tuple[str, FaultProxy],
    s3_bucket: str,
) -> Callable[..., tuple[S3Supervisor, FaultProxy]]:
    url, proxy = faulty_s3

    def make(**settings: dict[str, str]) -> tuple[S3Supervisor, FaultProxy]:
        storage = {"backend": "s3", "bucket": s3_bucket, "endpoint_url": url}
        base = pipelined(
            storage={**storage, "region": TEST_REGION},
            derive={"backend": "faulthandlers:Stamped"},
            **settings,
        )
        direct = S3Storage(
            bucket=s3_bucket, endpoint_url=s3_server.endpoint_url, region=TEST_REGION
        )
        return S3Supervisor(base, direct), proxy

    return make


def in_flight_together(sup: DaemonRun, first: int, second: int) -> None:
    """Both jobs are claimed by the one worker (the second while the first derives)."""
    for file_id in (first, second):
        wait_for(lambda f=file_id: sup.status_is(f, "processing"), f"file {file_id} claimed")


def stopping(sup: DaemonRun) -> None:
    sup.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    # The supervisor logs this, then passes SIGTERM on to its worker.
    wait_for(lambda: "stopping" in sup.log(), "the supervisor stopping")


def test_a_late_deadline_check_fails_the_hanging_job_and_releases_the_one_behind_it(
    pipelined: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    """The supervisor looks at the deadlines late (stopped with SIGSTOP, as a host under
    load may leave it) well past the hanging job's: the kill is its own, failed
    `timeout`; the job claimed behind it only waited (held, never started: no deadline
    of its own) and goes back unburned."""
    # A lease that outlasts the freeze, the kill's grace and the release: the job behind
    # must go back by its release, not by its lease running out.
    sup = pipelined(queue={"lease": "20", "retry_base": "30", "retry_max": "30"}).start()
    marker = tmp_path / "marker"
    hanging, behind = sup.enqueue(f"hang-once {marker}", "ok")
    wait_for(marker.exists, "the first job's derive to hang")
    in_flight_together(sup, hanging, behind)
    both_started_by = time.monotonic()
    job_timeout = float(FAST["supervisor"]["job_timeout"])
    sup.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        wait_for(
            lambda: time.monotonic() > both_started_by + job_timeout + 0.5,
            "both deadlines past while the supervisor is stopped",
        )
    finally:
        sup.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
    row = wait_for(lambda: sup.status_is(hanging, "queued"), "the hanging job failed")
    assert row["attempts"] == 1 and sorted(kinds(sup, hanging)) == ["retry", "timeout"]
    row = wait_for(lambda: sup.status_is(behind, "ready"), "the job behind it ready")
    assert row["attempts"] == 1  # released unburned, then derived once
    assert "released" in kinds(sup, behind) and "timeout" not in kinds(sup, behind)


@dataclass
class StopMidClaim:
    """What `stop_mid_claim` saw: the lane's claim and the releases in the order they
    were sent, the loop's return, and the two jobs."""

    deriving: int
    waiting: int
    calls: list[str] = field(default_factory=list)
    outcome: list[str] = field(default_factory=list)
    released: threading.Event = field(default_factory=threading.Event)


def stop_mid_claim(
    dsn: str,
    fs_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    before_claim: Callable[[StopMidClaim], None],
) -> StopMidClaim:
    """One pipelined worker in this process, two jobs: the first derives behind a gate,
    the second waits for its GET, held until the stop. The gate opens; the store lane
    sends the first job's commit with the next claim folded in, decided before any stop,
    and is held there while the stop is requested; then `before_claim` runs (it may wait,
    or raise as a bug would) and the claim is sent."""
    config = make_config(
        dsn, fs_root=fs_root, derive={"backend": "faulthandlers:Script"}, supervisor={"pipeline": 2}
    )
    worker = make_worker(config, dsn)
    worker.hooks = Recorder()
    gate = tmp_path / "gate"
    seen = StopMidClaim(*enqueue_scripts(dsn, worker.storage, [f"gate {gate}", "ok"]))
    claim_held, stop = threading.Event(), threading.Event()
    commit_and_claim, release, fetch = (
        worker.queue.commit_and_claim,
        worker.queue.release,
        worker.fetch,
    )

    def held_commit_and_claim(*args: Any, **kwargs: Any) -> Any:
        claim_held.set()
        stop.wait(60)
        before_claim(seen)
        answer = commit_and_claim(*args, **kwargs)
        seen.calls.append("claim answered")
        return answer

    def recorded_release(job: Job) -> bool:
        seen.calls.append(f"release {job.id}")
        seen.released.set()
        return release(job)

    def held_fetch(job: Job) -> bytes:
        if job.id == seen.waiting:
            stop.wait(60)
        return fetch(job)

    monkeypatch.setattr(worker.queue, "commit_and_claim", held_commit_and_claim)
    monkeypatch.setattr(worker.queue, "release", recorded_release)
    monkeypatch.setattr(worker, "fetch", held_fetch)
    loop = threading.Thread(
        target=lambda: seen.outcome.append(run(worker, stop.is_set, burst=True)), daemon=True
    )
    loop.start()
    try:
        wait_for(Path(f"{gate}.started").exists, "the first job deriving")
        wait_for(lambda: file_row(dsn, seen.waiting)["status"] == "processing", "the 2nd claimed")
        gate.touch()
        wait_for(claim_held.is_set, "the lane's commit with its claim")
        stop.set()
        loop.join(LOOP_BOUND_S)
        assert not loop.is_alive(), "the stopping worker still waits"
    finally:
        stop.set()
        seen.released.set()
        worker.close()
    return seen


LOOP_BOUND_S = 60.0  # a bound on a hang, not a timing assertion


def file_row(dsn: str, file_id: int) -> dict[str, Any]:
    with QueueDB.open(dsn, role="test") as queue:
        row = queue.file_row(file_id)
    assert row is not None
    return row


def event_kinds(dsn: str, file_id: int) -> list[str]:
    with QueueDB.open(dsn, role="test") as queue:
        return [e["kind"] for e in queue.file_events(file_id)]


def test_a_stop_releases_the_waiting_job_only_once_the_lanes_claim_is_answered(
    dsn: str, fs_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Released while the lane's claim is on its way, the row is free for that claim to
    take straight back, and the stop releases it a second time (seen in CI:
    `['released', 'released']`). The claim is held until a release is sent, for at most
    2 s: the release must wait for the claim's answer."""
    seen = stop_mid_claim(
        dsn, fs_root, tmp_path, monkeypatch, lambda seen: bool(seen.released.wait(2))
    )
    assert seen.outcome == ["stopped"]
    assert seen.calls == ["claim answered", f"release {seen.waiting}"]
    row = file_row(dsn, seen.waiting)
    assert (row["status"], row["attempts"], row["lease_token"]) == ("queued", 0, None)
    assert event_kinds(dsn, seen.waiting) == ["released"]
    assert file_row(dsn, seen.deriving)["status"] == "ready"


def test_a_stop_never_waits_forever_on_a_claim_whose_commit_step_failed(
    dsn: str, fs_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release waits for claims on their way; a commit step that raises (a bug, not
    an outage) must end its claim too, or the stop would wait on it forever. The job
    waiting is still given back once, unburned; the one committing keeps its lease
    (its outcome unknown, as for any failed commit)."""

    def bug(seen: StopMidClaim) -> None:
        raise RuntimeError("a bug in the commit step")

    seen = stop_mid_claim(dsn, fs_root, tmp_path, monkeypatch, bug)
    assert seen.outcome == ["stopped"]
    assert seen.calls == [f"release {seen.waiting}"]
    row = file_row(dsn, seen.waiting)
    assert (row["status"], row["attempts"], row["lease_token"]) == ("queued", 0, None)
    assert event_kinds(dsn, seen.waiting) == ["released"]
    assert file_row(dsn, seen.deriving)["status"] == "processing"


def test_sigterm_lets_the_job_being_stored_and_the_one_deriving_finish(
    on_s3: Callable[..., tuple[S3Supervisor, FaultProxy]], tmp_path: Path
) -> None:
    sup, proxy = on_s3()
    proxy.hold("PUT")
    sup.start()
    gate = tmp_path / "gate"
    storing, deriving = sup.enqueue("ok", f"gate {gate}")
    wait_for(lambda: proxy.snapshot().get("held", 0) >= 1, "the first job's PUTs held")
    wait_for(Path(f"{gate}.started").exists, "the second job deriving")
    stopping(sup)
    proxy.release()
    gate.touch()
    assert sup.wait_exit() == 0
    for file_id in (storing, deriving):
        row = sup.row(file_id)
        assert (row["status"], row["attempts"]) == ("ready", 1)
        assert not {"released", "retry", "timeout"} & set(kinds(sup, file_id))
    assert processing_rows(sup.dsn) == 0


def test_job_timeout_of_the_job_being_stored_fails_it_and_releases_the_other(
    on_s3: Callable[..., tuple[S3Supervisor, FaultProxy]], tmp_path: Path
) -> None:
    sup, proxy = on_s3(queue={"retry_base": "30", "retry_max": "30", "heartbeat": "0.5"})
    proxy.hold("PUT")
    sup.start()
    gate = tmp_path / "gate"
    [storing] = sup.enqueue("ok")
    wait_for(lambda: proxy.snapshot().get("held", 0) >= 1, "the first job's PUTs held")
    [deriving] = sup.enqueue(f"gate {gate}")
    wait_for(Path(f"{gate}.started").exists, "the second job deriving")
    timed_out = wait_for(
        lambda: sup.status_is(storing, "queued"), "the stored job's timeout", timeout=30
    )
    assert timed_out["attempts"] == 1 and timed_out["lease_token"] is None
    assert sorted(kinds(sup, storing)) == ["retry", "timeout"]
    released = wait_for(lambda: "released" in kinds(sup, deriving) or None, "the other released")
    assert released
    assert sup.row(deriving)["attempts"] in (0, 1)  # released unburned (or reclaimed since)
    proxy.release()
    gate.touch()
    row = wait_for(lambda: sup.status_is(deriving, "ready"), "the released job ready")
    assert row["attempts"] == 1
    assert "timeout" not in kinds(sup, deriving)
    assert "job timed out" in sup.log()


def test_a_storage_outage_mid_pipeline_retries_each_job_on_its_own(
    on_s3: Callable[..., tuple[S3Supervisor, FaultProxy]], tmp_path: Path
) -> None:
    # Deadlines far off: botocore's own retries of a 503 take a while.
    sup, proxy = on_s3(queue={"lease": "30"}, supervisor={"job_timeout": "20"})
    proxy.hold("PUT")
    sup.start()
    gate = tmp_path / "gate"
    storing, deriving = sup.enqueue("ok", f"gate {gate}")
    wait_for(lambda: proxy.snapshot().get("held", 0) >= 1, "the first job's PUTs held")
    wait_for(Path(f"{gate}.started").exists, "the second job deriving")
    proxy.fail(p=1.0, code="ServiceUnavailable")  # the held PUTs meet the outage
    proxy.release()
    wait_for(lambda: "retry" in kinds(sup, storing) or None, "the stored job retried")
    gate.touch()  # the second one's PUTs meet it too
    wait_for(lambda: "retry" in kinds(sup, deriving) or None, "the derived job retried")
    proxy.pass_through()
    for file_id in (storing, deriving):
        row = wait_for(lambda f=file_id: sup.status_is(f, "ready"), f"file {file_id} ready")
        assert row["attempts"] >= 2
        assert not {"lease_lost", "released"} & set(kinds(sup, file_id))
    assert processing_rows(sup.dsn) == 0


def test_heartbeat_kills_only_the_job_whose_lease_is_lost(
    pipelined: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    """The running job's row is deleted: the heartbeat kills its worker and records
    `lease_lost` on it; the job held behind it did nothing wrong and goes back unburned.
    (A held job's own lost lease kills nothing: it would be refused at its commit.)"""
    sup = pipelined(queue={"heartbeat": "0.5"}).start()
    gate = tmp_path / "gate"
    deriving, waiting = sup.enqueue(f"gate {gate}", "ok")
    wait_for(Path(f"{gate}.started").exists, "the first job deriving")
    in_flight_together(sup, deriving, waiting)
    with QueueDB.open(sup.dsn, role="test") as queue:
        assert queue.request_delete([deriving], actor="test") == [deriving]
    wait_for(lambda: "lease_lost" in kinds(sup, deriving) or None, "the lost job recorded")
    released = wait_for(lambda: "released" in kinds(sup, waiting) or None, "the other released")
    assert released
    row = wait_for(lambda: sup.status_is(waiting, "ready"), "the innocent job ready")
    assert row["attempts"] == 1  # its attempt was given back, not burned
    assert not {"lease_lost", "timeout", "retry"} & set(kinds(sup, waiting))
    assert kinds(sup, deriving).count("lease_lost") == 1


def test_a_lease_lost_while_waiting_in_the_pipeline_is_never_committed(
    dsn: str, fs_root: Path
) -> None:
    """In one process: the first job's PUTs wait (an event) while its lease goes to
    another claimant; its commit is refused (`lease_lost`), its objects stay with their
    write-ahead records for the orphan sweep, and the job behind it commits."""
    from configs import make_config
    from fixtures.stores import BeforePut
    from fixtures.work import Recorder, make_worker

    from derivd.ops.sweep import Sweeper
    from derivd.storage.fs import FsStorage

    store = FsStorage(fs_root)
    config = make_config(
        dsn,
        fs_root=fs_root,
        derive={"backend": "faulthandlers:Stamped"},
        supervisor={"pipeline": 2},
    )
    with QueueDB.open(dsn, role="test") as queue:
        keys = [new_original_key(), new_original_key()]
        first, second = queue.enqueue([(k, store.put(k, b"ok", "text/plain")) for k in keys])
    arrived, go_on = threading.Event(), threading.Event()
    thief: list[Job] = []

    def hold_the_first(key: str) -> None:
        if key.startswith(f"derived/{first}/") and not arrived.is_set():
            arrived.set()
            assert go_on.wait(60)

    worker = make_worker(config, dsn, BeforePut(store, hold_the_first))
    recorder = Recorder()
    worker.hooks = recorder
    outcome: list[str] = []
    runner = threading.Thread(target=lambda: outcome.append(run(worker, lambda: False, burst=True)))
    runner.start()
    try:
        assert arrived.wait(60)
        # Another claimant takes the expired lease over (a reclaim: a new token, the
        # attempt counted), in one statement, so this worker cannot reclaim it first.
        steal = (
            "UPDATE archive_files SET lease_token = gen_random_uuid(), attempts = attempts + 1,"
            " lease_until = now() + interval '60 s' WHERE id = %s"
            " RETURNING lease_token, attempts"
        )
        stolen = sql(dsn, steal, (first,))[0]
        thief.append(Job(first, stolen["lease_token"], stolen["attempts"], "k", "v", 0.0))
        go_on.set()
        runner.join(60)
    finally:
        go_on.set()
        worker.close()
    assert outcome == ["drained"] and [j.id for j in thief] == [first]
    results = {r.job.id: r.outcome for r in recorder.results}
    assert results == {first: "lease_lost", second: "ready"}
    row = sql(dsn, "SELECT status, lease_token FROM archive_files WHERE id = %s", (first,))[0]
    assert (row["status"], row["lease_token"]) == ("processing", thief[0].token)  # not ours
    lost_token = next(r.job.token for r in recorder.results if r.job.id == first)
    written = {k for k in store.list_keys(f"derived/{first}/") if str(lost_token) in k}
    assert written  # its PUTs went out...
    rows = sql(dsn, "SELECT key FROM pending_objects WHERE lease_token = %s", (lost_token,))
    pending = {r["key"] for r in rows}
    assert pending and all(any(k.startswith(p) for p in pending) for k in written)  # recorded
    variants = sql(dsn, "SELECT count(*) AS n FROM archive_variants WHERE file_id = %s", (first,))
    assert variants[0]["n"] == 0
    # The thief's lease ends (it gives the job back); the guard passes; the sweep takes them.
    with QueueDB.open(dsn, role="thief") as other:
        assert other.release(thief[0])
        sql(dsn, "UPDATE pending_objects SET created_at = created_at - interval '31 s'")
        report = Sweeper(other, store, orphan_guard=30.0, delete_guard=30.0).run_once()
    assert report.error is None and report.objects_deleted >= len(written)
    assert not {k for k in store.list_keys(f"derived/{first}/") if str(lost_token) in k}
    assert list(store.list_keys(f"derived/{second}/"))  # the committed job's objects stay
