"""A worker killed while PDFium renders a page and while ffmpeg's libraries decode a
video: the attempt is charged (`worker_died`), the retry ends `ready`, and the history
checker's invariants hold over what the run left (harness.invariants).

The kill lands inside the decode: the worker's title names the job and its process has
mapped PDFium (or libavcodec), which it loads with its first such file and then spends
the job drawing (a page of 2 000 overlapping triangles) or decoding (a clip whose
keyframes are all black, so the frame search decodes its whole bound).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pdfgen
import psycopg
import pytest
import videogen
from fixtures.burst import queue_originals, write_burst_ini
from fixtures.cli import derivd_command
from helpers import proc_title, stop_process

from derivd.config_load import load_config
from derivd.osproc import children_of
from derivd.storage.fs import FsStorage
from harness import derive_log
from harness.history import Disruptions, load
from harness.invariants import Rules, check
from harness.listing import fs_objects

BOUND_S = 240  # a bound on a hang, not a timing assertion
REPO = Path(__file__).resolve().parents[2]  # harness.derive_log, imported by the workers
LOGGED_VIPS = derive_log.backend_for("vips")
T = TypeVar("T")


def heavy_page() -> bytes:
    rng = random.Random(1)
    triangles = b" ".join(
        b"%.2f %.2f %.2f rg %d %d m %d %d l %d %d l f" % (
            rng.random(), rng.random(), rng.random(), *(rng.randrange(600) for _ in range(6)))
        for _ in range(2000))  # fmt: skip
    return pdfgen.pages(content=triangles)


def black_clip() -> bytes:
    return videogen.clip(size=(1280, 720), seconds=6, fps=25, black_s=60, gop=25)


def decoding_worker(supervisor: int, job: int, library: str) -> int | None:
    """The worker running `job` once it has `library` mapped: inside the decode."""
    for pid in children_of(supervisor):
        if proc_title(pid).endswith(f" job {job}"):
            try:
                if library in Path(f"/proc/{pid}/maps").read_text():
                    return pid
            except OSError:
                return None
    return None


def wait_for(found: Callable[[], T | None], what: str) -> T:
    """The first value `found` gives that is not None (nor false)."""
    deadline = time.monotonic() + BOUND_S
    while not (value := found()):
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {BOUND_S} s")
        time.sleep(0.005)
    return value


@pytest.mark.acceptance
@pytest.mark.slow
def test_a_worker_killed_inside_a_decode_costs_that_attempt_only(
    dsn: str, fs_root: Path, tmp_path: Path
) -> None:
    ids = queue_originals(dsn, FsStorage(fs_root), [heavy_page, black_clip])
    ini = write_burst_ini(tmp_path / "derivd.ini", dsn=dsn, fs_root=fs_root,
                          state_dir=tmp_path / "state", job_timeout=120, max_rss_mb=1024,
                          lease=300, derive=f"[derive]\nbackend = {LOGGED_VIPS}\n")  # fmt: skip
    # One worker that titles itself with the job it runs (a pipelined one holds two).
    ini.write_text(ini.read_text().replace("workers = 2", "workers = 1\npipeline = 1"))
    # Each derive start is logged (harness.derive_log): the checker judges every charge
    # by it, and the kills below excuse the attempts they cut short.
    starts = tmp_path / "derives.jsonl"
    env = {
        **os.environ,
        derive_log.LOG_ENV: str(starts),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    kills: list[tuple[int, float]] = []
    log = (tmp_path / "derivd.log").open("wb")
    proc = subprocess.Popen([*derivd_command(), "-c", str(ini), "run"], stdout=log,
                            stderr=log, stdin=subprocess.DEVNULL, env=env)  # fmt: skip
    try:
        for job, library in zip(ids, ("pdfium", "libavcodec"), strict=True):
            pid = wait_for(lambda j=job, lib=library: decoding_worker(proc.pid, j, lib),
                           f"worker decoding job {job}")  # fmt: skip
            kills.append((pid, time.time()))
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: all(status == "ready" for status in statuses(dsn, ids)), "ready rows")
    finally:
        stop_process(proc)
        log.close()

    with psycopg.connect(dsn) as conn:
        attempts = [
            r[0]
            for r in conn.execute(
                "SELECT attempts FROM archive_files WHERE id = ANY(%s) ORDER BY id", (ids,)
            )
        ]
        died = {r[0] for r in conn.execute(
            "SELECT file_id FROM archive_events WHERE kind = 'worker_died'")}  # fmt: skip
    assert attempts == [2, 2] and died == set(ids)
    history = load(
        dsn, fs_objects(fs_root), derive_log.read(starts), Disruptions(kills=tuple(kills))
    )
    verdicts = check(history, Rules.from_config(load_config(ini)))
    assert all(v.ok for v in verdicts), [v.summary() for v in verdicts if not v.ok]


def statuses(dsn: str, ids: list[int]) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute(
            "SELECT status FROM archive_files WHERE id = ANY(%s)", (ids,))]  # fmt: skip
