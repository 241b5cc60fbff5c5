"""PDFs and videos through the whole supervisor, on both backends: the ones that end
ready and every hostile one of test_previews (a PDF claiming a million pages, a page
tree that loops, a 2^31-point page, a truncated MP4 without `moov`, a `moov` claiming a
65535 x 65535 frame, ten hours, an encrypted track, audio alone, garbled samples, a
PDF behind a JPEG) are uploaded to an fs store and queued; the real `derivd run
--burst` with two workers drains the queue. Each row must end as its case says on its
first attempt, with no timeout, retry or recycle; what a preview adds to the analysis
reaches the row, `derivd show`, derivd.client.result() and the webhook payload.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import imagegen
import pdfgen
import psycopg
import pytest
import videogen
from fixtures.burst import (
    burst_ends_on_first_attempt,
)
from fixtures.cli import run_cli
from pdfgen import HOSTILE_PDFS
from videogen import HOSTILE_VIDEOS

from derivd.client import result
from derivd.queue.db import QueueDB

MAX_WORKER_RSS_MB = 1024  # the default [supervisor] max_worker_rss_mb
JOB_TIMEOUT_S = 60

READY: dict[str, Callable[[], bytes]] = {
    "pdf_three_pages": lambda: pdfgen.pages(3),
    "pdf_rotated": lambda: pdfgen.pages(rotate=90),
    "pdf_encrypted_no_password": lambda: pdfgen.encrypted(b""),
    "pdf_behind_jpeg": lambda: pdfgen.behind_jpeg(imagegen.case("jpeg_baseline")),
    "h264_rotated_with_audio": lambda: videogen.clip(rotate=90, audio=True),
    "vp9": lambda: videogen.clip("vp9"),
    "av1": lambda: videogen.clip("av1"),
    "hevc_hdr_pq": lambda: videogen.hdr_clip("pq"),
}
HOSTILE = {**HOSTILE_PDFS, **HOSTILE_VIDEOS}


@pytest.mark.acceptance
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["vips", "pillow"])
def test_previews_end_with_their_outcome_through_the_supervisor(
    backend: str, dsn: str, fs_root: Path, tmp_path: Path
) -> None:
    hostile = HOSTILE
    names = [*READY, *hostile]
    cases = [
        (n, READY[n], "ready") if n in READY else (n, hostile[n][0], hostile[n][1]) for n in names
    ]
    ids, peaks = burst_ends_on_first_attempt(
        dsn, fs_root, tmp_path, cases, backend=backend, job_timeout=JOB_TIMEOUT_S,
        max_rss_mb=MAX_WORKER_RSS_MB, lease=120,
    )  # fmt: skip
    assert peaks and max(peaks.values()) < MAX_WORKER_RSS_MB, peaks

    video_id = ids["h264_rotated_with_audio"]
    pdf_id = ids["pdf_three_pages"]
    with psycopg.connect(dsn) as conn:
        video, document = result(conn, video_id).original, result(conn, pdf_id).original
        jpeg = result(conn, ids["pdf_behind_jpeg"]).original
    assert video is not None and document is not None and jpeg is not None
    assert (video.width, video.height, video.format) == (240, 320, "mp4")  # turned upright
    assert video.media == {"duration": 3.0, "frame_rate": 10.0, "codec": "h264",
                           "audio": True, "frame_time": 1.0}  # fmt: skip
    assert document.media == {"pages": 3, "page": 1, "page_size": [612.0, 792.0]}
    assert (jpeg.format, jpeg.media) == ("jpeg", None)

    ini = tmp_path / "derivd.ini"  # the run's configuration, for `derivd show`
    shown = run_cli("-c", str(ini), "show", "--json", str(video_id), check=True)
    assert json.loads(shown.stdout)["analysis"]["media"] == video.media
    text = run_cli("-c", str(ini), "show", str(pdf_id), check=True).stdout
    media_line = next(line for line in text.splitlines() if line.strip().startswith("media"))
    assert "pages 3" in media_line and "page_size [612.0, 792.0]" in media_line, text

    assert webhook_original(dsn, pdf_id)["media"] == document.media


def webhook_original(dsn: str, file_id: int) -> dict[str, object]:
    """The `original` object of the `file.ready` payload the outbox writes for the file."""
    with QueueDB.open(dsn, role="test") as queue:
        queue.sync_webhook_endpoints([{"name": "app", "events": ["file.ready"], "tenants": None}])
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT derivd_outbox(%s, 'file.ready')", (file_id,))
        row = conn.execute("SELECT body FROM derivd_deliveries WHERE file_id = %s", (file_id,))
        (body,) = row.fetchone() or ("{}",)
    original: dict[str, object] = json.loads(body)["data"]["original"]
    return original
