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
    first_attempt_misses,
    outcomes,
    queue_originals,
    run_cleanly,
    write_burst_ini,
)
from fixtures.corpus import HEIC, READY, REJECTED

from derivd.storage.fs import FsStorage

MAX_WORKER_RSS_MB = 1024  # the default [supervisor] max_worker_rss_mb
JOB_TIMEOUT_S = 60  # a 12 MP HEIC takes ~2 s on a loaded 2-core machine


@pytest.mark.acceptance
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["vips", "pillow"])
def test_heic_corpus_ends_with_its_outcome_through_the_supervisor(
    backend: str, dsn: str, fs_root: Path, tmp_path: Path
) -> None:
    names = sorted(READY) + sorted(REJECTED)
    makers = [(lambda n=name: (HEIC / n).read_bytes()) for name in names]
    ids = queue_originals(dsn, FsStorage(fs_root), makers)
    ini = write_burst_ini(
        tmp_path / "derivd.ini",
        dsn=dsn,
        fs_root=fs_root,
        state_dir=tmp_path / "state",
        job_timeout=JOB_TIMEOUT_S,
        max_rss_mb=MAX_WORKER_RSS_MB,
        lease=120,
        derive=f"[derive]\nbackend = {backend}\n",
    )
    peaks = run_cleanly(ini, tmp_path / "derivd.log")

    rows, kinds = outcomes(dsn)
    expected = {
        file_id: (name, "ready" if name in READY else REJECTED[name])
        for file_id, name in zip(ids, names, strict=True)
    }
    wrong = first_attempt_misses(rows, expected)
    assert not wrong, "\n".join(wrong)
    assert "timeout" not in kinds and "retry" not in kinds and "exhausted" not in kinds
    assert peaks and max(peaks.values()) < MAX_WORKER_RSS_MB, peaks

    # Displayed dimensions reach the row: the portrait phone photo is portrait.
    with psycopg.connect(dsn) as conn:
        arrow = ids[names.index("arrow.heic")]
        row = conn.execute("SELECT width, height FROM archive_files WHERE id = %s", (arrow,))
        width, height = row.fetchone() or (0, 0)
    assert width < height
    print(f"{backend}: peak worker RSS {max(peaks.values()):.0f} MiB over {len(peaks)} workers")
