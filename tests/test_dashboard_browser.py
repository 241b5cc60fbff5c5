"""The dashboard in a real browser: headless Chromium loads `/` from a running `derivd run`
and the rendered DOM's numbers are checked against the database and `derivd status`.

Skips (one line) when no Chromium is installed (`make system-deps` installs Debian's
`chromium` when it runs as root).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.cli import derivd_command
from fixtures.s3 import free_port
from helpers import sql, stop_process, wait_for
from test_dashboard import Cells

from derivd.queue.db import QueueDB
from derivd.storage.base import new_original_key
from derivd.storage.fs import FsStorage

TESTS_DIR = Path(__file__).resolve().parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def browser() -> str | None:
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


pytestmark = pytest.mark.skipif(
    browser() is None, reason="no chromium (Debian's chromium package) for the browser test"
)


def dump_dom(url: str, profile: Path) -> str:
    """The DOM after the page loaded, as Chromium serialises it."""
    exe = browser()
    assert exe is not None
    result = subprocess.run(
        [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def screenshot(url: str, profile: Path, out: Path) -> None:
    exe = browser()
    assert exe is not None
    subprocess.run(
        [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            "--window-size=1200,1000",
            f"--screenshot={out}",
            url,
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )


@pytest.fixture
def daemon(tmp_path: Path, dsn: str, fs_root: Path) -> Iterator[tuple[str, Path]]:
    """`derivd run` with the fault-script backend, 2 workers, the dashboard refreshing
    every second; jobs: 3 ok, 2 rejected (an unknown script), 1 hanging (in flight)."""
    storage = FsStorage(fs_root)
    originals = []
    for script in ("ok", "ok", "ok", "bogus", "bogus", "hang"):
        key = new_original_key()
        originals.append((key, storage.put(key, script.encode(), "text/plain")))
    with QueueDB.open(dsn, role="test") as queue:
        queue.enqueue(originals)
    listen = f"127.0.0.1:{free_port()}"
    ini = tmp_path / "derivd.ini"
    ini.write_text(
        f"[database]\ndsn = {dsn}\n"
        f"[storage]\nbackend = fs\nroot = {fs_root}\n"
        f"[supervisor]\nworkers = 2\njob_timeout = 100\nkill_grace = 1\nshutdown_grace = 1\n"
        f"state_dir = {tmp_path / 'state'}\n"
        "[queue]\nlease = 300\npoll_interval = 0.2\nlisten = no\nmax_attempts = 1\n"
        "[derive]\nbackend = faulthandlers:Script\n"
        f"[metrics]\nlisten = {listen}\ninterval = 1\n"
        "[status]\nmin_finished = 1\n"
    )
    path = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    log = (tmp_path / "derivd.log").open("wb")
    proc = subprocess.Popen(
        [*derivd_command(), "-c", str(ini), "run"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        yield f"http://{listen}/", ini
    finally:
        stop_process(proc)
        log.close()


def _settled(dsn: str) -> bool:
    rows = sql(dsn, "SELECT status, count(*) n FROM archive_files GROUP BY 1")
    return {r["status"]: r["n"] for r in rows} == {"ready": 3, "rejected": 2, "processing": 1}


def test_the_rendered_dashboard_matches_the_database(
    daemon: tuple[str, Path], dsn: str, tmp_path: Path
) -> None:
    url, ini = daemon
    wait_for(lambda: _settled(dsn), "3 ready, 2 rejected, 1 in flight", timeout=120)
    settled_at = time.time()
    profile = tmp_path / "chromium"

    def fresh() -> Cells | None:
        # The page is cached for [metrics] interval: wait for a snapshot taken after the
        # queue settled and showing the busy worker.
        page = Cells(dump_dom(url, profile))
        taken = float(page.ids.get("checked-at", {}).get("data-value") or 0)
        busy = page.rows.get(("data-host", os.uname().nodename), {}).get("busy")
        return page if taken > settled_at and busy == "1" else None

    page = wait_for(fresh, "a dashboard snapshot of the settled queue", timeout=120)

    rows = sql(dsn, "SELECT status, count(*) n FROM archive_files GROUP BY 1")
    counts = {r["status"]: r["n"] for r in rows}
    for status in ("queued", "processing", "ready", "rejected", "pending", "deleting", "deleted"):
        assert page.value("data-status", status, "n") == counts.get(status, 0), status
    codes = sql(
        dsn,
        "SELECT error_code, count(*) n FROM archive_events "
        "WHERE kind IN ('rejected', 'exhausted') GROUP BY 1",
    )
    for code in codes:
        assert page.value("data-code", code["error_code"], "n") == code["n"]
    # In flight: the hanging job, with its age from the database.
    (job,) = sql(
        dsn,
        "SELECT id, claimed_by, extract(epoch FROM now() - claimed_at) age FROM archive_files "
        "WHERE status = 'processing'",
    )
    assert float(page.ids["in-flight-total"]["data-value"]) == 1
    host = os.uname().nodename
    assert page.rows[("data-file", str(job["id"]))]["holder"] == job["claimed_by"] == host
    assert 0 < page.value("data-file", str(job["id"]), "age") <= float(job["age"])
    # Hosts: this supervisor, 2 workers, 1 busy.
    assert page.rows[("data-host", host)]["workers"] == "2"
    assert page.rows[("data-host", host)]["idle"] == "1"
    # The hour: every finishing event, per minute.
    finished = sql(
        dsn,
        "SELECT count(*) n FROM archive_events WHERE kind IN ('ready', 'rejected', 'exhausted')",
    )[0]["n"]
    assert finished == 5
    assert float(page.ids["finished-hour"]["data-value"]) == finished
    assert sum(int(b["data-finished"]) for b in page.bars) == finished
    # Signals and verdict as `derivd status` computes them.
    status = subprocess.run(
        [*derivd_command(), "-c", str(ini), "status", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    report = json.loads(status.stdout)
    assert status.returncode == 1 and report["healthy"] is False  # 40% rejected > 20%
    assert page.ids["verdict"]["class"].split()[-1] == "bad"
    assert page.value("data-signal", "expired_leases") == report["expired_leases"]
    assert page.value("data-signal", "recent_rejected_ratio") == pytest.approx(
        report["recent_rejected_ratio"]
    )
    assert page.value("data-signal", "recent_rejected_ratio", "limit") == 0.2
    problems = {p["signal"] for p in report["problems"]}
    assert problems == {"recent_rejected_ratio"}

    out = os.environ.get("PYTEST_DERIVD_SCREENSHOT")
    if out:  # PYTEST_DERIVD_SCREENSHOT=docs/dashboard.png: the README's picture
        screenshot(url, profile, Path(out))
