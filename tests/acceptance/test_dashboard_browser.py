"""The dashboard in a real browser: headless Chromium loads `/` from a running `derivd run`
and the rendered DOM's numbers are checked against the database and `derivd status`.

Skips (one line) when no Chromium is installed (`make system-deps` installs Debian's
`chromium` when it runs as root).
"""

from __future__ import annotations

import html
import io
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fixtures.cli import derivd_command, support_pythonpath
from fixtures.pages import Cells, browser, screenshot
from fixtures.s3 import free_port
from helpers import sql, stop_process, wait_for
from PIL import Image

from derivd.ops.dashboard_page import STYLE, chart
from derivd.ops.dashboard_view import Minute
from derivd.ops.gallery import ORIGINAL_BOX, Sample, fit, write_gallery
from derivd.queue.db import QueueDB, StoredVariant
from derivd.storage.base import new_original_key
from derivd.storage.fs import FsStorage

pytestmark = pytest.mark.skipif(
    browser() is None, reason="no chromium (Debian's chromium package) for the browser test"
)


def dump_dom(url: str, profile: Path, *, wait_ms: int = 0) -> str:
    """The DOM after the page loaded, as Chromium serialises it (after `wait_ms` of
    virtual time: long enough for a page's own script to finish)."""
    exe = browser()
    assert exe is not None
    waiting = [f"--virtual-time-budget={wait_ms}"] if wait_ms else []
    result = subprocess.run(
        [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--window-size=1400,1000",
            f"--user-data-dir={profile}",
            *waiting,
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


@pytest.fixture
def daemon(tmp_path: Path, dsn: str, fs_root: Path) -> Iterator[tuple[str, Path]]:
    """`derivd run` with the fault-script backend, 2 workers, the dashboard refreshing
    every second; jobs: 3 ok, 2 rejected (an unknown script), then 1 hanging (in flight)."""
    storage = FsStorage(fs_root)
    _enqueue(dsn, storage, ("ok", "ok", "ok", "bogus", "bogus"))
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
        "[status]\nmin_finished = 1\nfail_on_rejected = yes\n"
    )
    path = support_pythonpath(os.environ)
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
        # The hanging job is queued once the others are final: claimed while one of them
        # was still queued, it could have a pipelined worker claim that one behind it (a
        # claim skips the rows another claim is locking), to wait there for the hang.
        wait_for(lambda: _counts(dsn) == {"ready": 3, "rejected": 2}, "the quick jobs final",
                 timeout=120)  # fmt: skip
        _enqueue(dsn, storage, ("hang",))
        yield f"http://{listen}/", ini
    finally:
        stop_process(proc)
        log.close()


def _enqueue(dsn: str, storage: FsStorage, scripts: tuple[str, ...]) -> None:
    originals = []
    for script in scripts:
        key = new_original_key()
        originals.append((key, storage.put(key, script.encode(), "text/plain")))
    with QueueDB.open(dsn, role="test") as queue:
        queue.enqueue(originals)


def _counts(dsn: str) -> dict[str, int]:
    rows = sql(dsn, "SELECT status, count(*) n FROM archive_files GROUP BY 1")
    return {r["status"]: r["n"] for r in rows}


def _settled(dsn: str) -> bool:
    return _counts(dsn) == {"ready": 3, "rejected": 2, "processing": 1}


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
    assert status.returncode == 1 and report["healthy"] is False  # 40% rejected > 20%, failing
    assert page.ids["verdict"]["class"].split()[-1] == "bad"
    assert page.value("data-signal", "expired_leases") == report["expired_leases"]
    assert page.value("data-signal", "recent_rejected_ratio") == pytest.approx(
        report["recent_rejected_ratio"]
    )
    assert page.value("data-signal", "recent_rejected_ratio", "limit") == 0.2
    problems = {p["signal"] for p in report["problems"]}
    assert problems == {"recent_rejected_ratio"}

    out = os.environ.get("PYTEST_DERIVD_SCREENSHOT")
    if out:  # PYTEST_DERIVD_SCREENSHOT=docs/dashboard.png: operating.md's picture
        screenshot(url, profile, Path(out))


# --------------------------------------------------------------------------- measured


MEASURE = """
<script>
window.addEventListener("load", async () => {
  for (const img of document.images) img.loading = "eager";
  await Promise.all([...document.images].map(
    (img) => img.complete ? null : new Promise((done) => { img.onload = img.onerror = done; })));
  const out = document.createElement("pre");
  out.id = "measured";
  out.textContent = JSON.stringify((() => { %s })());
  document.body.append(out);
});
</script>
"""


def measured(page: Path, script: str, profile: Path) -> Any:
    """What `script` (a function body returning JSON-able data) finds in `page` as
    Chromium lays it out, every image loaded (or failed). The page is copied beside
    itself with the script added, so its relative images still resolve."""
    probe = page.with_name(f"measure-{page.name}")
    text = page.read_text(encoding="utf-8")
    probe.write_text(text.replace("</body>", MEASURE % script + "</body>"), encoding="utf-8")
    dom = dump_dom(probe.as_uri(), profile, wait_ms=20000)
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    return json.loads(html.unescape(found.group(1)))


def _image(path: Path, size: tuple[int, int], fmt: str, mode: str = "RGB") -> Path:
    Image.new(mode, size, (40, 120, 200)).save(path, fmt)
    return path


def _variant(store: FsStorage, n: int, name: str, size: tuple[int, int]) -> StoredVariant:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 90, 40)).save(buffer, "WEBP")
    key = f"derived/{n}/token/{name}.webp"
    return StoredVariant(
        name, key, store.put(key, buffer.getvalue(), "image/webp"), "ab" * 32, *size
    )


GALLERY_SCRIPT = """
const figures = [...document.querySelectorAll("figure")].map((f) => {
  const img = f.querySelector("img"), box = (img || f.querySelector(".nothing"));
  const rect = box.getBoundingClientRect();
  return {kind: f.dataset.kind, name: f.dataset.name, img: !!img,
          loaded: img ? img.complete && img.naturalWidth > 0 : null,
          natural: img ? [img.naturalWidth, img.naturalHeight] : null,
          shown: [Math.round(rect.width), Math.round(rect.height)]};
});
return figures;
"""


def test_the_gallery_shows_real_sizes_and_no_broken_image(tmp_path: Path) -> None:
    """Every picture was capped at 360x240, so a thumbnail looked as large as its
    preview, and the sample that is not an image showed a broken-image icon."""
    store = FsStorage(tmp_path / "store")
    samples = [
        Sample(
            _image(tmp_path / "photo.jpg", (1200, 900), "JPEG"),
            "ready",
            None,
            [_variant(store, 1, "preview", (800, 600)), _variant(store, 1, "thumb", (160, 120))],
        ),
        Sample(_image(tmp_path / "scan.tif", (600, 450), "TIFF"), "ready", None, []),
        Sample(tmp_path / "bad-not-an-image.jpg", "rejected", "unsupported_content", []),
    ]
    samples[2].path.write_bytes(b"<html>not a JPEG</html>")
    page = write_gallery(tmp_path / "demo", samples, store)
    figures = measured(page, GALLERY_SCRIPT, tmp_path / "chromium")
    by_name = {f["name"]: f for f in figures}
    assert all(f["loaded"] for f in figures if f["img"]), figures  # no broken image
    preview, thumb = by_name["preview"], by_name["thumb"]
    assert (preview["shown"], thumb["shown"]) == ([800, 600], [160, 120])  # real sizes
    assert preview["natural"] == [800, 600] and thumb["natural"] == [160, 120]
    photo = by_name["original: photo.jpg"]
    assert photo["shown"] == list(fit((1200, 900), ORIGINAL_BOX)) == [480, 360]
    assert by_name["original: scan.tif"]["shown"] == [480, 360]  # its PNG preview
    bad = by_name["original: bad-not-an-image.jpg"]
    assert not bad["img"] and bad["shown"][0] > 0  # a labelled frame, no image
    assert "nothing to show" in page.read_text()


CHART_SCRIPT = """
const svg = document.getElementById("chart"), width = svg.viewBox.baseVal.width;
const texts = [...svg.querySelectorAll("text")].map((t) => {
  const b = t.getBBox();
  return {text: t.textContent, left: b.x, right: b.x + b.width};
});
const line = svg.querySelector("polyline.median");
const dots = svg.querySelectorAll("circle.median-dot").length;
return {width, texts, line: line ? line.getTotalLength() : 0, dots};
"""


def _chart_page(path: Path, minutes: list[Minute]) -> Path:
    path.write_text(
        f"<!doctype html><html><head><style>{STYLE}</style></head><body>"
        f"{chart(minutes, time.time())}</body></html>",
        encoding="utf-8",
    )
    return path


def test_the_chart_keeps_its_labels_inside_and_draws_a_lone_median(tmp_path: Path) -> None:
    """The right-hand label (the slowest median) was cut at the picture's edge, and one
    minute of data drew a median line of one point: nothing."""
    profile = tmp_path / "chromium"
    lone = measured(
        _chart_page(tmp_path / "lone.html", [Minute(0, 3, 0.25)]), CHART_SCRIPT, profile
    )
    assert lone["line"] > 5 or lone["dots"] == 1, lone  # something to see
    wide = [Minute(ago, 12_345, 3599.0 - ago) for ago in range(0, 60, 7)]
    found = measured(_chart_page(tmp_path / "wide.html", wide), CHART_SCRIPT, profile)
    assert {t["text"] for t in found["texts"]} >= {"12,345/min", "59m59s", "now", "-60 min"}
    for label in found["texts"]:
        assert label["left"] >= 0 and label["right"] <= found["width"], label
