"""The analysis of real photographs from the built-in backends to the app and the operator:
`derivd run --burst` (fs store) and a worker on S3 (moto), then the row, `client.result`,
`client.similar` and `derivd show --json`.

These need handlers that analyse: until then each
skips with one line, and turns on by itself once `derive` returns an Analysis.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import psycopg
import pytest
from configs import make_config
from fixtures.work import make_worker, run_one
from PIL import Image

from derivd import analysis_rules, client
from derivd.config import Config
from derivd.handlers.registry import create_handler
from derivd.queue.db import QueueDB
from derivd.storage.base import new_original_key
from derivd.storage.fs import FsStorage

RunCli = Callable[..., CompletedProcess[str]]


def photo(width: int, height: int, *, exif_rotated: bool = False) -> bytes:
    """A picture with structure (a diagonal gradient and a bright square off-centre), as
    JPEG; `exif_rotated` stores it sideways with EXIF orientation 6 (display rotated 90°
    clockwise): displayed, it is `width` x `height`."""
    image = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    image.paste((240, 200, 40), (width // 5, height // 4, width // 2, height // 2))
    exif = None
    if exif_rotated:
        image = image.transpose(Image.Transpose.ROTATE_90)  # stored sideways
        exif = Image.Exif()
        exif[0x0112] = 6
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90, exif=exif or Image.Exif())
    return buffer.getvalue()


def analyses(backend: str) -> bool:
    """Whether the backend's handler reports an analysis (a Derivation with `original`)."""
    spec = Config().replace("derive", backend=backend).derive_spec()
    derived = create_handler(backend, spec).derive(photo(64, 48), spec)
    return getattr(derived, "original", None) is not None


BACKENDS = [
    pytest.param(
        b,
        marks=pytest.mark.skipif(
            not analyses(b), reason=f"the {b} handler does not analyse originals yet"
        ),
    )
    for b in ("vips", "pillow")
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_burst_run_stores_the_analysis_and_every_view_shows_it(
    backend: str, run_cli: RunCli, dsn: str, fs_root: Path, tmp_path: Path
) -> None:
    store = FsStorage(fs_root)
    blobs = {
        "landscape": photo(1200, 800),
        "half": photo(600, 400),  # the same picture, half size
        "portrait": photo(600, 900, exif_rotated=True),
    }
    keys = [new_original_key() for _ in blobs]
    originals = [
        (k, store.put(k, b, "image/jpeg")) for k, b in zip(keys, blobs.values(), strict=True)
    ]
    with QueueDB.open(dsn) as queue:
        ids = dict(zip(blobs, queue.enqueue(originals), strict=True))
    env = {
        "DERIVD_DATABASE_DSN": dsn,
        "DERIVD_STORAGE_BACKEND": "fs",
        "DERIVD_STORAGE_ROOT": str(fs_root),
        "DERIVD_DERIVE_BACKEND": backend,
        "DERIVD_SUPERVISOR_WORKERS": "1",
        "DERIVD_SUPERVISOR_STATE_DIR": str(tmp_path / "state"),
    }
    run = run_cli("run", "--burst", env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr

    with psycopg.connect(dsn, autocommit=True) as conn:
        done = {name: client.result(conn, i) for name, i in ids.items()}
        assert {r.status for r in done.values()} == {"ready"}
        originals = {name: r.original for name, r in done.items()}
        assert all(o is not None for o in originals.values())
        landscape, half, portrait = originals["landscape"], originals["half"], originals["portrait"]
        assert landscape is not None and half is not None and portrait is not None
        assert (landscape.width, landscape.height, landscape.format) == (1200, 800, "jpeg")
        assert (portrait.width, portrait.height) == (600, 900)  # as displayed
        assert (landscape.frames, landscape.has_alpha) == (1, False)
        assert client.similar(conn, ids["landscape"])[0] == ids["half"]  # within 6 bits

    shown = run_cli("show", "--json", str(ids["portrait"]), env=env, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    stored = json.loads(shown.stdout)["analysis"]
    assert stored == {k: getattr(portrait, k) for k in stored}


@pytest.mark.parametrize("backend", BACKENDS[:1])
def test_a_worker_on_s3_stores_the_analysis(
    backend: str, dsn: str, s3_server: Any, s3_bucket: str
) -> None:
    config = make_config(
        dsn,
        s3={
            "bucket": s3_bucket,
            "endpoint_url": s3_server.endpoint_url,
            "region": "us-east-1",
            "prefix": "t/",
        },
        derive={"backend": backend, "variants": "thumb:64"},
    )
    worker = make_worker(config, dsn)
    key = new_original_key()
    (file_id,) = worker.queue.enqueue(
        [(key, worker.storage.put(key, photo(640, 480), "image/jpeg"))]
    )
    result = run_one(worker)
    worker.close()
    assert result is not None and result.outcome == "ready"
    with psycopg.connect(dsn, autocommit=True) as conn:
        original = client.result(conn, file_id).original
    assert original is not None and (original.width, original.height) == (640, 480)
    assert analysis_rules.COLOUR.fullmatch(original.colour) and original.colour.islower()
    assert analysis_rules.PLACEHOLDER.fullmatch(original.placeholder)
