"""What the supervisor and a worker load. The supervisor forks its workers, and libvips
(its threads and caches) must never cross a fork (DESIGN "Fork safety"), so it imports no
image library, before or after it forked workers that did. A vips worker loads libvips
alone until its first analysis (numpy), a JPEG (simplejpeg), a HEIC (pi-heif) or an
animated AVIF or smart crop (Pillow) needs more: each library costs boot time and
resident memory in every worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from configs import write_ini
from fixtures.corpus import HEIC
from imagegen import jpeg, png_rgb

from derivd import client
from derivd.storage.fs import FsStorage

IMAGE_LIBRARIES = {"pyvips", "PIL", "simplejpeg", "numpy"}

# Runs `derivd ARGS` in this interpreter and prints, as the process exits, the top-level
# modules it loaded: only the supervisor exits through atexit (workers end in os._exit).
_LOADED_AT_EXIT = """
import atexit, json, sys
atexit.register(lambda: print("MODULES " + json.dumps(sorted({m.split(".")[0]
                                                            for m in sys.modules}))))
from derivd.cli import main
sys.argv = ["derivd", *sys.argv[1:]]
main()
"""


def _top_level_modules(stdout: str) -> set[str]:
    line = next(line for line in stdout.splitlines() if line.startswith("MODULES "))
    return set(json.loads(line.removeprefix("MODULES ")))


def test_the_supervisor_imports_no_image_library(dsn: str, tmp_path: Path) -> None:
    """A real `run --burst` with two vips workers, which load libvips and derive a JPEG."""
    store = FsStorage(tmp_path / "store")
    version = store.put("originals/photo", jpeg(), "image/jpeg")
    with psycopg.connect(dsn, autocommit=True) as conn:
        file_id = client.enqueue(conn, "originals/photo", version)
    ini = write_ini(tmp_path / "derivd.ini", {
        "database": {"dsn": dsn},
        "storage": {"backend": "fs", "root": tmp_path / "store"},
        "supervisor": {"workers": 2, "state_dir": tmp_path / "state"},
        "derive": {"backend": "vips"},
    })  # fmt: skip
    ran = subprocess.run(
        [sys.executable, "-c", _LOADED_AT_EXIT, "-c", str(ini), "run", "--burst"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    loaded = _top_level_modules(ran.stdout)
    assert "psycopg" in loaded  # the check sees the supervisor's real imports
    assert not loaded & IMAGE_LIBRARIES
    with psycopg.connect(dsn) as conn:
        assert client.result(conn, file_id).status == "ready"  # a worker did load libvips


# A worker's imports after fork, in a fresh interpreter: create the handler and derive.
# argv: the formats of the first variant (comma-separated), then the originals.
_DERIVE_AND_LIST = """
import json, sys
from derivd.handlers.base import DeriveSpec, VariantSpec
from derivd.handlers.registry import create_handler
formats = tuple(sys.argv[1].split(","))
spec = DeriveSpec(variants=(VariantSpec("thumb", long_edge=64, formats=formats),
                            VariantSpec("cover", box=(32, 32), fit="cover", formats=("avif",))))
handler = create_handler("vips", spec)
for path in sys.argv[2:]:
    handler.derive(open(path, "rb").read(), spec)
print("MODULES " + json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def _loaded_by_a_vips_worker(*originals: Path, formats: str = "webp") -> set[str]:
    ran = subprocess.run(
        [sys.executable, "-c", _DERIVE_AND_LIST, formats, *map(str, originals)],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    return _top_level_modules(ran.stdout)


def test_a_vips_worker_loads_pillow_only_to_write_a_jpeg_and_never_libheif_for_one(
    tmp_path: Path,
) -> None:
    """Pillow's libjpeg-turbo writes JPEG variants (vips_variants._jpeg); reading a JPEG
    original needs simplejpeg only."""
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(jpeg())
    loaded = _loaded_by_a_vips_worker(photo)
    assert {"pyvips", "simplejpeg"} <= loaded  # libjpeg-turbo's scaled decode (jpegscale)
    assert not loaded & {"PIL", "pi_heif"}
    writing = _loaded_by_a_vips_worker(photo, formats="jpeg,webp")
    assert "PIL" in writing
    assert "pi_heif" not in writing


def test_a_vips_worker_boots_without_numpy() -> None:
    """The handler made, nothing derived: numpy (~40 ms, ~4 MiB) waits for the first
    analysis, simplejpeg for the first JPEG."""
    loaded = _loaded_by_a_vips_worker()
    assert "pyvips" in loaded
    assert not loaded & {"simplejpeg", "numpy", "PIL", "pi_heif"}


def test_a_vips_worker_loads_numpy_for_the_analysis_and_simplejpeg_only_for_a_jpeg(
    tmp_path: Path,
) -> None:
    picture = tmp_path / "picture.png"
    picture.write_bytes(png_rgb())
    loaded = _loaded_by_a_vips_worker(picture)
    assert {"pyvips", "numpy"} <= loaded  # the analysis' arithmetic
    assert not loaded & {"simplejpeg", "PIL", "pi_heif"}


def test_a_vips_worker_loads_libheif_with_its_first_heic() -> None:
    """The other side of the test above: the lazy load does happen, and the HEIC derives."""
    iphone = HEIC / "arrow.heic"
    if not iphone.exists():
        pytest.skip("tests/corpus/heic is absent")
    assert {"pi_heif", "PIL"} <= _loaded_by_a_vips_worker(iphone)
