"""The demo gallery fits the window it is opened in: a 1600 px preview (the demo's own
`preview:1600`) is scaled down, whole, to a 1280 x 800 window instead of overflowing it
(its caption still says its real size)."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
from fixtures.pages import browser
from PIL import Image

from derivd.ops.gallery import Sample, write_gallery
from derivd.queue.db import StoredVariant
from derivd.storage.base import derived_key
from derivd.storage.fs import FsStorage

WINDOW = 1280
# How far the largest picture reaches past the window's visible width or height, and
# its aspect as shown (<= 0: it fits).
MEASURE = (
    "<script>const r = [...document.images].map((i) => i.getBoundingClientRect());"
    "document.body.dataset.overflow = Math.round(Math.max(...r.map((b) => Math.max("
    "b.right - document.documentElement.clientWidth, b.height - innerHeight))));"
    "document.body.dataset.aspect = (r[1].width / r[1].height).toFixed(2);</script>"
)


@pytest.mark.skipif(browser() is None, reason="no chromium for the browser check")
def test_a_1600px_preview_fits_a_1280px_window(tmp_path: Path) -> None:
    store = FsStorage(tmp_path / "store")
    sample = tmp_path / "photo.png"
    Image.new("RGB", (2000, 1500), (90, 120, 200)).save(sample)
    key = derived_key(1, uuid.uuid4(), "preview", "png")
    version = store.put(key, sample.read_bytes(), "image/png")
    variant = StoredVariant("preview", key, version, "ab" * 32, 1600, 1200, "png", "image/png")
    page = write_gallery(tmp_path / "demo", [Sample(sample, "ready", None, (variant,))], store)
    measured = page.with_name("measured.html")
    measured.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    dom = subprocess.run(
        [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         f"--user-data-dir={tmp_path / 'chromium'}", f"--window-size={WINDOW},800",
         "--dump-dom", measured.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    overflow = int(dom.split('data-overflow="', 1)[1].split('"', 1)[0])
    assert overflow <= 0, overflow
    assert 'data-aspect="1.33"' in dom  # 1600 x 1200, scaled whole
