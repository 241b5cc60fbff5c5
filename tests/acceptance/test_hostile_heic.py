"""Every HEIC/HEIF corpus file through the whole supervisor, on both backends.

The files of tests/corpus/heic (phone photos, deep and alpha files, multi-image files,
a corrupt and a truncated one, one with no decoder in this build, and three bombs) are
uploaded to an fs store and queued; the real `derivd run --burst` with two workers drains
the queue. Each row must end as test_handlers_heic's tables say on its first attempt
(ready with its analysis, or rejected with the code), with no timeout, retry or
recycle, and the workers' peak RSS (VmHWM, sampled while they run) under the default
`max_worker_rss_mb`: the bombs are refused from their headers.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from fixtures.burst import (
    burst_ends_on_first_attempt,
)
from fixtures.corpus import HEIC, READY, REJECTED

MAX_WORKER_RSS_MB = 1024  # the default [supervisor] max_worker_rss_mb
JOB_TIMEOUT_S = 60  # a 12 MP HEIC takes ~2 s on a loaded 2-core machine


@pytest.mark.acceptance
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["vips", "pillow"])
def test_heic_corpus_ends_with_its_outcome_through_the_supervisor(
    backend: str, dsn: str, fs_root: Path, tmp_path: Path
) -> None:
    names = sorted(READY) + sorted(REJECTED)
    cases = [
        (n, (lambda n=n: (HEIC / n).read_bytes()), "ready" if n in READY else REJECTED[n])
        for n in names
    ]
    ids, peaks = burst_ends_on_first_attempt(
        dsn, fs_root, tmp_path, cases, backend=backend, job_timeout=JOB_TIMEOUT_S,
        max_rss_mb=MAX_WORKER_RSS_MB, lease=120,
    )  # fmt: skip
    assert peaks and max(peaks.values()) < MAX_WORKER_RSS_MB, peaks

    # Displayed dimensions reach the row: the portrait phone photo is portrait.
    with psycopg.connect(dsn) as conn:
        arrow = ids["arrow.heic"]
        row = conn.execute("SELECT width, height FROM archive_files WHERE id = %s", (arrow,))
        width, height = row.fetchone() or (0, 0)
    assert width < height
    print(f"{backend}: peak worker RSS {max(peaks.values()):.0f} MiB over {len(peaks)} workers")
